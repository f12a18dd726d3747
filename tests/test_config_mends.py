"""Configuration mends (user report 2): a mistyped ``tiercheck.toml`` is a ``ConfigError``
naming the field and never breaks another store; a writable open on a full disk does not
rewrite an unchanged store file; ``rm`` refuses while a reader holds the store's LMDB open;
credentials in an ``s3://`` URL are used, and never shown.

Real parts throughout: shm in /dev/shm, LMDB, a small tmpfs (skipped where this process
may not mount one), a second process, and the moto S3 server of ``conftest.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import traceback
import uuid
from pathlib import Path
from typing import Any

import _fresh
import pytest
import torch
from _tmpfs import tmpfs

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.backends.registry import open_tier
from tiercheck.errors import ConfigError, InvalidURL, StoreLocked
from tiercheck.store.config import CONFIG_NAME, load_config
from tiercheck.store.lifecycle import destroy_store, find_orphans

STATE = {"w": torch.arange(20_000, dtype=torch.float32)}
MiB = 1 << 20


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return _fresh.run(["-m", "tiercheck", *args], capture_output=True, text=True, timeout=120)


def _store(root: Path) -> None:
    """A default store (shm, LMDB, a local remote tier) with one version saved."""
    with Checkpointer(root) as ckpt:
        ckpt.save(1, STATE).wait()


def _mistype(root: Path, line: str) -> None:
    """Set ``line`` (``key = value``) in the ``[policy]`` table of the store's file."""
    path = root / CONFIG_NAME
    key = line.split("=")[0].strip()
    text, n = re.subn(rf"(?m)^{key} = .*$", line, path.read_text(), count=1)
    assert n == 1
    path.write_text(text)


def _written_urls(root: Path) -> list[str]:
    """The tier URLs written in a store's file (read as text: the file may not load)."""
    return re.findall(r'(?m)^url = "([^"]*)"', (root / CONFIG_NAME).read_text())


# --- (3) a mistyped tiercheck.toml -----------------------------------------------------


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('zstd_level = "3"', "zstd_level"),
        ("zstd_level = 3.5", "zstd_level"),
        ("zstd_level = true", "zstd_level"),
        ('gc_grace_seconds = "5min"', "gc_grace_seconds"),
        ("gc_grace_seconds = true", "gc_grace_seconds"),
        ("hash_threads = -1", "hash_threads"),
        ('hash_threads = "2"', "hash_threads"),
        ("base_every = true", "base_every"),
    ],
)
def test_a_mistyped_policy_value_is_a_config_error_naming_it(
    tmp_path: Path, line: str, field: str
) -> None:
    path = tmp_path / CONFIG_NAME
    path.write_text(f'format = 1\n[policy]\n{line}\n[[tier]]\nname = "m"\nurl = "memory://x"\n')
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}: \[policy\]: {field} "):
        load_config(path)


def test_policy_refuses_values_every_save_would_fail_on() -> None:
    with pytest.raises(ConfigError, match="hash_threads"):
        Policy(hash_threads=-1)
    with pytest.raises(ConfigError, match="zstd_level"):
        Policy(zstd_level=3.5)  # type: ignore[arg-type]


