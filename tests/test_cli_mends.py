"""The CLI where users found it wrong: a DCP root's missing version, a tier URL with nothing
there, errors that named the current directory, rich markup in user strings, bad output
paths and defaults of ``plan``, the demo's base cadence, ``--json`` on bad arguments, and
advice ``verify`` gave that could not be followed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _clirun import run_cli as _cli
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import save

from tiercheck import Checkpointer, open_tier
from tiercheck.cli.main import main
from tiercheck.formats.codecs import Codec, encode_blob
from tiercheck.integrations.dcp import TierWriter
from tiercheck.store.lifecycle import destroy_store


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tiercheck: error: "), err
    return lines[0]


def _json_error(out: str, status: int = 2) -> str:
    doc = json.loads(out)
    assert doc["exit_status"] == status and doc["error"], doc
    return str(doc["error"])


@pytest.fixture
def copy_url(tmp_path: Path) -> Iterator[str]:
    """A tier URL holding a self-contained copy of a one-version store (`migrate --to`)."""
    store = tmp_path / "store"
    with Checkpointer(store, tiers=[("lmdb", f"lmdb://{tmp_path}/lmdb")]) as ckpt:
        ckpt.save(3, {"w": torch.arange(4096.0)}).wait()
    url = f"file://{tmp_path}/copy"
    assert main(["migrate", str(store), "latest", "--to", url, "--json"]) == 0
    yield url
    destroy_store(store)


# --- 1: export of a DCP root's missing version ----------------------------------------------


def test_exporting_a_version_a_dcp_root_lacks_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "dcp"
    model = nn.Linear(4, 4)
    with TierWriter(root, tiers=lambda r: [("lmdb", f"lmdb://{r}/lmdb")]) as w:
        save({"model": model.state_dict()}, storage_writer=w, checkpoint_id=7)
    for spec in ("99", "step:77"):
        out, err = _cli(capsys, "export", root, spec, tmp_path / "w.pt", ok=2)
        line = _one_line_error(err)
        assert str(root) in line and "Traceback" not in out + err
        out, err = _cli(capsys, "export", root, spec, tmp_path / "w.pt", "--json", ok=2)
        assert _json_error(out) in _one_line_error(err)
    assert not (tmp_path / "w.pt").exists()
    for rank in sorted(root.glob("rank*")):
        destroy_store(rank)


def test_a_damaged_dcp_checkpoint_fails_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "dcp"
    url = f"lmdb://{tmp_path}/lmdb"
    with TierWriter(root, tiers=lambda r: [("lmdb", url)]) as w:
        save({"model": nn.Linear(512, 512).state_dict()}, storage_writer=w, checkpoint_id=7)
    with Checkpointer(root / "rank0", read_only=True) as ckpt:
        entries = ckpt.version("latest").entries.values()
        victim = max(entries, key=lambda e: e.size).chunks[0]
    tier = open_tier(url)
    try:
        tier.put(victim, encode_blob(b"these are not the bytes", Codec.RAW), overwrite=True)
    finally:
        tier.close()
    out, err = _cli(capsys, "export", root, "latest", tmp_path / "w.pt", "--json", ok=1)
    assert _json_error(out, 1) in _one_line_error(err)
    destroy_store(root / "rank0")


# --- 2 and 3: tier URLs ----------------------------------------------------------------------


def test_a_tier_url_with_nothing_there_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    typo = f"file://{tmp_path}/typo"
    for command in (["ls", typo], ["verify", typo], ["show", typo, "latest"]):
        _, err = _cli(capsys, *command, ok=2)
        assert typo in _one_line_error(err)
        out, _ = _cli(capsys, *command, "--json", ok=2)
        assert typo in _json_error(out)
    assert not (tmp_path / "typo").exists()


def test_an_empty_tier_a_store_owns_still_lists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A store's remote tier before its first save holds no log and no blob, yet is one."""
    remote = f"file://{tmp_path}/remote"
    store = tmp_path / "store"
    with Checkpointer(store, tiers=[("lmdb", f"lmdb://{tmp_path}/lmdb"), ("remote", remote)]):
        pass
    out, _ = _cli(capsys, "ls", remote, "--json")
    assert json.loads(out)["versions"] == []
    destroy_store(store)


