"""Running Python in a fresh process, as ``subprocess.run([sys.executable, *argv])`` does,
without paying ``import torch`` (about 2 s of CPU) each time.

Each run is a new process forked from a server (multiprocessing's ``forkserver``, started
once per test worker) that imported ``torch`` and ``tiercheck`` and nothing else: no store
was opened there, no thread started, so the process holds no state of its own, as a fresh
interpreter would not. The command line's three forms work: ``["-c", code, *args]``,
``["-m", module, *args]`` and ``[script, *args]``, with ``sys.argv``, ``sys.path[0]`` and
``__main__`` as Python sets them; on return, non-daemon threads are joined and ``atexit``
handlers run, as at an interpreter's exit. Output always goes through files and comes back
on the result (or, without ``capture_output``, is written to this process's streams).

Not for a test of what a fresh interpreter imports (a module the server preloaded is
there already) or of signals and exit itself: those start ``sys.executable``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

# one server per test worker, for these runs and for torchrun's launcher (tests/_dist.py)
SERVER = multiprocessing.get_context("forkserver")
SERVER.set_forkserver_preload(["torch", "tiercheck", "torch.distributed.run"])


def redirect_output(out: str, err: str) -> None:
    """In a forked child: its stdout and stderr (fds 1 and 2) into the files ``out`` and
    ``err``, which its own children inherit."""
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)


def _child(argv: list[str], env: dict[str, str], cwd: str | None, out: str, err: str) -> None:
    import atexit
    import runpy
    import threading
    import types

    redirect_output(out, err)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit does
    atexit._run_exitfuncs()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run(
    argv: Sequence[str],
    *,
    capture_output: bool = False,
    text: bool = False,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *argv], ...)`` in a forked fresh process (the
    module docstring). Output is text whatever ``text`` says (every caller reads text)."""
    del text
    args = [sys.executable, *argv]
    with tempfile.TemporaryDirectory(prefix="fresh-") as scratch:
        out, err = os.path.join(scratch, "out"), os.path.join(scratch, "err")
        proc = SERVER.Process(
            target=_child,
            args=(
                list(argv),
                dict(env if env is not None else os.environ),
                None if cwd is None else str(cwd),
                out,
                err,
            ),
        )
        proc.start()
        proc.join(timeout)
        stdout, stderr = _read(out), _read(err)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(args, timeout or 0.0, stdout, stderr)
    if not capture_output:
        sys.stdout.write(stdout)
        sys.stderr.write(stderr)
    result = subprocess.CompletedProcess(
        args, proc.exitcode, stdout if capture_output else None, stderr if capture_output else None
    )
    if check:
        result.check_returncode()
    return result


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""
