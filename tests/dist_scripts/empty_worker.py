"""Run under torchrun by tests/test_restore_empty.py: every rank restores from an empty
store with missing_ok (None everywhere), without it (EmptyStore everywhere), then saves and
restores the version every rank committed. Writes what it saw to ``result-RANK.json``
beside the store root. With a port as the second argument the store also has a remote
tier whose endpoint there does not answer (a first launch with the remote down)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _leave import leave

import tiercheck
from tiercheck import TierSpec
from tiercheck.errors import EmptyStore


def main() -> None:
    root = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tiers = [
        TierSpec("mem", "memory://empty-{rank}"),
        TierSpec("lmdb", f"lmdb://{root}/lmdb-{{rank}}"),
    ]
    if len(sys.argv) > 2:  # a remote tier whose endpoint (a closed loopback port) is down
        endpoint = {"endpoint_url": f"http://127.0.0.1:{sys.argv[2]}", "key": "k", "secret": "s"}
        tiers.append(
            TierSpec("remote", "s3://bucket/run", {"storage_options": endpoint, "retry": False})
        )
    torch.manual_seed(rank)
    model = torch.nn.Linear(8, 8)
    out: dict[str, object] = {"rank": rank}
    with tiercheck.Checkpointer(root, tiers=tiers) as ckpt:
        out["missing_ok"] = ckpt.restore({"model": model}, missing_ok=True) is None
        try:
            ckpt.restore({"model": model})
        except EmptyStore as exc:
            out["error"] = str(exc)
        ckpt.save(1, {"model": model}).wait()
        before = model.weight.clone()
        with torch.no_grad():
            model.weight.zero_()
        info = ckpt.restore({"model": model}, missing_ok=True)
        out["restored"] = info is not None and info.step == 1
        out["same"] = bool(torch.equal(model.weight, before))
    # a file per rank: two ranks printing to the one stdout torchrun gives them can
    # interleave (seen in CI: two objects on one line)
    Path(root).with_name(f"result-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    leave(main())
