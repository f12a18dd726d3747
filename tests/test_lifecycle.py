"""Store lifecycle: every shm segment knows its store; deleting a store frees its memory;
orphans of deleted stores are found, reported and (on request) reclaimed."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import _fresh
import pytest
import torch

from tiercheck import Checkpointer, TierSpec
from tiercheck.backends import DEFAULT_SHM_ROOT, list_segments
from tiercheck.backends._shm_segments import OWNER_FILE, read_owner
from tiercheck.errors import StoreLocked
from tiercheck.store.config import CONFIG_NAME, load_config
from tiercheck.store.lifecycle import destroy_store, find_orphans, remove_orphans, warn_orphans

STATE = {"w": torch.arange(50_000, dtype=torch.float32)}


def _segment_of(root: Path) -> Path:
    (spec,) = [s for s in load_config(root / CONFIG_NAME).tiers if s.url.startswith("shm://")]
    return Path(DEFAULT_SHM_ROOT, spec.url[len("shm://") :])


def _store(root: Path) -> Path:
    """A default store (shm, LMDB, a local remote tier) with one version saved."""
    with Checkpointer(root) as ckpt:
        ckpt.save(1, STATE).wait()
    return _segment_of(root)


def _shm_bytes(store: Path) -> int:
    """Memory the shm segments of ``store`` take (other sessions' segments do not count:
    several test runs and benchmarks share this machine's /dev/shm)."""
    owned = str(store.resolve())
    return sum(s.nbytes or 0 for s in list_segments(DEFAULT_SHM_ROOT) if s.store == owned)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return _fresh.run(["-m", "tiercheck", *args], capture_output=True, text=True, timeout=120)


def test_segment_records_its_owner(tmp_path: Path) -> None:
    root = tmp_path / "store"
    segment = _store(root)
    try:
        owner = read_owner(segment)
        assert owner is not None
        assert owner["store"] == str(root.resolve())
        assert owner["pid"] == os.getpid() and owner["host"] == os.uname().nodename
        assert owner["created"] > 0 and owner["url"].startswith("shm://")
    finally:
        destroy_store(root)


def test_destroy_frees_the_segment_and_the_root(tmp_path: Path) -> None:
    root = tmp_path / "store"
    ckpt = Checkpointer(root)
    ckpt.save(1, STATE).wait()
    segment = _segment_of(root)
    assert segment.is_dir() and _shm_bytes(root) >= STATE["w"].nbytes
    ckpt.destroy()
    assert not segment.exists() and not root.exists()
    assert _shm_bytes(root) == 0


def test_rm_refuses_a_store_open_for_writing(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with Checkpointer(root) as ckpt:
        ckpt.save(1, STATE).wait()
        with pytest.raises(StoreLocked, match="open for writing"):
            destroy_store(root)
        rc = _cli("rm", str(root))
        assert rc.returncode == 2 and "open for writing" in rc.stderr
        assert _segment_of(root).is_dir()
    destroy_store(root)


def test_rm_cli_dry_run_then_delete(tmp_path: Path) -> None:
    root = tmp_path / "store"
    segment = _store(root)
    dry = _cli("rm", str(root), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert report["segments"] == [str(segment)] and report["dry_run"]
    assert segment.is_dir() and root.is_dir()
    done = _cli("rm", str(root), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["freed_bytes"] > 0
    assert not segment.exists() and not root.exists()
    again = _cli("rm", str(root))
    assert again.returncode == 2 and "no store" in again.stderr


def test_rm_refuses_a_directory_that_is_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "precious").write_text("keep me")
    rc = _cli("rm", str(tmp_path))
    assert rc.returncode == 2 and "not a tiercheck store" in rc.stderr
    assert (tmp_path / "precious").read_text() == "keep me"


def test_gc_orphans_finds_and_removes_segments_of_deleted_stores(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    orphan = _store(gone)
    shutil.rmtree(gone)  # the old way to "delete" a store: the segment stays behind
    alive = tmp_path / "alive"
    kept = _store(alive)
    try:
        dry = _cli("gc", "--orphans", "--json")
        assert dry.returncode == 0, dry.stderr
        found = {o["path"]: o for o in json.loads(dry.stdout)["orphans"]}
        assert str(orphan) in found and str(kept) not in found
        assert "is gone" in found[str(orphan)]["reason"] and orphan.is_dir()
        # the store's own rm also finds a segment whose root is already gone
        report = destroy_store(gone, dry_run=True)
        assert report.segments == (str(orphan),)
        done = _cli("gc", "--orphans", "--yes", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["freed_bytes"] > 0
        assert not orphan.exists() and kept.is_dir()
    finally:
        destroy_store(alive)
        shutil.rmtree(orphan, ignore_errors=True)


def test_a_store_created_again_orphans_its_old_segment(tmp_path: Path) -> None:
    root = tmp_path / "store"
    first = _store(root)
    shutil.rmtree(root)  # a new store at the same path gets a new id and segment name
    second = _store(root)
    try:
        assert first != second
        orphans = [o for o in find_orphans() if o.segment.path == str(first)]
        assert len(orphans) == 1 and "another store is at" in orphans[0].reason
        assert not [o for o in find_orphans() if o.segment.path == str(second)]
        assert remove_orphans(orphans) > 0
        assert not first.exists() and second.is_dir()
    finally:
        destroy_store(root)
        shutil.rmtree(first, ignore_errors=True)


def test_segments_without_a_store_are_never_orphans(tmp_path: Path) -> None:
    shm_root = tmp_path / "shm"
    from tiercheck.backends import open_tier

    with open_tier("shm://bare", root=shm_root) as tier:
        tier.append(b"x")
    assert read_owner(shm_root / "bare") is not None
    assert find_orphans([shm_root]) == []
    (shm_root / "bare" / OWNER_FILE).unlink()  # written before owner records existed
    assert [s.owned for s in list_segments(shm_root)] == [False]
    assert find_orphans([shm_root]) == []


def test_opening_a_store_warns_about_orphans(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm_root = tmp_path / "shm"
    gone = tmp_path / "gone"
    spec = [TierSpec("shm", "shm://gone", {"root": str(shm_root)})]
    with Checkpointer(gone, tiers=spec) as ckpt:
        ckpt.save(1, STATE).wait()
    shutil.rmtree(gone)
    monkeypatch.setattr("tiercheck.store.lifecycle._warned", False)  # a fresh process
    with caplog.at_level(logging.WARNING, logger="tiercheck"):
        other = [TierSpec("shm", "shm://other", {"root": str(shm_root)})]
        with Checkpointer(tmp_path / "other", tiers=other):
            pass
    assert "gc --orphans" in caplog.text and str(shm_root / "gone") in caplog.text
    caplog.clear()
    warn_orphans([shm_root, tmp_path])  # once per process, whatever the roots
    assert caplog.text == ""


def test_rm_deletes_an_lmdb_environment_outside_the_root(tmp_path: Path) -> None:
    root, lmdb_dir = tmp_path / "store", tmp_path / "elsewhere" / "lmdb"
    (tmp_path / "elsewhere" / "unrelated").parent.mkdir(parents=True)
    (tmp_path / "elsewhere" / "unrelated").write_text("not ours")
    tiers = [("lmdb", f"lmdb://{lmdb_dir}"), ("remote", f"file://{tmp_path / 'remote'}")]
    with Checkpointer(root, tiers=tiers) as ckpt:
        ckpt.save(1, STATE).wait()
    report = destroy_store(root)
    assert report.lmdb == (str(lmdb_dir),)
    assert any("remote" in k for k in report.kept)  # a remote tier is the user's to delete
    assert not lmdb_dir.exists() and (tmp_path / "elsewhere" / "unrelated").exists()
    assert (tmp_path / "remote").is_dir()


def test_rm_holds_the_writer_lock_while_deleting(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _store(root)
    fd = os.open(root / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a writer that is just starting
        with pytest.raises(StoreLocked):
            destroy_store(root)
    finally:
        os.close(fd)
    destroy_store(root)
    assert not root.exists()


def test_shm_root_left_as_found(tmp_path: Path) -> None:
    """A program that made the shm root removes it when it is done with it and it is empty;
    a root that was there before, or that still holds a segment, stays."""
    from tiercheck.store.lifecycle import shm_root_left_as_found

    root = tmp_path / "shm-root"
    with shm_root_left_as_found(root):
        root.mkdir()  # as the first store opened on the host does
    assert not root.exists()

    root.mkdir()
    with shm_root_left_as_found(root):
        pass
    assert root.is_dir()  # it was there before

    root.rmdir()
    with shm_root_left_as_found(root):
        root.mkdir()
        (root / "segment-of-another-store").write_bytes(b"x")
    assert (root / "segment-of-another-store").exists()


def test_a_checkpointer_dropped_unclosed_is_closed_before_its_lock_is_released(
    tmp_path: Path,
) -> None:
    """A writable Checkpointer that goes out of scope without ``close()`` warns
    (``ResourceWarning``) and is closed: its save in flight committed, its threads ended,
    its tiers closed, and only then the writer lock released, so the store opens again
    and holds the version. Before, dropping it released the lock at once and left its
    threads and open tiers running for the rest of the process, a second writer beside
    them."""
    import gc
    import threading
    import warnings
    import weakref

    def engine_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("tiercheck")]

    before = set(engine_threads())
    root = tmp_path / "store"
    ckpt = Checkpointer(root)
    ckpt.save(1, {"w": torch.arange(1000.0)})
    alive = weakref.ref(ckpt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del ckpt
        gc.collect()
    # (seen once in CI: no warning; if it was not collected, say what still holds it)
    held = alive()
    holders = [type(r).__qualname__ for r in gc.get_referrers(held)] if held else []
    assert any(issubclass(w.category, ResourceWarning) for w in caught), (caught, holders)
    del held
    assert set(engine_threads()) <= before, engine_threads()
    again = Checkpointer(root)
    try:
        out = {"w": torch.zeros(1000)}
        assert again.restore(out).step == 1 and torch.equal(out["w"], torch.arange(1000.0))
    finally:
        again.destroy()


def test_adopt_and_rm_of_a_store_open_for_writing_say_what_to_do_after(tmp_path: Path) -> None:
    """Each refusal ends with the command's own next step: adopt said "then delete the
    store", rm's advice, of a store its user meant to keep."""
    from tiercheck.store.lifecycle import adopt_store

    root = tmp_path / "store"
    with Checkpointer(root, tiers=[("lmdb", f"lmdb://{tmp_path}/lmdb")]) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}).wait()
        with pytest.raises(StoreLocked, match=r"then adopt the copy$"):
            adopt_store(root)
        with pytest.raises(StoreLocked, match=r"then delete the store$"):
            destroy_store(root)
    destroy_store(root)
