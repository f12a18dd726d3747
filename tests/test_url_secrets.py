"""A tier URL may carry credentials (``s3://KEY:SECRET@bucket/path``): wherever tiercheck
shows that URL (the CLI's lines and JSON, an exception, a log record), it shows it without
them, and the rest of the URL as it is.

Real parts: the moto S3 server of ``conftest.py``, LMDB, and the CLI run in this process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _clirun import run_cli

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.errors import ConfigError
from tiercheck.store.config import CONFIG_NAME
from tiercheck.store.lifecycle import destroy_store

KEY, SECRET = "AKIDURLSECRETS", "sEcReT-url-4b1d"
STATE = {"w": torch.arange(4096, dtype=torch.float32)}
SYNC = Policy(tiers={"remote": TierPolicy(versions="all", mode="sync", codec="raw")})


def _with_credentials(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{KEY}:{SECRET}@{rest}"


def _hidden(text: str, *shown: str) -> None:
    """Neither part of the credentials is in ``text``; each of ``shown`` is."""
    assert SECRET not in text and KEY not in text, text
    for part in shown:
        assert part in text, (part, text)


def _endpoint_only(storage_options: dict[str, Any]) -> dict[str, Any]:
    """The moto endpoint, without the credentials the URL gives."""
    return {k: v for k, v in storage_options.items() if k not in ("key", "secret")}


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "store"
    yield path
    if path.exists():
        destroy_store(path)


def _store(root: Path, tmp_path: Path, remote: TierSpec) -> list[TierSpec]:
    """A store at ``root`` with an LMDB tier and ``remote``, holding one version in both."""
    tiers = [TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}"), remote]
    with Checkpointer(root, tiers=tiers, policy=SYNC) as ckpt:
        assert ckpt.save(1, STATE).wait().tiers == {"lmdb": "committed", "remote": "committed"}
    return tiers


def test_migrate_to_and_ls_of_a_url_with_credentials(
    tmp_path: Path,
    root: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    s3_server: Any,
    s3_bucket: tuple[str, dict[str, Any]],
) -> None:
    """``migrate --to`` a credentialed URL, then ``ls`` of it: the copy's URL, the ls title,
    its JSON ``root`` and tier ``url``, and the error for an empty prefix."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    monkeypatch.chdir(tmp_path)  # a tier URL is opened as a store at the working directory
    with Checkpointer(root, tiers=[("lmdb", f"lmdb://{tmp_path / 'lmdb'}")]) as ckpt:
        ckpt.save(3, STATE).wait()
    bucket = s3_bucket[0].removesuffix("/tier")
    copy, second = f"{bucket}/copy", f"{bucket}/second"

    out, err = run_cli(capsys, "migrate", root, "latest", "--to", _with_credentials(copy))
    _hidden(out + err, f"copied versions 0 to {copy}:", f"tiercheck ls {copy}`")
    out, err = run_cli(
        capsys, "migrate", root, "latest", "--to", _with_credentials(second), "--json"
    )
    _hidden(out + err)
    assert json.loads(out)["url"] == second

    out, err = run_cli(capsys, "ls", _with_credentials(copy))
    _hidden(out + err, copy)
    out, err = run_cli(capsys, "ls", _with_credentials(copy), "--json")
    _hidden(out + err)
    doc = json.loads(out)
    assert doc["root"] == copy
    assert [t["url"] for t in doc["tiers"]] == [copy]

    _, err = run_cli(capsys, "ls", _with_credentials(f"{bucket}/empty"), ok=2)
    _hidden(err, f"{bucket}/empty: holds no tiercheck tier")
    _hidden(caplog.text)


