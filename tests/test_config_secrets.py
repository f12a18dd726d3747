"""tiercheck.toml: written by tomli-w, secrets never in it, references resolved at open."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.errors import ConfigError
from tiercheck.peer.server import PeerServer
from tiercheck.store.config import (
    CONFIG_NAME,
    StoreConfig,
    is_secret_option,
    load_config,
    resolve_references,
    save_config,
)

PEER_TOKEN = "peer-secret-7f3a9d"
S3_SECRET = "s3-secret-c81e44"


def _files_under(*roots: Path) -> list[Path]:
    return [p for root in roots if root.exists() for p in root.rglob("*") if p.is_file()]


def test_secrets_never_reach_disk(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """A store opened with a peer token and S3 keys in its tier options saves and
    restores, and no file it writes holds either secret."""
    url, storage_options = s3_bucket
    options = dict(storage_options, secret=S3_SECRET)  # moto takes any secret key
    keep = TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=None)
    policy = Policy(tiers={"peer": keep, "remote": keep})
    root = tmp_path / "store"
    with PeerServer("127.0.0.1:0", memory_limit=1 << 26, token=PEER_TOKEN.encode()) as daemon:
        tiers = [
            TierSpec("peer", f"peer://{daemon.address}/ns", {"token": PEER_TOKEN}),
            TierSpec("remote", url, {"storage_options": options}),
        ]
        with Checkpointer(root, tiers=tiers, policy=policy) as ckpt:
            result = ckpt.save(1, {"w": torch.ones(100)}).wait()
            # the secrets given in memory were used for real
            assert result.tiers == {"peer": "committed", "remote": "committed"}
    text = (root / CONFIG_NAME).read_text()
    assert PEER_TOKEN not in text and S3_SECRET not in text and "testing" not in text
    for path in _files_under(root, tmp_path):
        data = path.read_bytes()
        assert PEER_TOKEN.encode() not in data and S3_SECRET.encode() not in data, path
    assert "not writing the secret option" in caplog.text
    saved = load_config(root / CONFIG_NAME)
    remote = next(s for s in saved.tiers if s.name == "remote")
    assert remote.options["storage_options"]["endpoint_url"] == storage_options["endpoint_url"]
    assert "secret" not in remote.options["storage_options"]
    assert "token" not in next(s for s in saved.tiers if s.name == "peer").options


def test_references_are_kept_and_resolved_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret_file = tmp_path / "token"
    secret_file.write_text(PEER_TOKEN + "\n")
    secret_file.chmod(0o600)
    monkeypatch.setenv("TC_TEST_KEY", "from-env")
    spec = TierSpec(
        "remote",
        "peer://127.0.0.1:9/ns",
        {"token": {"file": str(secret_file)}, "nested": {"api_key": {"env": "TC_TEST_KEY"}}},
    )
    path = tmp_path / CONFIG_NAME
    save_config(path, StoreConfig((spec,), Policy()))
    assert PEER_TOKEN not in path.read_text()
    loaded = load_config(path).tiers[0]
    assert loaded.options == spec.options  # the references themselves are written
    resolved = resolve_references(loaded.options, tier="remote")
    assert resolved == {"token": PEER_TOKEN, "nested": {"api_key": "from-env"}}
    monkeypatch.delenv("TC_TEST_KEY")
    with pytest.raises(ConfigError, match="TC_TEST_KEY"):
        resolve_references(loaded.options, tier="remote")


def test_dotted_keys_and_newlines_round_trip(tmp_path: Path) -> None:
    options = {
        "storage_options": {
            "client_kwargs": {"region.name": "eu-west-1", 'quote"d': "a\\b"},
            "note": "line one\nline two\ttabbed \"quoted\" 'single'",
        },
        "survives": "cluster",
        "odd key = with spaces": [1, 2.5, True, "x\ny"],
    }
    tp = TierPolicy(versions="base", mode="async", codec="zstd", keep_bases=None, keep_diffs=3)
    config = StoreConfig(
        (TierSpec("remote", "file:///tmp/x y/\u00e9", options),),
        Policy(base_every=7, tiers={"remote": tp}),
    )
    path = tmp_path / CONFIG_NAME
    save_config(path, config)
    loaded = load_config(path)
    assert loaded.tiers == config.tiers
    assert loaded.policy.tiers["remote"] == tp and loaded.policy.base_every == 7
    assert not os.stat(path).st_mode & stat.S_IWOTH


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("token", True),
        ("secret", True),
        ("aws_secret_access_key", True),
        ("aws_session_token", True),
        ("key", True),
        ("token_file", False),
        ("endpoint_url", False),
        ("survives", False),
    ],
)
def test_secret_option_names(name: str, secret: bool) -> None:
    assert is_secret_option(name) is secret
