"""Bad arguments at the edges: ``save()`` refuses what the format cannot hold before it
returns, and every CLI command turns a library's or a backend's error (botocore, fsspec,
lmdb) into one line and an exit status, ``--json`` included, never a traceback."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tiercheck import Checkpointer
from tiercheck.cli.main import main
from tiercheck.formats.manifest import MAX_INT

# --- save() ---------------------------------------------------------------------------------


@pytest.fixture
def ckpt(tmp_path: Path) -> Iterator[Checkpointer]:
    with Checkpointer(tmp_path / "store", tiers=[f"file://{tmp_path / 'remote'}"]) as c:
        yield c


@pytest.mark.parametrize("step", [MAX_INT + 1, 2**70, -1, 1.5, True, "3"])
def test_save_refuses_a_step_outside_the_format_range(ckpt: Checkpointer, step: Any) -> None:
    with pytest.raises(ValueError, match="step"):
        ckpt.save(step, {"w": torch.ones(4)})
    # nothing was queued: the next save is version 1's, and restores
    ckpt.save(MAX_INT, {"w": torch.ones(4)}).wait()
    info = ckpt.restore({"w": torch.zeros(4)})
    assert info.step == MAX_INT


@pytest.mark.parametrize(
    "metadata",
    [{"n": 2**64}, {"n": -(2**63) - 1}, {"nested": {"deep": [1, 2**70]}}, {"x": np.float32(1)}],
)
def test_save_refuses_metadata_the_commit_record_cannot_hold(
    ckpt: Checkpointer, metadata: dict[str, Any]
) -> None:
    """Metadata is written as plain msgpack in the commit record: what that cannot hold is
    refused by save() itself, not found when the commit fails inside wait()."""
    with pytest.raises(ValueError, match="metadata"):
        ckpt.save(1, {"w": torch.ones(4)}, metadata=metadata)


def test_metadata_at_the_edges_of_64_bits_round_trips(ckpt: Checkpointer) -> None:
    metadata = {"hi": 2**64 - 1, "lo": -(2**63)}
    ckpt.save(1, {"w": torch.ones(4)}, metadata=metadata).wait()
    assert dict(ckpt.restore({"w": torch.zeros(4)}).metadata) == metadata


# --- the command line -----------------------------------------------------------------------


def _commands(root: str, out: Path) -> list[list[str]]:
    """One invocation of every command that reads or writes a store at ``root``."""
    return [
        ["ls", root],
        ["show", root, "latest"],
        ["diff", root, "1", "2"],
        ["verify", root],
        ["gc", "--dry-run", root],
        ["gc", root],
        ["rm", "--dry-run", root],
        ["export", root, "latest", str(out / "x.safetensors")],
        ["migrate", "--to", f"file://{out / 'copy'}", root, "latest"],
    ]


def _store(root: Path) -> None:
    tiers = [("lmdb", f"lmdb://{root / 'lmdb'}"), ("remote", f"file://{root / 'remote'}")]
    with Checkpointer(root, tiers=tiers) as c:
        for step in (1, 2):
            c.save(step, {"w": torch.ones(8) * step}).wait()


def _damage_lmdb(root: Path) -> None:
    for mdb in (root / "lmdb").rglob("data.mdb"):
        mdb.write_bytes(b"\xde\xad" * 4096)


def _damage_config(root: Path) -> None:
    (root / "tiercheck.toml").write_text('format = 1\n[[tier]]\nname = "x"\nurl = 3\n')


def _runs(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _assert_one_line(rc: int, out: str, err: str, argv: list[str], as_json: bool) -> None:
    assert rc in (1, 2), (argv, rc, out, err)
    assert "Traceback" not in out + err, (argv, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tiercheck: error: "), (argv, err)
    if as_json:
        doc = json.loads(out)
        assert doc["error"] and doc["exit_status"] == rc, (argv, doc)


@pytest.mark.parametrize("as_json", [False, True])
@pytest.mark.parametrize("case", ["missing-root", "file-as-root", "damaged-lmdb", "damaged-config"])
def test_every_command_fails_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, as_json: bool
) -> None:
    root = tmp_path / "store"
    if case == "file-as-root":
        root.write_text("not a store")
    elif case.startswith("damaged"):
        _store(root)
        (_damage_lmdb if case == "damaged-lmdb" else _damage_config)(root)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for argv in _commands(str(root), out_dir):
        argv = [*argv, *(["--json"] if as_json else [])]
        rc, out, err = _runs(capsys, argv)
        if case == "damaged-lmdb" and rc == 0:
            continue  # the other tiers hold every version: a damaged one is reported, not fatal
        if case == "damaged-lmdb" and argv[0] == "verify" and rc == 1 and not err:
            # a report, not an error: the damaged tier is listed unreachable (exit status 1)
            assert "unreachable" in out or '"reachable": false' in out, (argv, out)
            continue
        _assert_one_line(rc, out, err, argv, as_json)


@pytest.mark.parametrize("as_json", [False, True])
def test_every_command_on_a_missing_bucket_fails_in_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    s3_server: Any,
    monkeypatch: pytest.MonkeyPatch,
    as_json: bool,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    url = f"s3://tiercheck-missing-{uuid.uuid4().hex[:12]}/store"
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for argv in _commands(url, out_dir):
        if argv[0] in ("gc", "rm", "migrate"):
            continue  # these write: a tier URL is refused before any backend call
        argv = [*argv, *(["--json"] if as_json else [])]
        rc, out, err = _runs(capsys, argv)
        _assert_one_line(rc, out, err, argv, as_json)


def test_no_credentials_fails_in_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    s3_server: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without credentials botocore raises its own NoCredentialsError (not an OSError)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    for as_json in (False, True):
        argv = ["ls", "s3://nobucket/x", *(["--json"] if as_json else [])]
        rc, out, err = _runs(capsys, argv)
        _assert_one_line(rc, out, err, argv, as_json)


@pytest.mark.parametrize("as_json", [False, True])
def test_commands_without_a_store_fail_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], as_json: bool
) -> None:
    missing = tmp_path / "missing"
    for argv in (
        ["peer", "status", "127.0.0.1:1", "--timeout", "5"],
        ["peer", "status", "not-a-port"],
        ["peer", "token", "ns", "--token-file", str(missing)],
        ["plan", "--bench", str(missing)],
        ["plan", "--failures", str(tmp_path)],
    ):
        argv = [*argv, *(["--json"] if as_json else [])]
        rc, out, err = _runs(capsys, argv)
        _assert_one_line(rc, out, err, argv, as_json)
