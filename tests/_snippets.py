"""Finding and running the ```python blocks of the documentation (tests/test_doc_snippets.py).

Convention:

- the ```python blocks of one page run in order, in one namespace, in a fresh process
  whose working directory is a fresh temporary directory;
- a block whose fence is immediately preceded by the line
  ``<!-- snippet: skip (REASON) -->`` is not run (only for what a test process cannot have:
  several torchrun processes, a GPU, a cluster; a real test elsewhere covers the same code);
- nothing else is skipped, and there is no hidden setup: a snippet stands alone;
- a comment that states what a line prints is checked: a ``print(...)`` call whose line
  ends with ``# -> TEXT`` must print exactly ``TEXT`` (trailing blanks aside; ``...`` in
  ``TEXT`` stands for any text) each time it runs, and must run at least once. This is the
  only way a snippet states output: ``# -> `` after a ``print``, nowhere else; a comment
  that merely describes (``# a pointer to a version``) is prose and is not checked. Keep
  such a ``print`` on one line that ``ruff format`` leaves whole (it formats docs/ too).

Each page runs in a child forked from a *zygote* (``python tests/_snippets.py serve``) that
imported torch and tiercheck once and does nothing else, so a page pays no interpreter start
and no page sees what another page (or another test) did to the process: seeds, registered
tier schemes, logging.

Protocol: the zygote reads one JSON line ``{"page", "cwd", "output", "result"}`` per page on
stdin, forks a child that runs the page with ``cwd`` as working directory, its stdout and
stderr going to ``output``, and its verdict written to ``result`` as JSON
(``{"ran": [lines], "error": text or null}``); then the zygote writes one JSON line
``{"status": N}`` (the child's exit status) on stdout.
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

_SKIP = re.compile(r"^<!--\s*snippet:\s*skip\s*\((?P<reason>.*\S.*)\)\s*-->$")
_MARKER = re.compile(r"^<!--\s*snippet\b")
_OPEN = re.compile(r"^(?P<fence>```+|~~~+)\s*(?P<info>[^`\s]*)")
_STATES = re.compile(r"\bprint\(.*#\s*->\s?(?P<text>.*?)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced python block: the page line of its first code line, its source, and the
    reason it is skipped (None when it runs)."""

    page: Path
    line: int
    code: str
    skip: str | None

    @property
    def where(self) -> str:
        page = self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page
        return f"{page.as_posix()}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The python blocks of ``page``, in order. Raises ValueError for a snippet marker that
    is not exactly ``<!-- snippet: skip (REASON) -->`` right before a python fence."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if _MARKER.match(line.strip()):
            nxt = _OPEN.match(lines[i + 1]) if i + 1 < len(lines) else None
            if _SKIP.match(line.strip()) is None or nxt is None:
                raise ValueError(
                    f"{page.name}:{i + 1}: {line.strip()!r} is not a "
                    "'<!-- snippet: skip (REASON) -->' line right before a ```python fence"
                )
        m = _OPEN.match(line)
        if m is None:
            i += 1
            continue
        fence, info = m.group("fence"), m.group("info").lower()
        end = i + 1
        while end < len(lines) and not lines[end].startswith(fence):
            end += 1
        if info in ("python", "py"):
            skip = _SKIP.match(lines[i - 1].strip()) if i > 0 else None
            code = "\n".join(lines[i + 1 : end]) + "\n"
            out.append(Block(page, i + 2, code, skip.group("reason").strip() if skip else None))
        elif i > 0 and _SKIP.match(lines[i - 1].strip()):
            raise ValueError(f"{page.name}:{i}: a snippet marker before a {info!r} block")
        i = end + 1
    return out


def stated_outputs(block: Block) -> dict[int, str]:
    """The lines of ``block`` (page line numbers) whose comment states what they print
    (``print(...)  # -> TEXT``), each with its ``TEXT``."""
    out = {}
    for i, line in enumerate(block.code.splitlines()):
        m = _STATES.search(line)
        if m is not None:
            out[block.line + i] = m.group("text")
    return out


