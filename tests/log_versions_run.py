"""Resume from a store's newest version in a new process, for tests/test_log_versions.py.

    python tests/log_versions_run.py STORE OUT

opens the store at STORE (its own configuration), guards a fresh run's optimizer, restores
the newest version (a log version: its base is loaded and the logged steps replayed),
trains ``AFTER`` more steps and writes the restore's outcome and digests of the whole
state to OUT (JSON).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from update_log_run import AFTER, Run

import tiercheck


def resume(store: Path, out: Path) -> None:
    run = Run(seed=99)  # a different init: everything must come from the checkpoint
    with tiercheck.Checkpointer(store) as ckpt:
        ckpt.guard(run.opt, run.scaler)
        state = run.state()
        info = ckpt.restore(state)
    run.loader = state["loader"]
    run.data.set_state(state["data_rng"])
    tiercheck.set_rng_state(state["rng"])
    run.steps = info.step
    for _ in range(AFTER):
        run.step()
    out.write_text(
        json.dumps(
            {
                "role": info.role,
                "version": info.version,
                "replayed": info.replayed_steps,
                "fallback": info.fallback,
                "digests": run.digests(),
            }
        )
    )


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    resume(Path(sys.argv[1]), Path(sys.argv[2]))