def test_a_broken_store_never_breaks_opening_another(tmp_path: Path) -> None:
    """Store A's file is mistyped: opening store B (whose open scans for orphans, which
    reads A's file) and ``gc --orphans`` work, and A's segment is not judged an orphan."""
    a, b = tmp_path / "a", tmp_path / "b"
    _store(a)
    _mistype(a, 'zstd_level = "3"')
    (shm,) = [s for s in _written_urls(a) if s.startswith("shm://")]
    segment = shm[len("shm://") :]
    try:
        # a fresh process: the orphan scan runs once per process, at its first open
        opened = _fresh.run(
            [
                "-c",
                "import sys, torch, tiercheck\n"
                "with tiercheck.Checkpointer(sys.argv[1]) as c:\n"
                "    c.save(1, {'w': torch.ones(4)}).wait()\n"
                "print('opened')\n",
                str(b),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert opened.returncode == 0 and "opened" in opened.stdout, opened.stderr
        assert all(segment not in o.segment.path for o in find_orphans(sizes=False))
        scan = _cli("gc", "--orphans", "--json")
        assert scan.returncode == 0, scan.stderr
        assert segment not in scan.stdout
    finally:
        _mistype(a, "zstd_level = 1")
        destroy_store(a)
        if (b / CONFIG_NAME).exists():
            destroy_store(b)


def test_ls_and_rm_of_a_mistyped_store_name_the_field(tmp_path: Path) -> None:
    root = tmp_path / "a"
    _store(root)
    _mistype(root, 'zstd_level = "3"')
    try:
        ls = _cli("ls", str(root))
        assert ls.returncode == 2 and "zstd_level" in ls.stderr, ls.stderr
        rm = _cli("rm", str(root))
        assert rm.returncode == 2, rm.stderr
        assert "zstd_level" in rm.stderr and "then delete the store again" in rm.stderr
        assert root.exists()  # nothing deleted
    finally:
        _mistype(root, "zstd_level = 1")
    done = _cli("rm", str(root))
    assert done.returncode == 0, done.stderr
    assert not root.exists()


def test_lmdb_size_options_take_size_strings(tmp_path: Path) -> None:
    tier = open_tier(f"lmdb://{tmp_path / 'lmdb'}", map_size="8MiB", max_size="1GiB")
    try:
        assert tier.map_size == 8 * MiB
    finally:
        tier.close()


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"sync": "yes"}, "sync"),
        ({"writemap": 1}, "writemap"),
        ({"map_size": 64 * MiB, "max_size": 1 * MiB}, "max_size"),
        ({"map_size": "lots"}, "map_size"),
        ({"map_size": 0}, "map_size"),
    ],
)
def test_bad_lmdb_options_are_config_errors_naming_them(
    tmp_path: Path, options: dict[str, Any], name: str
) -> None:
    url = f"lmdb://{tmp_path / 'lmdb'}"
    with pytest.raises(ConfigError, match=rf"{name}"):
        open_tier(url, **options)
    # and through a store's open, before anything is written
    root = tmp_path / "store"
    with pytest.raises(ConfigError, match=rf"lmdb.*{name}"):
        Checkpointer(root, tiers=[TierSpec("lmdb", url, options)])
    assert not (tmp_path / "lmdb").exists()


# --- (5) a full disk -------------------------------------------------------------------


def _fill(disk: Path) -> Path:
    """A ballast file that takes every free block of ``disk``."""
    ballast = disk / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for block in (MiB, 4096):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\xa5" * block):
                    pass
    finally:
        os.close(fd)
    return ballast


def _temp_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(f"{CONFIG_NAME}.tmp"))