def output_matches(stated: str, printed: str) -> bool:
    """Whether ``printed`` is what a ``# -> stated`` comment says (``...``: any text)."""
    pattern = ".*".join(re.escape(part) for part in stated.split("..."))
    return re.fullmatch(pattern, printed.rstrip(), flags=re.DOTALL) is not None


class _Printed:
    """A ``print`` for the snippets' namespace: prints as the builtin does, and keeps what
    each call made on a line of ``page`` that states its output."""

    def __init__(self, page: Path, lines: set[int]) -> None:
        self.page, self.lines = str(page), lines
        self.seen: dict[int, list[str]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        import builtins

        caller = sys._getframe(1)
        line = caller.f_lineno
        if caller.f_code.co_filename == self.page and line in self.lines and "file" not in kwargs:
            sep, end = kwargs.get("sep", " "), kwargs.get("end", "\n")
            text = (" " if sep is None else sep).join(map(str, args))
            self.seen.setdefault(line, []).append(text)
            sys.stdout.write(text + ("\n" if end is None else end))
            return
        builtins.print(*args, **kwargs)


def run_blocks(page: Path) -> list[int]:
    """Run the page's blocks here (this process, its working directory), in one namespace.

    Returns the lines of the blocks run; raises AssertionError naming the block that failed,
    with the traceback from the snippet's own frame on, or the line whose printed output is
    not what its ``# -> `` comment states.
    """
    blocks = blocks_of(page)
    stated = {n: text for b in blocks if b.skip is None for n, text in stated_outputs(b).items()}
    printed = _Printed(page, set(stated))
    namespace: dict[str, Any] = {"__name__": "__main__", "print": printed}
    ran = []
    for block in blocks:
        if block.skip is not None:
            continue
        # blank lines before the code put its line numbers where they are in the page
        code = compile("\n" * (block.line - 1) + block.code, str(block.page), "exec")
        try:
            exec(code, namespace)
        except BaseException as exc:
            tb = exc.__traceback__
            shown = exc.with_traceback(tb.tb_next if tb is not None else None)
            text = "".join(traceback.format_exception(shown))
            raise AssertionError(f"the snippet at {block.where} failed:\n{text}") from None
        ran.append(block.line)
        for line, text in stated_outputs(block).items():
            seen = printed.seen.get(line)
            where = f"{block.page.name}:{line}"
            if not seen:
                raise AssertionError(f"{where} states its output ({text!r}) but never printed")
            wrong = [s for s in seen if not output_matches(text, s)]
            if wrong:
                raise AssertionError(f"{where} printed {wrong[0]!r}, its comment says {text!r}")
    from tiercheck.checkpointer import Checkpointer

    left_open = sorted(
        name for name, v in namespace.items() if isinstance(v, Checkpointer) and not v.closed
    )
    if left_open:
        raise AssertionError(f"{page.name}: the snippets left Checkpointers open: {left_open}")
    return ran


def destroy_stores(cwd: Path) -> list[Path]:
    """Delete every store configured under ``cwd`` (shm segments, LMDB environments, root)
    with :func:`tiercheck.store.lifecycle.destroy_store`; returns their roots."""
    from tiercheck.store.config import CONFIG_NAME
    from tiercheck.store.lifecycle import destroy_store

    roots = sorted({cfg.parent for cfg in cwd.rglob(CONFIG_NAME)}, key=lambda p: len(p.parts))
    for root in reversed(roots):  # a DCP root's rank stores before anything above them
        if (root / CONFIG_NAME).is_file():
            destroy_store(root)
    return roots


# --- the zygote ---------------------------------------------------------------------------


def _child(request: dict[str, str]) -> None:
    fd = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(request["cwd"])
    sys.path.insert(0, request["cwd"])  # as `python` run in that directory would have it
    result: dict[str, Any] = {"ran": [], "error": None}
    try:
        result["ran"] = run_blocks(Path(request["page"]))
    except AssertionError as exc:
        result["error"] = str(exc)
    except BaseException:  # the runner itself failed
        result["error"] = traceback.format_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    Path(request["result"]).write_text(json.dumps(result))


def serve() -> None:
    """Import the heavy modules once, then fork one child per page request on stdin."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import numpy  # noqa: F401
    import torch  # noqa: F401

    import tiercheck.checkpointer  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _child(request)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        sys.stdout.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
