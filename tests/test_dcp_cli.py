"""The CLI on a DCP root (one store per rank) and on a tier URL that `migrate --to` wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import save

from tiercheck import TierSpec
from tiercheck.cli.main import main
from tiercheck.integrations.dcp import TierWriter, load_full_state_dict


def _cli(capsys: pytest.CaptureFixture[str], *args: str | Path, ok: int = 0) -> Any:
    capsys.readouterr()
    rc = main([*map(str, args), "--json"])
    out = capsys.readouterr()
    assert rc == ok, out.err
    return json.loads(out.out) if out.out.strip() else {}


@pytest.fixture
def dcp_root(tmp_path: Path) -> tuple[Path, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    root = tmp_path / "dcp"
    before = model[0].bias.detach().clone()
    with TierWriter(root, tiers=lambda r: [("lmdb", f"lmdb://{r}/lmdb")]) as w:
        save({"model": model.state_dict(), "step": 7}, storage_writer=w, checkpoint_id=7)
        with torch.no_grad():
            model[0].bias.add_(1)
        save({"model": model.state_dict(), "step": 8}, storage_writer=w, checkpoint_id=8)
    return root, model, before


def test_ls_and_verify_open_every_rank_of_a_dcp_root(
    dcp_root: tuple[Path, nn.Module, torch.Tensor], capsys: pytest.CaptureFixture[str]
) -> None:
    root, _, _ = dcp_root
    listed = _cli(capsys, "ls", root)
    assert listed["dcp"] is True
    assert [r["root"] for r in listed["ranks"]] == [str(root.resolve() / "rank0")]
    assert [v["step"] for v in listed["ranks"][0]["versions"]] == [7, 8]
    assert _cli(capsys, "verify", root)["ok"] is True
    capsys.readouterr()
    assert main(["show", str(root), "latest"]) == 2
    assert "rank0" in capsys.readouterr().err  # says which store to pass instead


def test_export_has_plain_keys_that_load_into_the_model(
    dcp_root: tuple[Path, nn.Module, torch.Tensor],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, model, before = dcp_root
    out = tmp_path / "model.pt"
    report = _cli(capsys, "export", root, "step:7", out, "--only", "model/")
    assert report["step"] == 7
    weights = torch.load(out, weights_only=True)
    assert set(weights) == set(model.state_dict())  # "0.weight", not "model.0.weight@0_0"
    fresh = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    fresh.load_state_dict(weights)
    assert torch.equal(fresh[0].bias, before)  # step 7: before the change
    latest = load_full_state_dict(root)
    assert latest["step"] == 8 and torch.equal(latest["model"]["0.bias"], model[0].bias)


def test_a_migrated_copy_is_browsed_at_its_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import tiercheck

    store = tmp_path / "store"
    with tiercheck.Checkpointer(store, tiers=[("lmdb", f"lmdb://{store}/lmdb")]) as ckpt:
        ckpt.save(3, {"w": torch.arange(10.0)}).wait()
    url = f"file://{tmp_path}/copy"
    _cli(capsys, "migrate", store, "latest", "--to", url)
    listed = _cli(capsys, "ls", url)
    assert listed["root"] == url and [v["step"] for v in listed["versions"]] == [3]
    assert _cli(capsys, "verify", url)["ok"] is True
    _cli(capsys, "export", url, "latest", tmp_path / "w.pt")
    assert torch.equal(torch.load(tmp_path / "w.pt", weights_only=True)["w"], torch.arange(10.0))
    capsys.readouterr()
    assert main(["gc", url]) == 2  # writing commands refuse a URL, with a reason
    assert "read-only" in capsys.readouterr().err


def test_rm_of_a_dcp_root_deletes_every_ranks_store_and_its_segment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tiercheck rm`` of a DCP root was refused ("not a tiercheck store"), and deleting
    the directory by hand left each rank's shm segment (one kept version each) taken."""
    root = tmp_path / "dcp"
    shm_root = tmp_path / "shm"
    spec = TierSpec("shm", f"shm://dcprm-{tmp_path.name[-12:]}", {"root": str(shm_root)})
    with TierWriter(root, tiers=lambda r: [spec]) as w:
        save({"w": torch.ones(64)}, storage_writer=w, checkpoint_id=1)
    segments = list(shm_root.iterdir())
    assert len(segments) == 1
    dry = _cli(capsys, "rm", root, "--dry-run")
    assert dry["dcp"] is True and dry["ranks"][0]["dry_run"] is True
    assert root.exists() and segments[0].exists()
    done = _cli(capsys, "rm", root)
    assert [r["root"] for r in done["ranks"]] == [str(root.resolve() / "rank0")]
    assert done["ranks"][0]["segments"] == [str(segments[0])]
    assert not root.exists() and not segments[0].exists()
