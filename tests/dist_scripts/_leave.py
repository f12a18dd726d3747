"""How a torchrun test worker ends once its checks have passed.

torch's gloo process groups keep C++ worker threads whose last objects can be destroyed
during interpreter finalization, after ``destroy_process_group()``; now and then that
aborts the process (``terminate called without an active exception``, SIGABRT) after
every check passed, and torchrun then reports the run as failed (seen in CI on
``dcp_worker.py``; pytorch/pytorch#190489 and #179291 describe the teardown). A worker
gets here only when its work is done and its stores are closed, so it flushes its
output and leaves without finalizing the interpreter. The Lightning multi-rank script
(``tests/integration_scripts/ptl_sharded_run.py``) and the benchmarks' torchrun workers
(``benchmarks/dist_scripts/``) end here too.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch.distributed as dist


def leave(code: int | str | None = 0) -> NoReturn:
    """Destroy the process groups (if still up), flush, and exit with ``code`` (a text is
    printed to stderr and exits 1, as ``sys.exit`` does)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
