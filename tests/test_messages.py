"""Messages a user reads (issue 33 item 8): a budget skip in one phrasing that says where
the version went, one INFO line per committed save, one vocabulary for what a tier survives
(``plan`` and ``ls``), and a tiercheck pointer loaded by torch/Lightning naming
``tiercheck.integrations.lightning.load``. Real tiers only: shm, LMDB, a peer daemon."""

from __future__ import annotations

import json
import logging
import re
import uuid
from pathlib import Path

import pytest
import torch

from tiercheck import Checkpointer
from tiercheck.peer.server import PeerServer
from tiercheck.store.config import TierSpec

TOKEN = b"test-token-0123456789"

#: the one phrasing of a budget skip (store/budgets.py, skip_message)
SKIP = re.compile(
    r"^tier (?P<tier>\w+) skipped version \d+ \(step \d+\): it needs [\d.]+ \w?i?B more, "
    r".*; (?P<went>the version is committed on [\w, ]+ instead|no other tier took it); "
    r"to fix: .*$"
)


def _skips(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if re.search(r"tier \w+ skipped", r.getMessage())]


def test_a_budget_skip_is_one_message_saying_where_the_version_went(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    name = f"tc-msg-{uuid.uuid4().hex[:12]}"
    tiers = [
        TierSpec("shm", f"shm://{name}", {"budget": "256KiB"}),
        TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}"),
    ]
    ckpt = Checkpointer(tmp_path / "store", tiers=tiers)
    try:
        with caplog.at_level(logging.WARNING, logger="tiercheck"):
            res = ckpt.save(1, {"w": torch.randn(1 << 18)}).wait()
        assert res.tiers == {"shm": "missing", "lmdb": "committed"}
        skips = _skips(caplog)
        assert len(skips) == 1, [r.getMessage() for r in caplog.records]
        text = skips[0].getMessage()
        m = SKIP.match(text)
        assert m is not None, text
        assert m["tier"] == "shm" and "committed on lmdb instead" in text
        assert "256.0 KiB" in text and "id=" not in text
        assert skips[0].name == "tiercheck.store.budgets"  # what troubleshooting.md quiets
    finally:
        ckpt.destroy()


def test_a_skip_in_flight_has_the_same_phrasing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer daemon refusing the version mid-put (not foreseen by the budget check)."""
    name = f"tc-msg-{uuid.uuid4().hex[:12]}"
    with PeerServer("127.0.0.1:0", memory_limit=256 << 10, token=TOKEN) as server:
        tiers = [
            TierSpec("shm", f"shm://{name}"),
            TierSpec(
                "peer",
                f"peer://127.0.0.1:{server.port}/{name}",
                {"token": TOKEN.decode(), "budget": "1GiB", "timeout": 20.0},
            ),
        ]
        ckpt = Checkpointer(tmp_path / "store", tiers=tiers)
        try:
            with caplog.at_level(logging.WARNING, logger="tiercheck"):
                res = ckpt.save(1, {"w": torch.randn(1 << 18)}).wait()
            assert res.tiers == {"shm": "committed", "peer": "missing"}
            skips = _skips(caplog)
            assert len(skips) == 1, [r.getMessage() for r in caplog.records]
            text = skips[0].getMessage()
            m = SKIP.match(text)
            assert m is not None, text
            assert m["tier"] == "peer" and "committed on shm instead" in text
            assert "id=" not in text and skips[0].name.startswith("tiercheck.")
        finally:
            ckpt.destroy()


def test_one_info_line_per_committed_save(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """What docs/troubleshooting.md promises under ``logging.basicConfig(level=INFO)``."""
    ckpt = Checkpointer(tmp_path / "store", tiers=[f"lmdb://{tmp_path / 'lmdb'}"])
    try:
        with caplog.at_level(logging.INFO, logger="tiercheck"):
            for step in (10, 20):
                ckpt.save(step, {"w": torch.randn(64)}).wait()
        lines = [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.INFO and r.getMessage().startswith("saved step")
        ]
        assert len(lines) == 2, [r.getMessage() for r in caplog.records]
        pat = r"^saved step {} as version \d+ \((base|diff)\) in lmdb in \d+\.\d+ s$"
        assert re.match(pat.format(10), lines[0]), lines[0]
        assert re.match(pat.format(20), lines[1]), lines[1]
    finally:
        ckpt.destroy()


def test_plan_and_ls_say_what_a_tier_survives_in_the_same_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiercheck.cli.main import main

    monkeypatch.setenv("COLUMNS", "250")  # rich wraps table cells in a narrow console
    name = f"tc-msg-{uuid.uuid4().hex[:12]}"
    ckpt = Checkpointer(tmp_path / "store", tiers=[f"shm://{name}", f"lmdb://{tmp_path / 'lmdb'}"])
    try:
        ckpt.save(1, {"w": torch.randn(64)}).wait()
        ckpt.close()
        capsys.readouterr()
        assert main(["ls", str(tmp_path / "store")]) == 0
        ls = capsys.readouterr().out
        said = dict(re.findall(r"^(shm|lmdb): survives (.+)$", ls, re.MULTILINE))
        assert set(said) == {"shm", "lmdb"}, ls
        assert main(["plan", "--gpus", "512", "--days", "2", "--runs", "2"]) == 0
        plan = capsys.readouterr().out
        for tier in ("shm", "lmdb"):
            rows = [ln for ln in plan.splitlines() if re.match(rf"^│ {tier}\s+│", ln)]
            assert rows, plan
            for row in rows:  # the tier-cost table and the intervals table
                assert row.split("│")[2].strip() == said[tier], (row, said[tier])
        assert main(["plan", "--gpus", "512", "--days", "2", "--runs", "2", "--json"]) == 0
        rates = json.loads(capsys.readouterr().out)["tier_rates"]
        assert rates["lmdb"]["survives_text"] == said["lmdb"]
        assert rates["lmdb"]["survives"] == "process"  # the domain, for programs
    finally:
        Checkpointer(tmp_path / "store").destroy()


@pytest.mark.parametrize("weights_only", [True, False])
def test_torch_load_of_a_lightning_pointer_names_the_loader(
    tmp_path: Path, weights_only: bool
) -> None:
    """What ``LightningModule.load_from_checkpoint(last.ckpt)`` calls: ``torch.load``."""
    from tiercheck.integrations.lightning import TiercheckIO, load

    ckpt = Checkpointer(tmp_path / "store", tiers=[f"lmdb://{tmp_path / 'lmdb'}"])
    ckpt.close()
    io = TiercheckIO(str(tmp_path / "store"))
    try:
        state = {"state_dict": {"w": torch.arange(4.0)}, "global_step": 7, "epoch": 0}
        io.save_checkpoint(state, tmp_path / "last.ckpt")
        with pytest.raises(Exception) as info:
            torch.load(tmp_path / "last.ckpt", weights_only=weights_only, map_location="cpu")
        text = str(info.value)
        assert "tiercheck.integrations.lightning.load" in text, text
        assert "weights_only" not in text, text  # not torch's hint to load it unsafely
        assert torch.equal(load(tmp_path / "last.ckpt")["state_dict"]["w"], torch.arange(4.0))
    finally:
        io.teardown()
        Checkpointer(tmp_path / "store").destroy()