def test_ls_and_verify_of_a_store_whose_file_holds_credentials(
    tmp_path: Path,
    root: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    s3_server: Any,
    s3_bucket: tuple[str, dict[str, Any]],
) -> None:
    """A ``tiercheck.toml`` written by hand with the credentials in a tier's URL: ``ls`` and
    ``verify`` of the store while that tier is down, then once its content is gone."""
    url, storage_options = s3_bucket
    options = {"storage_options": _endpoint_only(storage_options), "retry": False}
    _store(root, tmp_path, TierSpec("remote", _with_credentials(url), options))
    config = root / CONFIG_NAME
    written = config.read_text()
    assert f'url = "{url}"' in written
    config.write_text(written.replace(f'url = "{url}"', f'url = "{_with_credentials(url)}"'))

    with s3_server.down():
        out, err = run_cli(capsys, "ls", root, "--verbose")  # the log on stderr too
        _hidden(out, f"tier remote ({url}) is unavailable")
        _hidden(err, f"tier remote ({url}) is unavailable")
        out, err = run_cli(capsys, "ls", root, "--json")
        _hidden(out + err)
        assert {t["name"]: t["url"] for t in json.loads(out)["tiers"]}["remote"] == url

    bucket = url.removeprefix("s3://").partition("/")[0]
    client = s3_server.client()
    for listed in client.list_objects_v2(Bucket=bucket).get("Contents", []):
        client.delete_object(Bucket=bucket, Key=listed["Key"])  # the remote loses everything
    out, err = run_cli(capsys, "ls", root)
    _hidden(out + err, f"tier remote holds nothing of this store at {url} ")
    out, err = run_cli(capsys, "ls", root, "--json")
    _hidden(out + err)
    remote = {t["name"]: t for t in json.loads(out)["tiers"]}["remote"]
    assert remote["url"] == url and f"holds nothing of this store at {url} " in remote["error"]
    out, err = run_cli(capsys, "verify", root, "--json", ok=1)
    _hidden(out + err, f"holds nothing of this store at {url} ")
    _hidden(caplog.text, f"tier remote ({url}) is unavailable")


def test_reopening_with_credentials_in_the_url(
    tmp_path: Path,
    root: Path,
    caplog: pytest.LogCaptureFixture,
    s3_bucket: tuple[str, dict[str, Any]],
) -> None:
    """The store's file holds the URL without its credentials: a writable open that gives
    them again opens the store; one that names another URL is refused without them."""
    url, storage_options = s3_bucket
    options = {"storage_options": _endpoint_only(storage_options)}
    tiers = _store(root, tmp_path, TierSpec("remote", _with_credentials(url), options))
    with Checkpointer(root, tiers=tiers, policy=SYNC) as ckpt:
        assert ckpt.version("latest").step == 1
    elsewhere = f"{url.removesuffix('/tier')}/elsewhere"
    moved = [tiers[0], TierSpec("remote", _with_credentials(elsewhere), options)]
    with pytest.raises(ConfigError) as caught:
        Checkpointer(root, tiers=moved, policy=SYNC)
    _hidden(str(caught.value), f"remote = {url}]", f"remote = {elsewhere}]")
    _hidden(caplog.text)


@pytest.mark.parametrize(
    ("url", "options", "shown"),
    [
        pytest.param(
            "s3://bucket/ckpt",
            {"retry": "sometimes"},
            "tier s3://bucket/ckpt: retry must be",
            id="bad-retry-option",
        ),
        pytest.param(
            "peer://127.0.0.1:7480/ns",
            {"shared_by_stores": True},
            "tier remote (peer://127.0.0.1:7480/ns) cannot be shared by stores",
            id="not-shareable",
        ),
    ],
)
def test_a_refused_tier_never_shows_the_credentials(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    url: str,
    options: dict[str, Any],
    shown: str,
) -> None:
    tiers = [
        TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}"),
        TierSpec("remote", _with_credentials(url), options),
    ]
    with pytest.raises(ConfigError) as caught:  # refused before any store is made
        Checkpointer(tmp_path / "store", tiers=tiers)
    _hidden(str(caught.value), shown)
    _hidden(caplog.text)


def test_a_tier_error_never_carries_the_credentials(tmp_path: Path) -> None:
    """Every ``TierError`` names its tier without them: an unknown scheme's, raised by
    the registry below the store, as any backend's."""
    from tiercheck.errors import UnknownScheme

    with pytest.raises(UnknownScheme) as caught:
        Checkpointer(tmp_path / "store", tiers=[_with_credentials("nosuch://host/x")])
    _hidden(str(caught.value), "tier=nosuch://host/x")
    _hidden(caught.value.url)


def test_rm_of_a_tier_url_is_refused_without_echoing_the_credentials(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, err = run_cli(capsys, "rm", _with_credentials("s3://bucket/ckpt"), ok=2)
    _hidden(err, "s3://bucket/ckpt: rm deletes a store by its root directory")
