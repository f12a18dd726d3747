"""docs/quickstart.md followed verbatim, to the end (issue 33 item 9): every ```python block
and every ``$ `` line of its ```console blocks runs, in page order, in one fresh directory,
as a newcomer would type them; afterwards no store is left there and none of the shm
segments its stores used is left in /dev/shm.

(tests/test_doc_snippets.py runs the python blocks alone and deletes the stores after the
page; this test runs the shell lines too, and deletes nothing itself.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _snippets import REPO

PAGE = REPO / "docs" / "quickstart.md"

# runs the page in a child: python blocks exec'd in one namespace, console lines in a shell;
# after each step, the shm segment names of the stores under the directory are noted
_RUNNER = r"""
import json, os, re, subprocess, sys
from pathlib import Path
page, out = Path(sys.argv[1]), Path(sys.argv[2])
lines = page.read_text().splitlines()
segments = set()
def note():
    for cfg in Path(".").rglob("tiercheck.toml"):
        segments.update(re.findall(r"shm://([A-Za-z0-9_.{}-]+)", cfg.read_text()))
ns = {"__name__": "__main__"}
ran = []
i = 0
while i < len(lines):
    m = re.match(r"^```(\w*)", lines[i])
    if not m:
        i += 1
        continue
    end = i + 1
    while not lines[end].startswith("```"):
        end += 1
    body = lines[i + 1 : end]
    if m.group(1) == "python":
        exec(compile("\n" * (i + 1) + "\n".join(body), str(page), "exec"), ns)
        ran.append(i + 2)
    elif m.group(1) == "console":
        for n, line in enumerate(body):
            if line.startswith("$ "):
                proc = subprocess.run(["bash", "-c", line[2:]], capture_output=True, text=True)
                assert proc.returncode == 0, f"line {i + 2 + n}: {line}\n{proc.stdout}{proc.stderr}"
                ran.append(i + 2 + n)
    note()
    i = end + 1
out.write_text(json.dumps({"ran": ran, "segments": sorted(segments)}))
"""


@pytest.mark.slow
def test_the_quickstart_runs_verbatim_and_leaves_nothing_behind(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    result = tmp_path / "result.json"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(PAGE), str(result)],
        cwd=work,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    done = json.loads(result.read_text())
    stores = sorted(str(p.parent.relative_to(work)) for p in work.rglob("tiercheck.toml"))
    assert stores == [], f"the quickstart left stores behind: {stores}"
    assert sorted(p.name for p in work.iterdir()) == ["model.pt", "model.safetensors"]
    assert done["segments"], "the quickstart's stores use shm segments"
    shm = Path("/dev/shm")
    left = [
        str(p)
        for name in done["segments"]
        for p in shm.rglob("*")
        if re.fullmatch(re.escape(name), p.name)
    ]
    assert left == [], f"the quickstart left shm segments behind: {left}"