def test_a_writable_open_on_a_full_disk_leaves_the_store_file_alone(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", "24m") as disk:
        root = disk / "store"
        try:
            _store(root)
            before = (root / CONFIG_NAME).stat()
            ballast = _fill(disk)
            with Checkpointer(root) as ckpt:  # a trainer's restart, `tiercheck gc`, ...
                assert ckpt.restore({"w": torch.zeros_like(STATE["w"])}).step == 1
                # the sweep that may free room runs without its lease (no room for one)
                assert all(r.fenced is None for r in ckpt.gc())
            after = (root / CONFIG_NAME).stat()
            assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
            assert _temp_files(root) == []
            # a write that is due (another policy) fails, and leaves no temp file either
            with pytest.raises(OSError):
                Checkpointer(root, policy=Policy(base_every=5))
            assert _temp_files(root) == []
            ballast.unlink()
        finally:
            if root.exists():
                destroy_store(root)


# --- (8) rm while a reader holds the LMDB open -------------------------------------------

_READER = """
import sys, tiercheck
ckpt = tiercheck.Checkpointer(sys.argv[1], read_only=True)
print("ready", flush=True)
sys.stdin.readline()
ckpt.close()
"""


def test_rm_refuses_while_a_reader_holds_the_lmdb_open(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _store(root)
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "ready"
        with pytest.raises(StoreLocked, match=rf"lmdb.*process {reader.pid}.*nothing was deleted"):
            destroy_store(root)
        assert (root / CONFIG_NAME).is_file() and (root / "lmdb" / "data.mdb").is_file()
    finally:
        reader.communicate("\n", timeout=120)
    assert reader.returncode == 0
    destroy_store(root)  # the reader is gone: now it goes
    assert not root.exists()


# --- (9) credentials in a remote URL ----------------------------------------------------

KEY, SECRET = "AKIDEXAMPLE", "T0p/Secret+9c1f"
_QUOTED = "T0p%2FSecret+9c1f"  # a secret with '/' is percent-encoded in a URL


def _no_env_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what the URL says can authenticate (conftest.py sets dummy ones)."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
    ):
        monkeypatch.delenv(name, raising=False)


def _endpoint_only(storage_options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in storage_options.items() if k not in ("key", "secret")}


def test_credentials_in_an_s3_url_are_used(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, storage_options = s3_bucket
    bucket_and_path = url[len("s3://") :]
    options = {"storage_options": _endpoint_only(storage_options)}
    _no_env_credentials(monkeypatch)
    # without credentials anywhere the open cannot authenticate: the URL's are what count
    fresh = {"storage_options": {**options["storage_options"], "skip_instance_cache": True}}
    with pytest.raises(Exception, match=r"(?i)credentials"):
        open_tier(url, **fresh)
    root = tmp_path / "store"
    spec = TierSpec("remote", f"s3://{KEY}:{_QUOTED}@{bucket_and_path}", options)
    keep = TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=None)
    policy = Policy(tiers={"remote": keep})
    with Checkpointer(root, tiers=[spec], policy=policy) as ckpt:
        assert ckpt.save(1, STATE).wait().tiers == {"remote": "committed"}
        got = {"w": torch.zeros_like(STATE["w"])}
        assert ckpt.restore(got).step == 1 and torch.equal(got["w"], STATE["w"])
    text = (root / CONFIG_NAME).read_text()
    assert SECRET not in text and _QUOTED not in text and KEY not in text
    # the objects are where the URL without its credentials says
    listed = [o["Key"] for o in _list(s3_bucket)]
    assert any(k.startswith("tier/log/") for k in listed), listed
    # the next open needs the credentials from elsewhere; given again, it reads the version
    with Checkpointer(root, tiers=[spec], policy=policy, read_only=True) as again:
        assert again.version("latest").step == 1
    destroy_store(root)


def _list(s3_bucket: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
    import boto3

    url, storage_options = s3_bucket
    client = boto3.client(
        "s3",
        endpoint_url=storage_options["endpoint_url"],
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    bucket = url[len("s3://") :].split("/", 1)[0]
    return list(client.list_objects_v2(Bucket=bucket).get("Contents", []))


@pytest.mark.parametrize(
    "url",
    [
        pytest.param(f"s3://{KEY}:{_QUOTED}@no-such-bucket-{uuid.uuid4().hex[:8]}/run", id="s3"),
        pytest.param(f"gs://{KEY}:{_QUOTED}@bucket/run", id="gs"),
    ],
)
def test_a_failing_open_never_shows_the_secret(
    tmp_path: Path,
    s3_server: Any,
    url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    options = {"storage_options": _endpoint_only(s3_server.storage_options)}
    if url.startswith("gs://"):
        options = {}
    with pytest.raises(InvalidURL) as caught:
        Checkpointer(tmp_path / "store", tiers=[TierSpec("remote", url, options)])
    shown = "".join(traceback.format_exception(caught.value)) + caplog.text
    shown += json.dumps([str(a) for a in caught.value.args])
    assert SECRET not in shown and _QUOTED not in shown, shown
    assert "no-such-bucket" in str(caught.value) or "storage_options" in str(caught.value)
