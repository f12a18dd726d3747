"""Every ```python block of README.md and docs/*.md runs, as a newcomer would run it.

The convention and the runner are in ``tests/_snippets.py``: the blocks of one page run in
order in one namespace, in a fresh process (forked from a zygote that imported torch and
tiercheck once) whose working directory is a fresh temporary directory; a block right after
``<!-- snippet: skip (REASON) -->`` is not run. Each page is one test, so a failure names
the page, and the message names the block's line and shows the snippet's traceback.

After a page, every store it configured in its directory is deleted with
``tiercheck.store.lifecycle.destroy_store`` (the snippets close their stores; their shm segments
outlive the process by design).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
from _snippets import REPO, blocks_of, destroy_stores, run_blocks

PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
PAGES_WITH_CODE = [p for p in PAGES if blocks_of(p)]


class Zygote:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("_snippets.py")), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, page: Path, work: Path) -> tuple[int, dict[str, object] | None, str]:
        """Run ``page`` in a forked child; (exit status, verdict or None, its output)."""
        cwd, output, result = work / "cwd", work / "output.txt", work / "result.json"
        cwd.mkdir()
        request = {"page": str(page), "cwd": str(cwd), "output": str(output)}
        stdin: IO[str] | None = self.proc.stdin
        stdout: IO[str] | None = self.proc.stdout
        assert stdin is not None and stdout is not None
        try:
            stdin.write(json.dumps({**request, "result": str(result)}) + "\n")
            stdin.flush()
            reply = stdout.readline()
            if not reply:
                raise RuntimeError(f"the snippet zygote died (exit {self.proc.wait()})")
            status = int(json.loads(reply)["status"])
        finally:
            destroy_stores(cwd)
        verdict = json.loads(result.read_text()) if result.exists() else None
        text = output.read_text(errors="replace") if output.exists() else ""
        return status, verdict, text

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    try:
        yield z
    finally:
        z.close()


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: p.relative_to(REPO).as_posix())
def test_page_snippets_run(page: Path, tmp_path: Path, zygote: Zygote) -> None:
    status, verdict, output = zygote.run(page, tmp_path)
    tail = output[-4000:]
    assert verdict is not None, f"{page.name}: the page's process died (exit {status}):\n{tail}"
    assert verdict["error"] is None, f"{verdict['error']}\n--- output ---\n{tail}"
    assert status == 0
    runnable = [b.line for b in blocks_of(page) if b.skip is None]
    assert verdict["ran"] == runnable


def test_the_runner_reads_blocks_and_markers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n```python\nx = 1\n```\n<!-- snippet: skip (needs a GPU) -->\n```python\n"
        "raise SystemExit\n```\n```bash\nexit 1\n```\n````python\nassert x == 1\n```\n"
        "y = undefined_name\n````\n"
    )
    blocks = blocks_of(page)
    assert [(b.line, b.skip) for b in blocks] == [(3, None), (7, "needs a GPU"), (13, None)]
    for bad in ("<!-- snippet: skip -->", "<!-- snippet: setup -->"):
        page.write_text(f"{bad}\n```python\nx = 1\n```\n")
        with pytest.raises(ValueError, match="snippet: skip"):
            blocks_of(page)
    page.write_text("<!-- snippet: skip (why) -->\n\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="right before"):
        blocks_of(page)


def test_a_failing_block_is_named_with_its_line(
    tmp_path: Path, zygote: Zygote, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nassert x == 1\ny = undefined_name\n```\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AssertionError, match=r"page\.md:6 failed(.|\n)*line 7(.|\n)*NameError"):
        run_blocks(page)
    work = tmp_path / "work"
    work.mkdir()
    status, verdict, _ = zygote.run(page, work)
    assert status == 0 and verdict is not None
    assert "page.md:6 failed" in str(verdict["error"])


def test_a_stated_output_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "page.md"
    monkeypatch.chdir(tmp_path)
    page.write_text(
        "```python\nd = {'a': 1}\nprint(d, 2)   # -> {'a': 1} 2\n"
        "print('x: y z')  # -> x: ...\n```\n"
    )
    assert run_blocks(page) == [2]
    page.write_text("```python\nprint({'a': 1})   # -> {'a': 2}\n```\n")
    with pytest.raises(AssertionError, match=r"page\.md:2 printed \"\{'a': 1\}\""):
        run_blocks(page)
    page.write_text("```python\nfor i in range(2):\n    print(i)   # -> 0\n```\n")
    with pytest.raises(AssertionError, match=r"page\.md:3 printed '1'"):
        run_blocks(page)
    page.write_text("```python\nif False:\n    print(1)   # -> 1\n```\n")
    with pytest.raises(AssertionError, match="never printed"):
        run_blocks(page)
    page.write_text("```python\nprint(1)   # one, a remark: not checked\n```\n")
    assert run_blocks(page) == [2]
