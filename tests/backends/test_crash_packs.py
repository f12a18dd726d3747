"""Crash safety of packs: a real writer process is SIGKILLed while it writes a pack.

The child writes versions of six blobs each into a packed tier whose packs hold about
three blobs, so one pack is written between two puts of a version and one by ``append``
before its record; it prints ``ack`` after each record. On ``file://`` the child kills
itself halfway through writing its Nth pack (a ``writev`` of the pack's temporary file
writes half, then SIGKILL), so the kill lands inside a pack every time; on S3 (moto on
loopback) the parent kills it after N acks, while it is writing a pack or between.

After each crash: every acknowledged record is there with all its blobs whole; at most
the record in flight appears in addition; every pack object the tier lists is whole (its
index parses), none is skipped as damaged; and the tier takes new versions.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import blake3
import pytest

from tiercheck.backends._fsspec import FsspecTier
from tiercheck.backends.registry import open_tier

_PACK_SIZE = 400_000

_CHILD = r"""
import fcntl
import json
import os
import signal
import sys

import blake3

from tiercheck import open_tier
from tiercheck.backends._fsspec import local

url, options, kill_at = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])


class _KillInPack:
    # os for the tier, except that the kill_at-th pack write stops halfway, for good
    def __init__(self):
        self.packs = 0

    def __getattr__(self, name):
        return getattr(os, name)

    def writev(self, fd, views):
        if "/packs/" in os.readlink(f"/proc/self/fd/{fd}"):
            self.packs += 1
            if self.packs > kill_at:  # the kill below failed: never write on and on
                os._exit(3)
            if self.packs == kill_at:
                # torn through the page cache (packs are written around it, O_DIRECT,
                # which takes only whole blocks)
                flags = fcntl.fcntl(fd, fcntl.F_GETFL)
                fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
                first = bytes(views[0])
                os.write(fd, first[: max(1, len(first) // 2)])
                os.kill(os.getpid(), signal.SIGKILL)
        return os.writev(fd, views)


if kill_at > 0:
    local._os = _KillInPack()
tier = open_tier(url, pack_size=int(sys.argv[4]), **options)
start = len(tier.read_log())
for i in range(start, start + 100_000):
    ids = []
    for j in range(6):
        seed = (i * 8 + j).to_bytes(8, "little")
        data = blake3.blake3(seed).digest(length=120_000 + 7919 * ((i + j) % 13))
        bid = blake3.blake3(data).hexdigest()
        tier.put(bid, data)
        ids.append(bid)
    tier.append(f"{i}:{','.join(ids)}:".encode() + bytes([i % 251]) * (i % 4096))
    print(f"ack {i} {','.join(ids)}", flush=True)
"""


def _run(url: str, options: dict[str, Any], *, kill_at: int, acks_before_kill: int) -> list[int]:
    """Run a writer until it dies (``kill_at``: by its own hand in its Nth pack) or the
    parent kills it after ``acks_before_kill`` acks; return the acknowledged versions."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, url, json.dumps(options), str(kill_at), str(_PACK_SIZE)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    acked: list[int] = []
    try:
        assert child.stdout is not None
        for line in child.stdout:
            acked.append(int(line.split()[1]))
            if len(acked) == acks_before_kill:
                child.send_signal(signal.SIGKILL)
                break
    finally:
        if child.poll() is None:
            child.kill()
        rest, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, f"writer ended on its own: {err}"
    acked += [int(line.split()[1]) for line in rest.splitlines()]
    return acked


def _check(url: str, options: dict[str, Any], acked: list[int], crashes: int) -> None:
    tier = open_tier(url, read_only=True, pack_size=_PACK_SIZE, **options)
    assert isinstance(tier, FsspecTier) and tier._packs is not None
    numbers = []
    for rec in tier.read_log():
        i_s, ids, pad = rec.split(b":", 2)
        i = int(i_s)
        assert pad == bytes([i % 251]) * (i % 4096), f"torn record {i}"
        numbers.append(i)
        for bid in ids.decode().split(","):  # every blob a record names is there, whole
            assert blake3.blake3(bytes(tier.get(bid))).hexdigest() == bid
    assert numbers == list(range(len(numbers))), "records lost or out of order"
    assert set(acked) <= set(numbers), "an acknowledged record is missing"
    assert len(numbers) <= len(acked) + crashes, "more than the in-flight records appeared"
    listed = list(tier.list())
    for bid in listed:  # no partial blob is visible, referenced or not
        assert blake3.blake3(bytes(tier.get(bid))).hexdigest() == bid
    assert tier._packs._bad == {}, "a torn or damaged pack object is visible"
    assert len(listed) >= 6 * len(numbers)


def _after_crashes(url: str, options: dict[str, Any]) -> None:
    tier = open_tier(url, pack_size=_PACK_SIZE, **options)
    before = len(tier.read_log())
    data = b"after the crashes" * 1000
    bid = blake3.blake3(data).hexdigest()
    tier.append(b"after", blobs=[(bid, data)])
    assert tier.read_log()[before:] == [b"after"] and bytes(tier.get(bid)) == data
    tier.close()


def test_sigkill_inside_a_pack_write_on_file(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/tier"
    acked: list[int] = []
    for crashes, kill_at in enumerate([2, 5, 1, 4], 1):  # crashes in a row, same tier
        acked += _run(url, {}, kill_at=kill_at, acks_before_kill=0)
        _check(url, {}, acked, crashes)
    assert acked, "no version was acknowledged before the kills"
    _after_crashes(url, {})


@pytest.mark.slow
def test_sigkill_while_writing_packs_on_s3(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    url, storage = s3_bucket
    options = {"storage_options": storage}
    acked: list[int] = []
    for crashes, n in enumerate([2, 1, 4], 1):
        acked += _run(url, options, kill_at=0, acks_before_kill=n)
        _check(url, options, acked, crashes)
    _after_crashes(url, options)


@pytest.mark.parametrize("kill_at", [1])
def test_a_pack_cut_short_is_never_listed(tmp_path: Path, kill_at: int) -> None:
    """The first pack write of a fresh tier dies halfway: nothing of it is visible, and
    its temporary file is never read as a pack."""
    url = f"file://{tmp_path}/tier"
    assert _run(url, {}, kill_at=kill_at, acks_before_kill=0) == []
    tier = open_tier(url, read_only=True, pack_size=_PACK_SIZE)
    assert list(tier.list()) == [] and tier.read_log() == []
    assert list((tmp_path / "tier" / "packs").glob("*.pack")) == []
