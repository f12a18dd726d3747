"""Launching real multi-process runs for the tests: a free loopback port and torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(
    script: Path,
    *args: str,
    nproc: int = 2,
    env: Mapping[str, str] | None = None,
    timeout: float = 200,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under ``torch.distributed.run`` with ``nproc`` processes on this host
    (rendezvous on loopback, one OpenMP thread each); output captured as text."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(script),
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
