"""Opens that once failed whole, and what they do now: a store whose S3 tier took its
credentials in the URL when the store was made, opened again without them (that tier
alone is unavailable; shm and LMDB restore), and the directory an open that failed left
behind (``tiercheck rm`` deletes it).

Real parts: the moto S3 server of ``conftest.py`` on 127.0.0.1, shm segments under the
test's directory, LMDB, and the CLI run in this process.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from _clirun import run_cli

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.errors import EmptyStore, InvalidURL, NoRestorableVersion, TierUnavailable
from tiercheck.store.config import CONFIG_NAME
from tiercheck.store.lifecycle import destroy_store

KEY, SECRET = "AKIDOPENMENDS", "sEcReT-open-77c2"
SYNC = Policy(tiers={"remote": TierPolicy(versions="all", mode="sync", codec="raw")})
# what the s3_server fixture puts in the environment, and a default run would find
_AWS_CREDENTIALS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SECURITY_TOKEN",
    "AWS_SESSION_TOKEN",
)


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((4096,), float(step))}


@contextmanager
def _no_credentials_anywhere() -> Iterator[None]:
    """No AWS credentials in the environment (the shared files and instance metadata are
    off for the session already, see ``conftest.py``), and no S3 file system made before
    with them: fsspec hands one made with the same options back to the next open."""
    from s3fs import S3FileSystem

    S3FileSystem.clear_instance_cache()
    with pytest.MonkeyPatch.context() as mp:
        for name in _AWS_CREDENTIALS:
            mp.delenv(name, raising=False)
        yield


# --- 1: a remote whose credentials were in the URL at creation, opened without them ------


def _make_store(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> tuple[Path, list[TierSpec]]:
    """A store of shm, LMDB and an S3 tier made as ``s3://KEY:SECRET@bucket/tier``,
    holding version 1 in all three; its root and its tiers."""
    url, storage_options = s3_bucket
    endpoint = {k: v for k, v in storage_options.items() if k not in ("key", "secret")}
    scheme, _, rest = url.partition("://")
    root = tmp_path / "run"
    tiers = [
        TierSpec("shm", f"shm://open{uuid.uuid4().hex[:8]}", {"root": str(tmp_path / "shm")}),
        TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}"),
        TierSpec("remote", f"{scheme}://{KEY}:{SECRET}@{rest}", {"storage_options": endpoint}),
    ]
    with Checkpointer(root, tiers=tiers, policy=SYNC) as ckpt:
        r = ckpt.save(1, _state(1)).wait()
        assert r.tiers == {"shm": "committed", "lmdb": "committed", "remote": "committed"}, r
    assert SECRET not in (root / CONFIG_NAME).read_text()
    return root, tiers


def _key_only(tiers: list[TierSpec]) -> list[TierSpec]:
    """``tiers`` with the remote's URL holding its key alone (``s3://KEY@bucket/tier``)."""
    remote = tiers[-1]
    return [
        *tiers[:-1],
        TierSpec(remote.name, remote.url.replace(f":{SECRET}@", "@"), remote.options),
    ]


@pytest.mark.parametrize(
    ("given", "missing"),
    [("none", "Unable to locate credentials"), ("key-only", "Partial credentials")],
)
@pytest.mark.parametrize("read_only", [False, True], ids=["writable", "read-only"])
def test_a_remote_without_its_url_credentials_is_only_that_tier_unavailable(
    tmp_path: Path,
    s3_bucket: tuple[str, dict[str, Any]],
    given: str,
    missing: str,
    read_only: bool,
) -> None:
    """The store's file holds the remote's URL without the credentials it was made with.
    Opened again where none are to be found (or with the URL's key alone), botocore's
    ``NoCredentialsError`` (``PartialCredentialsError``) escaped the open of the remote and
    took the whole store down with it. Now the remote is unavailable at this open, for a
    reason that says the credentials are missing and that is not ``TierUnavailable`` (no
    retry finds them), and shm and LMDB restore the version."""
    root, tiers = _make_store(tmp_path, s3_bucket)
    again = _key_only(tiers) if given == "key-only" else None
    try:
        with (
            _no_credentials_anywhere(),
            Checkpointer(root, tiers=again, policy=SYNC, read_only=read_only) as ckpt,
        ):
            slot = ckpt.tierset.get("remote")
            assert slot.tier is None and slot.error is not None
            assert not slot.unreachable  # not down: no retry finds credentials
            assert "credentials missing" in slot.error and missing in slot.error, slot.error
            assert "storage_options" in slot.error, slot.error  # what to do
            assert SECRET not in slot.error and KEY not in slot.error, slot.error
            state = _state(0)
            info = ckpt.restore(state)
            assert info.step == 1 and bool((state["w"] == 1.0).all())
            assert [v.step for v in ckpt.history()] == [1]
        # the credentials are back in the environment: the next open in this process finds
        # them (the file system that found none is not handed back to it)
        with Checkpointer(root, read_only=True) as ckpt:
            assert ckpt.tierset.get("remote").tier is not None
            assert ckpt.restore(_state(0), tiers=["remote"]).step == 1
    finally:
        destroy_store(root)


