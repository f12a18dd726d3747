"""Launching real multi-process runs for the tests: a free loopback port and torchrun.

Each launch runs torchrun's own entry point, ``torch.distributed.run.main``, with the
arguments its command line takes; its elastic agent starts every rank as a fresh Python
process, as ``torchrun`` does. Only the launcher itself is not a fresh interpreter: it is
forked from a server process (multiprocessing's ``forkserver``, started once per test
worker, shared with :mod:`_fresh`) that imported ``torch.distributed.run`` once.
``import torch`` costs about 2 s of CPU, and the suite launches torchrun about 60 times;
the ranks, the code under test, still pay their own imports.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

from _fresh import SERVER, redirect_output


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launcher(argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    """The launcher process: torchrun's main with ``argv``, its output (and its ranks')
    in the files ``out`` and ``err``, its exit status torchrun's."""
    redirect_output(out, err)
    os.environ.clear()
    os.environ.update(env)
    code = 0
    try:
        from torch.distributed.run import main

        main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # torchrun's ChildFailedError: what its command line prints
        traceback.print_exc()
        code = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


class TorchRun:
    """One torchrun launch with the command-line arguments ``argv`` (after ``torchrun``)
    and the environment ``env``; :meth:`wait` as ``subprocess.run`` reports it."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]):
        self.args = ["torchrun", *argv]
        self._dir = tempfile.mkdtemp(prefix="torchrun-")
        self._out = os.path.join(self._dir, "out")
        self._err = os.path.join(self._dir, "err")
        self._proc = SERVER.Process(
            target=_launcher, args=(list(argv), dict(env), self._out, self._err), daemon=False
        )
        self._proc.start()

    def wait(self, timeout: float) -> subprocess.CompletedProcess[str]:
        """The launch's status and output once it ends; past ``timeout`` seconds it is
        killed and ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
        self._proc.join(timeout)
        try:
            if self._proc.exitcode is None:
                self.kill()
                raise subprocess.TimeoutExpired(self.args, timeout, output=self._read(self._out))
            return subprocess.CompletedProcess(
                self.args, self._proc.exitcode, self._read(self._out), self._read(self._err)
            )
        finally:
            if self._proc.exitcode is not None:
                self._cleanup()

    def kill(self) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join()

    def _read(self, path: str) -> str:
        try:
            return Path(path).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def _cleanup(self) -> None:
        for path in (self._out, self._err):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)


def launch(
    script: Path,
    *args: str,
    nproc: int = 2,
    env: Mapping[str, str] | None = None,
    rendezvous: Sequence[str] | None = None,
) -> TorchRun:
    """Start ``script`` under torchrun with ``nproc`` processes on this host (rendezvous on
    loopback unless ``rendezvous`` gives torchrun's options for it, one OpenMP thread each)."""
    where = (
        list(rendezvous)
        if rendezvous is not None
        else ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    )
    argv = ["--nproc-per-node", str(nproc), *where, str(script), *args]
    return TorchRun(argv, {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def torchrun(
    script: Path,
    *args: str,
    nproc: int = 2,
    env: Mapping[str, str] | None = None,
    timeout: float = 200,
    rendezvous: Sequence[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under torchrun (:func:`launch`) and wait for it; output captured as
    text."""
    return launch(script, *args, nproc=nproc, env=env, rendezvous=rendezvous).wait(timeout)
