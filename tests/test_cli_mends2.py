"""The CLI where a new user found it wrong (second round): read-only commands next to a
trainer that saves, a remote tier whose content vanished, ``show step:N`` of a dropped
version, ``peer status`` without a token, ``ls`` of a tier shared by stores, and the size
of a version lost with its tier."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _clirun import run_cli as _cli

from tiercheck import Checkpointer, Policy, TierSpec
from tiercheck.cli.main import main
from tiercheck.store.lifecycle import destroy_store

# --- 4: read-only commands next to a trainer that saves ---------------------------------------

# Saves every step on the default store (shm, LMDB, the remote under the root) until the file
# argv[2] exists; says "ready" once version 0 is migrated and a few dozen versions came and went.
_TRAINER = """
import os, sys, time, torch, tiercheck
root, stop = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
opt = torch.optim.AdamW(model.parameters())
with tiercheck.Checkpointer(root) as ckpt:
    ckpt.guard(opt)
    step = 0
    while not os.path.exists(stop):
        step += 1
        model(torch.randn(8, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        h = ckpt.save(step, {"model": model, "optim": opt})
        if step == 1:
            h.wait_migrated()
        if step == 40:
            h.wait()
            print("ready", flush=True)
        time.sleep(0.02)  # the rest of a training step
"""


def test_read_only_commands_report_no_false_problem_next_to_a_trainer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, stop, log = tmp_path / "store", tmp_path / "stop", tmp_path / "trainer.err"
    with log.open("w") as err:
        trainer = subprocess.Popen(
            [sys.executable, "-c", _TRAINER, str(root), str(stop)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == "ready", log.read_text()
        false: list[tuple[str, int, str]] = []  # every false problem, of every round
        exported = str(tmp_path / "latest.pt")
        for _ in range(8):
            for command in (
                ["verify"],
                ["diff", "0", "latest"],
                ["show", "latest"],
                ["export", "latest", exported, "--force"],
            ):
                capsys.readouterr()
                rc = main([command[0], str(root), *command[1:], "--json"])
                out = capsys.readouterr()
                doc = json.loads(out.out)
                if rc != 0 or doc.get("problems"):
                    false.append((command[0], rc, str(doc.get("problems") or doc)[:300]))
        assert false == []
    finally:
        stop.touch()
        trainer.communicate(timeout=300)
        destroy_store(root)
    assert trainer.returncode == 0, log.read_text()


# --- 6: a remote tier whose content vanished ------------------------------------------------


def _three_migrated(root: Path) -> None:
    """Versions 0, 1, 2 (all bases), each migrated to the default remote under ``root``."""
    with Checkpointer(root, policy=Policy(remote_every=0, base_every=1)) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((256, 256), float(step))}).wait_migrated()


def test_a_remote_whose_content_vanished_is_a_problem_not_a_migration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    _three_migrated(root)
    try:
        shutil.rmtree(root / "remote")  # the remote storage loses everything
        out, _ = _cli(capsys, "verify", root, "--json", ok=1)
        assert [(p["tier"], p["kind"]) for p in json.loads(out)["problems"]] == [
            ("remote", "missing")
        ]
        out, _ = _cli(capsys, "verify", root, ok=1)
        assert "all blobs intact" not in out and "remote" in out
        out, _ = _cli(capsys, "ls", root, "--json")
        doc = json.loads(out)
        assert {v["tiers"]["remote"] for v in doc["versions"]} == {"missing"}
        assert [t["name"] for t in doc["tiers"] if t["error"]] == ["remote"]
        out, _ = _cli(capsys, "ls", root)
        assert "remote" in out and "holds nothing of this store" in out
    finally:
        destroy_store(root)


def test_no_version_is_migrating_once_no_writer_holds_the_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    blobs = root / "remote" / "blobs"

    def remote_states() -> dict[int, str]:
        out, _ = _cli(capsys, "ls", root, "--json")  # a read-only open, as from another process
        return {v["id"]: v["tiers"]["remote"] for v in json.loads(out)["versions"]}

    with Checkpointer(root, policy=Policy(remote_every=0, base_every=1)) as ckpt:
        ckpt.save(1, {"w": torch.zeros(64)}).wait_migrated()
        # the remote takes no blob: the next migrations fail, are retried, and close gives up
        blobs.rename(blobs.with_name("blobs.aside"))
        blobs.write_bytes(b"")
        for step in (2, 3):
            ckpt.save(step, {"w": torch.full((64,), float(step))}).wait()
        assert remote_states() == {0: "committed", 1: "migrating", 2: "migrating"}
        ckpt.close(abandon=True)
    try:
        blobs.unlink()
        blobs.with_name("blobs.aside").rename(blobs)
        assert remote_states() == {0: "committed", 1: "missing", 2: "missing"}
    finally:
        destroy_store(root)


# --- minor: show step:N of a version retention dropped ---------------------------------------


def test_show_by_step_says_a_dropped_version_was_dropped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    with Checkpointer(root) as ckpt:  # version i at step i + 1; retention drops most of them
        for step in range(1, 41):
            ckpt.save(step, {"w": torch.full((64,), float(step))}).wait()
    try:
        _, by_id = _cli(capsys, "show", root, "5", ok=2)
        assert "dropped by retention" in by_id
        _, by_step = _cli(capsys, "show", root, "step:6", ok=2)
        assert "dropped by retention" in by_step and "version 5" in by_step, by_step
        _, beyond = _cli(capsys, "show", root, "step:99", ok=2)
        assert "no committed version has step 99" in beyond
    finally:
        destroy_store(root)


# --- minor: peer status without the token its daemon requires ---------------------------------


def test_peer_status_without_a_token_names_the_cli_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    token = tmp_path / "token"
    token.write_text("a-shared-secret-of-enough-length-0123456789")
    token.chmod(0o600)
    daemon = subprocess.Popen(
        [
            *(sys.executable, "-m", "tiercheck", "peer", "serve", "--listen", "127.0.0.1:0"),
            *("--memory-limit", "16MiB", "--token-file", str(token), "--json"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert daemon.stdout is not None
        address = json.loads(daemon.stdout.readline())["listening"]
        monkeypatch.delenv("TIERCHECK_PEER_TOKEN", raising=False)
        _, err = _cli(capsys, "peer", "status", address, ok=2)
        assert "--token-file" in err and "token_file=" not in err, err
        out, _ = _cli(capsys, "peer", "status", address, "--token-file", token, "--json")
        assert json.loads(out)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.communicate(timeout=60)


# --- minor: ls of a tier shared by stores -------------------------------------------------------


def test_ls_of_a_tier_shared_by_stores_names_the_stores_folders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = tmp_path / "shared"
    roots = [tmp_path / "a", tmp_path / "b"]
    for root in roots:
        spec = TierSpec("remote", f"file://{shared}", {"shared_by_stores": True})
        with Checkpointer(root, tiers=[("lmdb", f"lmdb://{root}/lmdb"), spec]) as ckpt:
            ckpt.save(1, {"w": torch.zeros(64)}).wait_migrated()
    try:
        _, err = _cli(capsys, "ls", f"file://{shared}", ok=2)
        folders = sorted(str(p) for p in (shared / "stores").iterdir())
        assert len(folders) == 2 and all(f"file://{f}" in err for f in folders), err
        out, _ = _cli(capsys, "ls", f"file://{folders[0]}", "--json")
        assert [v["id"] for v in json.loads(out)["versions"]] == [0]
    finally:
        for root in roots:
            destroy_store(root)


# --- minor: the size of a version lost with its tier ---------------------------------------------


def test_ls_shows_no_size_for_a_version_lost_with_its_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    with Checkpointer(root) as ckpt:  # version 0 a base (LMDB too), 1 and 2 diffs in shm only
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((4096,), float(step))}).wait()
        shm = ckpt.tierset.get("shm").tier
        assert shm is not None
        segment = str(shm.path)  # type: ignore[attr-defined]
    try:
        shutil.rmtree(segment)  # a reboot
        out, _ = _cli(capsys, "ls", root)
        lost = [row for row in out.splitlines() if "│" in row and "lost with tier shm" in row]
        sizes = [[cell.strip() for cell in row.split("│")[5:7]] for row in lost]
        assert len(lost) == 2 and sizes == [["-", "-"]] * 2, out
    finally:
        destroy_store(root)


def test_a_version_named_as_dcp_names_it_is_accepted() -> None:
    """``tiercheck export ROOT version:1`` was refused while DCP's ``checkpoint_id`` and
    the integrations' docs name versions so."""
    from tiercheck.history.versions import parse_version_spec

    assert parse_version_spec("version:1") == ("id", 1)
    assert parse_version_spec("Version:12") == ("id", 12)
    for bad in ("version:", "version:x", "version:-1"):
        with pytest.raises(ValueError, match="not a version"):
            parse_version_spec(bad)


def test_rm_of_a_segment_migrate_wrote_deletes_it_and_refuses_a_stores_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``migrate --to shm://NAME`` made a segment that neither ``rm`` (not a store root)
    nor ``gc --orphans`` (no store owns it) would delete: ``rm shm://NAME`` does now. A
    segment a live store names is refused (delete the store)."""
    import os
    import uuid

    from tiercheck.backends import DEFAULT_SHM_ROOT

    root = tmp_path / "store"
    name = f"mends-copy-{uuid.uuid4().hex[:8]}"
    try:
        with Checkpointer(root) as ckpt:
            ckpt.save(1, {"w": torch.ones(256)}).wait()
            own = ckpt.tierset.get("shm").spec.url
        _cli(capsys, "migrate", root, "latest", "--to", f"shm://{name}")
        assert os.path.isdir(os.path.join(DEFAULT_SHM_ROOT, name))
        out, _ = _cli(capsys, "rm", f"shm://{name}", "--json")
        assert json.loads(out)["segments"] == [os.path.join(DEFAULT_SHM_ROOT, name)]
        assert not os.path.exists(os.path.join(DEFAULT_SHM_ROOT, name))
        _, err = _cli(capsys, "rm", own, ok=2)
        assert "is a tier of the store at" in err
        _, err = _cli(capsys, "rm", f"shm://{name}", ok=2)
        assert "no shm segment" in err
    finally:
        destroy_store(root)