@pytest.mark.parametrize("read_only", [False, True], ids=["writable", "read-only"])
def test_a_node_with_only_the_remote_is_not_an_empty_store(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]], read_only: bool
) -> None:
    """Where shm and LMDB hold nothing (another node, a wiped disk) and the remote has no
    credentials, what the store holds is not known: ``restore(missing_ok=True)`` raises,
    saying why, instead of returning None and letting the trainer start over."""
    root, _ = _make_store(tmp_path, s3_bucket)
    shutil.rmtree(tmp_path / "shm")
    shutil.rmtree(tmp_path / "lmdb")
    try:
        with _no_credentials_anywhere(), Checkpointer(root, read_only=read_only) as ckpt:
            assert ckpt.tierset.get("remote").tier is None
            with pytest.raises(NoRestorableVersion) as caught:
                ckpt.restore(_state(0), missing_ok=True)
            assert not isinstance(caught.value, EmptyStore)
            assert "tier remote is unavailable" in str(caught.value), caught.value
            assert "credentials missing" in str(caught.value), caught.value
    finally:
        destroy_store(root)


def test_the_cli_reads_a_store_whose_remote_has_no_credentials(
    tmp_path: Path,
    s3_bucket: tuple[str, dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``ls``, ``show`` and ``verify`` of that store list the remote as unavailable, with
    why, and read the version from shm and LMDB."""
    root, _ = _make_store(tmp_path, s3_bucket)
    try:
        with _no_credentials_anywhere():
            out, _ = run_cli(capsys, "ls", root, "--json")
            tiers = {t["name"]: t for t in json.loads(out)["tiers"]}
            assert "credentials" in tiers["remote"]["error"], tiers["remote"]
            assert tiers["shm"].get("error") is None and tiers["lmdb"].get("error") is None
            out, _ = run_cli(capsys, "show", root, "latest")
            assert "version 0  step 1" in out, out
            out, err = run_cli(capsys, "verify", root, ok=1)  # a tier unreachable
            assert "credentials missing" in out + err, (out, err)
    finally:
        destroy_store(root)


def test_missing_credentials_are_not_retried() -> None:
    """Any call of the tier that meets botocore's credential errors raises a ``TierError``
    that is not ``TierUnavailable``: the retry wrapper and the store's reopen leave it
    alone, as no retry finds credentials."""
    pytest.importorskip("botocore")
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError

    from tiercheck.backends._fsspec.errors import is_unavailable, raise_typed
    from tiercheck.errors import TierError

    for exc in (NoCredentialsError(), PartialCredentialsError(provider="env", cred_var="x")):
        assert not is_unavailable(exc)
        with pytest.raises(TierError) as caught:
            raise_typed(exc, "s3://bucket/x", "ab" * 32, "get")
        assert not isinstance(caught.value, TierUnavailable)
        assert caught.value.__cause__ is exc
        assert "get failed, credentials missing" in str(caught.value), caught.value


# --- 2: the directory a failed open left behind --------------------------------------------


def test_rm_deletes_what_a_failed_open_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An open refused on a bad tier URL leaves the root with tiercheck's ``.lock`` in it
    and nothing else; ``rm`` refused it (no ``tiercheck.toml``). It deletes it now, and
    says what it was; ``--dry-run`` says so and leaves it."""
    root = tmp_path / "sfail"
    with pytest.raises(InvalidURL):
        Checkpointer(root, tiers=[("t", "lmdb://relative/path")])
    assert sorted(p.name for p in root.iterdir()) == [".lock"]
    out, _ = run_cli(capsys, "rm", root, "--dry-run", "--json")
    assert json.loads(out)["failed_open"] is True and root.exists()
    out, _ = run_cli(capsys, "rm", root)
    assert not root.exists()
    assert f"deleted {root}: no store, what a failed open left" in out, out


def test_rm_of_a_failed_open_leftover_with_rank_locks_or_a_lock_held(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The ranks of a job take ``.lock.rankN`` too: still only tiercheck's lock files. A
    process that holds the lock (an open under way) keeps ``rm`` off, as for a store."""
    from tiercheck.store.leases import StoreLock

    root = tmp_path / "ranks"
    root.mkdir()
    for name in (".lock", ".lock.rank0", ".lock.rank1"):
        (root / name).write_text("")
    lock = StoreLock(root, None)
    try:
        _, err = run_cli(capsys, "rm", root, ok=2)
        assert "is open for writing" in err, err
        assert root.exists()
    finally:
        lock.release()
    out, _ = run_cli(capsys, "rm", root, "--json")
    assert json.loads(out)["failed_open"] is True and not root.exists()


def test_rm_still_refuses_a_directory_that_is_not_a_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file besides the lock (the user's), an empty directory, a lone file of another
    name, a ``.lock`` that is a directory: ``rm`` refuses, as before, and deletes nothing."""
    for i, contents in enumerate(([".lock", "notes.txt"], [], ["lock"], [".lock/"])):
        root = tmp_path / f"dir{i}"
        root.mkdir()
        for name in contents:
            if name.endswith("/"):
                (root / name).mkdir()
            else:
                (root / name).write_text("x")
        _, err = run_cli(capsys, "rm", root, ok=2)
        assert "not a tiercheck store" in err, err
        assert sorted(p.name for p in root.iterdir()) == sorted(c.rstrip("/") for c in contents)
    out, _ = run_cli(capsys, "rm", _a_store(tmp_path), "--json")
    assert json.loads(out)["failed_open"] is False


def _a_store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    Checkpointer(root, tiers=[("lmdb", f"lmdb://{tmp_path / 'lmdb'}")]).close()
    return root
