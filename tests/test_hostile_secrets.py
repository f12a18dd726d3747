"""Secrets never reach tiercheck.toml, whatever shape they come in; the file is mode 0600."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from tiercheck import Policy, TierSpec
from tiercheck.store.config import (
    CONFIG_NAME,
    StoreConfig,
    is_secret_option,
    load_config,
    save_config,
    without_userinfo,
)

SECRET = "hunter2-9c1f"


def _written(tmp_path: Path, url: str, options: dict[str, Any]) -> tuple[str, TierSpec]:
    path = tmp_path / CONFIG_NAME
    save_config(path, StoreConfig((TierSpec("remote", url, options),), Policy()))
    return path.read_text(), load_config(path).tiers[0]


@pytest.mark.parametrize(
    ("url", "options"),
    [
        pytest.param(f"s3://AKIAEXAMPLE:{SECRET}@bucket/ckpt", {}, id="url-userinfo"),
        pytest.param(f"s3://{SECRET}@bucket/ckpt", {}, id="url-user-only"),
        pytest.param(
            "s3://bucket/ckpt",
            {"storage_options": {"endpoint_url": f"https://user:{SECRET}@s3.example.com"}},
            id="endpoint-url-userinfo",
        ),
        pytest.param(
            "s3://bucket/ckpt",
            {"storage_options": {"headers": {"Authorization": f"Bearer {SECRET}"}}},
            id="headers-authorization",
        ),
        pytest.param(
            "https://example.com/ckpt",
            {"storage_options": {"client_kwargs": {"headers": {"Cookie": f"s={SECRET}"}}}},
            id="headers-cookie",
        ),
        pytest.param(
            "s3://bucket/ckpt",
            {"storage_options": {"Authorization": SECRET}},
            id="authorization",
        ),
        pytest.param(
            "s3://bucket/ckpt",
            {"storage_options": {"client_kwargs": {"aws_access_key_id": SECRET}}},
            id="aws-access-key-id",
        ),
        pytest.param(
            "s3://bucket/ckpt",
            {"storage_options": {"client_kwargs": {"aws_secret_access_key": SECRET}}},
            id="aws-secret-access-key",
        ),
        pytest.param("gs://bucket/ckpt", {"storage_options": {"token": SECRET}}, id="token"),
        pytest.param("sftp://host/ckpt", {"storage_options": {"password": SECRET}}, id="password"),
        pytest.param("s3://bucket/ckpt", {"storage_options": {"secret": SECRET}}, id="secret"),
        pytest.param("abfs://c/ckpt", {"storage_options": {"client_id": SECRET}}, id="client-id"),
        pytest.param(
            "https://example.com/ckpt",
            {"storage_options": {"X-Api-Key": SECRET}},
            id="hyphenated-api-key",
        ),
        pytest.param(
            "s3://bucket/ckpt",
            {"storage_options": {"headers": [["Authorization", SECRET]]}},
            id="headers-as-pairs",
        ),
    ],
)
def test_secret_shape_never_written(
    tmp_path: Path, url: str, options: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    text, loaded = _written(tmp_path, url, options)
    assert SECRET not in text
    assert "not writing the secret option" in caplog.text
    assert "environment" in caplog.text and "passed to that open" in caplog.text
    assert SECRET not in repr(loaded)
    # what is not a secret is written as it was
    assert loaded.url.startswith(url.split("://")[0] + "://")
    assert loaded.url.endswith("/ckpt")


def test_plain_options_and_references_stay(tmp_path: Path) -> None:
    options = {
        "storage_options": {
            "endpoint_url": "http://127.0.0.1:9000",
            "headers": {"Authorization": {"env": "TC_AUTH"}, "Cookie": "s=1"},
            "client_kwargs": {"region_name": "eu-west-1"},
        },
        "survives": "cluster",
    }
    _, loaded = _written(tmp_path, "s3://bucket/ckpt", options)
    assert loaded.options == {
        "storage_options": {
            "endpoint_url": "http://127.0.0.1:9000",
            "headers": {"Authorization": {"env": "TC_AUTH"}},
            "client_kwargs": {"region_name": "eu-west-1"},
        },
        "survives": "cluster",
    }


@pytest.mark.parametrize("exclusive", [False, True])
def test_config_file_is_0600(tmp_path: Path, exclusive: bool) -> None:
    old = os.umask(0)
    try:
        path = tmp_path / CONFIG_NAME
        spec = TierSpec("remote", "file:///tmp/x")
        assert save_config(path, StoreConfig((spec,), Policy()), exclusive=exclusive)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("headers", True),
        ("Authorization", True),
        ("Cookie", True),
        ("aws_access_key_id", True),
        ("X-Api-Key", True),
        ("endpoint_url", False),
        ("region_name", False),
    ],
)
def test_secret_names(name: str, secret: bool) -> None:
    assert is_secret_option(name) is secret


def test_without_userinfo() -> None:
    assert without_userinfo("s3://k:s@bucket/a@b") == "s3://bucket/a@b"
    assert without_userinfo("peer://10.0.0.1:7480/ns") == "peer://10.0.0.1:7480/ns"
    assert without_userinfo("lmdb:///data/a@b") == "lmdb:///data/a@b"
    assert without_userinfo("user@host") == "user@host"