def test_errors_for_a_tier_url_name_the_url(
    tmp_path: Path, copy_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for command in (["show", copy_url, "99"], ["export", copy_url, "step:77", "q.pt"]):
        _, err = _cli(capsys, *command, ok=2)
        line = _one_line_error(err)
        assert copy_url in line and str(elsewhere) not in line, line


# --- 4: rich markup --------------------------------------------------------------------------


def test_brackets_in_roots_keys_and_metadata_are_printed_as_they_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run[exp]"
    note = "see [bold]x[/bold] [x]"
    tiers = [("lmdb", f"lmdb://{tmp_path}/lmdb"), ("remote", f"file://{tmp_path}/remote")]
    with Checkpointer(root, tiers=tiers) as ckpt:
        a = ckpt.save(1, {"w[abc]": torch.zeros(8)}, metadata={"note": note}).wait().version
        b = ckpt.save(2, {"w[abc]": torch.ones(8)}, metadata={"note": "x[/y]"}).wait().version
    listed, _ = _cli(capsys, "ls", root)
    assert "run[exp]" in "".join(listed.split())  # a long root wraps in the table's title
    shown, _ = _cli(capsys, "show", root, str(a))
    assert "w[abc]" in shown and note in shown
    shown, _ = _cli(capsys, "show", root, str(b))  # "[/y]" closes no tag: a MarkupError
    assert "x[/y]" in shown
    changed, _ = _cli(capsys, "diff", root, str(a), str(b))
    assert "w[abc]" in changed
    verified, _ = _cli(capsys, "verify", root)
    assert "run[exp]" in "".join(verified.split())
    copied, _ = _cli(capsys, "migrate", root, "latest", "--to", f"file://{tmp_path}/copy")
    assert "tiers=[url]" in " ".join(copied.split())
    destroy_store(root)


# --- 5 and 6: plan ---------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["--config-out", "--write-failures", "--write-hardware"])
def test_plan_refuses_an_output_path_in_a_missing_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    target = tmp_path / "missing" / "out.toml"
    args = ["plan", option, target, "--runs", "2", "--gpus", "64"]
    _, err = _cli(capsys, *args, ok=2)
    line = _one_line_error(err)
    assert str(target) in line and "does not exist" in line and ".tmp" not in line
    out, _ = _cli(capsys, *args, "--json", ok=2)
    assert str(target) in _json_error(out)
    assert not (tmp_path / "missing").exists()


def test_plan_for_fewer_gpus_than_a_node_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = _cli(capsys, "plan", "--gpus", "4", "--runs", "2", "--json")
    assert json.loads(out)["job"]["gpus_per_node"] == 4
    _, err = _cli(capsys, "plan", "--gpus", "4", "--gpus-per-node", "8", "--runs", "2", ok=2)
    assert "gpus_per_node" in _one_line_error(err)  # an explicit bad value is still refused


# --- 7: the demo's cadence -------------------------------------------------------------------


def test_the_demo_counts_the_cadence_over_every_version_it_saved() -> None:
    """Retention drops log versions from the history; the cadence counts them all, and
    a version the killed process committed without reporting it too."""
    from tiercheck.cli.demo import saved_roles

    roles = ["base" if i % 4 == 0 else "log" for i in range(12)]  # 3 bases in 12 versions
    reported = [{"version": i, "role": r} for i, r in enumerate(roles) if i != 9]
    kept = [SimpleNamespace(id=i, role=roles[i]) for i in (0, 4, 8, 9, 11)]
    assert saved_roles(reported, kept) == roles


# --- 8: --json on bad arguments --------------------------------------------------------------


@pytest.mark.parametrize("args", [["ls", "store", "--json", "--limit", "x"], ["ls", "--json"]])
def test_bad_arguments_with_json_print_the_error_document(
    capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    out, err = _cli(capsys, *args, ok=2)
    assert _json_error(out) in err


# --- 9: verify's advice ----------------------------------------------------------------------


def test_verify_of_a_tier_url_does_not_suggest_repair(
    tmp_path: Path, copy_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tier URL is opened alone and read-only: --repair has nothing to copy from."""
    with Checkpointer(tmp_path / "reader", tiers=[copy_url], read_only=True) as ckpt:
        victim = ckpt.version("latest").entries["w"].chunks[0]
    tier = open_tier(copy_url)
    try:
        tier.put(victim, encode_blob(b"these are not the bytes", Codec.RAW), overwrite=True)
    finally:
        tier.close()
    out, _ = _cli(capsys, "verify", copy_url, ok=1)
    assert f"{victim}: corrupt" in out and "--repair" not in out
    assert "no other tier" in out


def test_ls_says_why_versions_are_missing_without_claiming_retention(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ls`` names the ids it does not list. On a copy made with ``migrate --to`` those
    were never placed there; the line said "dropped by retention" of them all the same."""
    root = tmp_path / "store"
    with Checkpointer(root, tiers=[("lmdb", f"lmdb://{tmp_path}/lmdb")]) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, {"w": torch.full((8,), float(step))}).wait()
    url = f"file://{tmp_path}/copy"
    _cli(capsys, "migrate", root, "latest", "--to", url)
    listed, _ = _cli(capsys, "ls", url)
    text = " ".join(listed.split())
    assert "3 older version(s) not listed (ids 0-2)" in text, text
    assert "never placed there" in text and "dropped by retention (ids" not in text
    destroy_store(root)
