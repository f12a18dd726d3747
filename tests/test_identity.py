"""One store, one owner (issue 22): store identity, moved and copied roots, destructive
commands that delete only what the store owns, and per-user shared memory. Real tiers:
shm in /dev/shm, LMDB and file:// on disk, `tiercheck` run as a subprocess."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import _fresh
import lmdb
import pytest
import torch

from tiercheck import Checkpointer, TierSpec
from tiercheck.backends import DEFAULT_SHM_ROOT, open_tier
from tiercheck.backends._shm_segments import read_owner
from tiercheck.errors import ForeignTier, StoreCopied, StoreLocked
from tiercheck.store.config import CONFIG_NAME, load_config
from tiercheck.store.lifecycle import adopt_store, destroy_store, find_orphans


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4096,), value)}


def _save(root: Path, value: float, step: int = 1, **kw: object) -> None:
    with Checkpointer(root, **kw) as ckpt:  # type: ignore[arg-type]
        ckpt.save(step, _state(value)).wait()


def _restored(root: Path, **kw: object) -> float:
    with Checkpointer(root, **kw) as ckpt:  # type: ignore[arg-type]
        state = _state(-1.0)
        ckpt.restore(state)
        return float(state["w"][0])


def _segment(root: Path) -> Path:
    (spec,) = [s for s in load_config(root / CONFIG_NAME).tiers if s.url.startswith("shm://")]
    return Path(DEFAULT_SHM_ROOT, spec.url[len("shm://") :])


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return _fresh.run(["-m", "tiercheck", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def stores(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Roots under tmp_path; every store left there is deleted with its segments."""
    yield tmp_path
    for root in sorted(tmp_path.iterdir()):
        if (root / CONFIG_NAME).is_file():
            try:
                destroy_store(root)
            except (StoreLocked, FileNotFoundError):
                pass


# --- 1. store identity ---------------------------------------------------------------


def test_a_new_store_records_its_id_in_the_config_and_in_every_tier(stores: Path) -> None:
    root = stores / "run"
    _save(root, 1.0)
    config = load_config(root / CONFIG_NAME)
    assert config.store_id is not None and len(config.store_id) == 32
    assert config.recorded_root == str(root.resolve())
    owner = read_owner(_segment(root))
    assert owner is not None
    assert owner["store_id"] == config.store_id and owner["store"] == str(root.resolve())
    for url in (f"lmdb://{root}/lmdb", f"file://{root}/remote"):
        with open_tier(url, read_only=True) as tier:
            recorded = tier.read_owner()
        assert recorded is not None and recorded.store_id == config.store_id, url
        assert recorded.root == str(root.resolve()), url


def test_a_copied_config_never_merges_two_stores(stores: Path) -> None:
    """Starting a new run from an old run's tiercheck.toml: the new root is a copy of the old
    store (same id) and is refused for writing; adopted, it gets a store of its own, and the
    old run still restores its own weights."""
    first, second = stores / "run1", stores / "run2"
    _save(first, 1.0)
    second.mkdir()
    shutil.copy(first / CONFIG_NAME, second / CONFIG_NAME)
    with pytest.raises(StoreCopied) as raised:
        Checkpointer(second)
    assert str(first.resolve()) in str(raised.value) and str(second.resolve()) in str(raised.value)
    assert raised.value.owner_root == str(first.resolve())
    adopt_store(second)
    _save(second, 2.0, step=18)
    assert _restored(first) == 1.0
    assert _restored(second) == 2.0
    with Checkpointer(first, read_only=True) as ckpt:
        assert [v.step for v in ckpt.history()] == [1]


def test_a_tier_of_another_store_is_refused_naming_both_roots(stores: Path) -> None:
    a, b = stores / "a", stores / "b"
    shm_root = stores / "shm"
    shared = [TierSpec("shm", "shm://one-segment", {"root": str(shm_root)})]
    _save(a, 1.0, tiers=shared)
    with pytest.raises(ForeignTier) as raised:
        Checkpointer(b, tiers=shared)
    assert not isinstance(raised.value, StoreCopied)
    message = str(raised.value)
    assert str(a.resolve()) in message and str(b.resolve()) in message
    # the refused open made no store: the same root opens with tiers of its own
    assert not (b / CONFIG_NAME).exists()
    own = [TierSpec("shm", "shm://another-segment", {"root": str(shm_root)})]
    _save(b, 2.0, tiers=own)
    assert _restored(b) == 2.0
    # reading: the tier of the other store is unavailable, never read as this store's
    # (b's own version, acknowledged in its own shm tier only, reads as lost with it)
    with Checkpointer(b, tiers=shared, read_only=True) as ckpt:
        assert [(v.step, v.restorable, v.gone) for v in ckpt.history()] == [
            (1, False, "lost with tier shm")
        ]
        assert ckpt.tierset.get("shm").tier is None
    assert _restored(a) == 1.0


def test_a_store_made_again_at_its_root_takes_its_id_back_from_its_tiers(
    stores: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The node holding a store's root was replaced: the root, its file and its shm are
    gone; the remote tier (outside the root) survived and records the store's id at this
    root. Opening the root again draws a new id, then takes the old one back from the
    remote, and restores from it; another root is still refused."""
    root, other = stores / "node0", stores / "other"
    tiers = [
        TierSpec("shm", "shm://made-again", {"root": str(stores / "shm")}),
        TierSpec("remote", f"file://{stores / 'remote'}", {"survives": "cluster"}),
    ]
    _save(root, 3.0, tiers=tiers)
    first_id = load_config(root / CONFIG_NAME).store_id
    shutil.rmtree(root)
    shutil.rmtree(stores / "shm")
    with caplog.at_level(logging.WARNING, logger="tiercheck"):
        assert _restored(root, tiers=tiers) == 3.0
    assert load_config(root / CONFIG_NAME).store_id == first_id
    assert f"it takes {first_id} back" in caplog.text
    _save(root, 4.0, step=2, tiers=tiers)  # and it goes on saving as that store
    assert _restored(root, tiers=tiers) == 4.0
    with pytest.raises(ForeignTier, match=str(root.resolve())):
        Checkpointer(other, tiers=tiers[1:])


def test_a_tier_declared_shared_keeps_a_namespace_per_store(stores: Path) -> None:
    a, b = stores / "a", stores / "b"
    tiers = [
        TierSpec("shm", "shm://team", {"root": str(stores / "shm"), "shared_by_stores": True}),
        TierSpec("lmdb", f"lmdb://{stores / 'nvme'}", {"shared_by_stores": True}),
    ]
    _save(a, 1.0, tiers=tiers)
    _save(b, 2.0, step=7, tiers=tiers)
    assert _restored(a) == 1.0 and _restored(b) == 2.0
    with Checkpointer(a, read_only=True) as ckpt:
        assert [v.step for v in ckpt.history()] == [1]
    with Checkpointer(b, read_only=True) as ckpt:
        assert [v.step for v in ckpt.history()] == [7]
    ids = {load_config(r / CONFIG_NAME).store_id for r in (a, b)}
    assert {p.name for p in (stores / "nvme" / "stores").iterdir()} == ids


def _forget_owners(root: Path) -> None:
    """Take the store ids out of the owner records, as an older tiercheck wrote them: the
    segment's owner.json names the root only; LMDB and the remote tier record nothing."""
    owner_file = _segment(root) / "owner.json"
    owner = json.loads(owner_file.read_text())
    del owner["store_id"]
    owner_file.write_text(json.dumps(owner))
    env = lmdb.open(str(root / "lmdb"), max_dbs=2)
    with env.begin(write=True) as txn:
        assert txn.delete(b"tiercheck.owner")
    env.close()
    marker_file = root / "remote" / "tier.json"
    marker = json.loads(marker_file.read_text())
    del marker["owner"]
    marker_file.write_text(json.dumps(marker))


def test_an_older_store_is_adopted_on_its_first_writable_open(stores: Path) -> None:
    """A store written before stores had ids (no store_id, absolute default paths) gets an
    id and tiers relative to its root at its first writable open; a read-only open of it
    writes nothing."""
    root = stores / "old"
    _save(root, 1.0)
    path = root / CONFIG_NAME
    text = path.read_text()
    old = "\n".join(
        line for line in text.splitlines() if not line.startswith(("store_id =", "root ="))
    ).replace("{root}", str(root.resolve()))
    path.write_text(old + "\n")
    _forget_owners(root)
    assert load_config(path).store_id is None
    assert _restored(root, read_only=True) == 1.0
    assert path.read_text() == old + "\n"
    assert _restored(root) == 1.0
    adopted = load_config(path)
    assert adopted.store_id is not None and adopted.recorded_root == str(root.resolve())
    urls = {s.name: s.url for s in adopted.tiers}
    assert urls["lmdb"] == "lmdb://{root}/lmdb" and urls["remote"] == "file://{root}/remote"
    # the tiers the file named before, passed as they were, are still the store's tiers
    where = root.resolve()
    as_before = [
        TierSpec("shm", urls["shm"]),
        TierSpec("lmdb", f"lmdb://{where}/lmdb"),
        TierSpec("remote", f"file://{where}/remote", {"survives": "process", "shared": True}),
    ]
    assert _restored(root, tiers=as_before) == 1.0


# --- 2. roots that move and copy -----------------------------------------------------


@pytest.mark.parametrize("reboot", [False, True], ids=["moved", "moved-and-rebooted"])
def test_a_moved_root_opens_and_restores_from_what_it_holds(stores: Path, reboot: bool) -> None:
    old, new = stores / "run1", stores / "run1-old"
    _save(old, 1.0)
    segment = _segment(old)
    old.rename(new)
    if reboot:  # the shm segment is gone after a reboot: LMDB and the remote hold the data
        shutil.rmtree(segment)
    assert _restored(new) == 1.0
    with Checkpointer(new, read_only=True) as ckpt:
        assert [v.step for v in ckpt.history()] == [1]
    assert not old.exists(), "the open re-created the old root"
    assert load_config(new / CONFIG_NAME).recorded_root == str(new.resolve())
    assert read_owner(segment)["store"] == str(new.resolve())  # type: ignore[index]
    listed = _cli("ls", str(new), "--json")
    assert listed.returncode == 0, listed.stderr


def test_a_copied_root_never_touches_the_original_and_is_adopted_by_a_command(
    stores: Path,
) -> None:
    original, copy = stores / "run", stores / "run-copy"
    _save(original, 1.0)
    segment = _segment(original)
    shutil.copytree(original, copy)
    with pytest.raises(StoreCopied):
        Checkpointer(copy)
    assert _restored(copy, read_only=True) == 1.0  # reading is fine
    # `tiercheck rm` of the copy deletes the copy only
    removed = _cli("rm", str(copy), "--json")
    assert removed.returncode == 0, removed.stderr
    assert json.loads(removed.stdout)["segments"] == []
    assert segment.is_dir() and _restored(original) == 1.0
    # copied again, then adopted: a new store with the copied versions, its own segment
    shutil.copytree(original, copy)
    adopted = _cli("adopt", str(copy), "--json")
    assert adopted.returncode == 0, adopted.stderr
    report = json.loads(adopted.stdout)
    assert report["old_store_id"] == load_config(original / CONFIG_NAME).store_id
    assert report["store_id"] == load_config(copy / CONFIG_NAME).store_id != report["old_store_id"]
    assert _segment(copy) != segment
    assert _restored(copy) == 1.0  # from its own LMDB and remote
    _save(copy, 3.0, step=2)
    assert _restored(original) == 1.0 and _restored(copy) == 3.0
    assert read_owner(segment)["store"] == str(original.resolve())  # type: ignore[index]


# --- 3. destructive commands delete only what the store owns -----------------------------


def test_rm_resolves_rank_templates_to_exact_names(stores: Path) -> None:
    root, shm_root = stores / "job", stores / "shm"
    tiers = [TierSpec("shm", "shm://job-{rank}", {"root": str(shm_root)})]
    _save(root, 1.0, tiers=tiers)
    with open_tier("shm://job-other", root=str(shm_root)) as bystander:
        bystander.append(b"another job's record")
    report = destroy_store(root)
    assert report.segments == (str(shm_root / "job-0"),)
    assert (shm_root / "job-other").is_dir()
    with open_tier("shm://job-other", root=str(shm_root), read_only=True) as tier:
        assert tier.read_log() == [b"another job's record"]


def test_rm_keeps_an_lmdb_environment_another_store_owns(stores: Path) -> None:
    """A copy of a store whose LMDB lives outside the root: rm of the copy keeps it."""
    original, copy = stores / "run", stores / "copy"
    nvme = stores / "nvme" / "lmdb"
    _save(original, 1.0, tiers=[("lmdb", f"lmdb://{nvme}")])
    copy.mkdir()
    shutil.copy(original / CONFIG_NAME, copy / CONFIG_NAME)
    report = destroy_store(copy)
    assert report.lmdb == () and any(str(nvme) in k for k in report.kept)
    assert (nvme / "data.mdb").is_file() and _restored(original) == 1.0
    assert destroy_store(original).lmdb == (str(nvme),)


_HOLDER = textwrap.dedent(
    """
    import sys
    from tiercheck.backends import open_tier
    tier = open_tier(sys.argv[1], root=sys.argv[2])
    print("ready", flush=True)
    sys.stdin.readline()
    tier.close()
    """
)


def test_rm_never_deletes_what_another_live_process_holds_open(stores: Path) -> None:
    root, shm_root = stores / "run", stores / "shm"
    _save(root, 1.0, tiers=[TierSpec("shm", "shm://held", {"root": str(shm_root)})])
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, "shm://held", str(shm_root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with pytest.raises(StoreLocked, match=str(holder.pid)):
            destroy_store(root)
        assert (shm_root / "held").is_dir() and root.is_dir()
        rm = _cli("rm", str(root))
        assert rm.returncode == 2 and "held open" in rm.stderr
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.close()
        holder.wait(timeout=60)
    assert destroy_store(root).segments == (str(shm_root / "held"),)
    assert not (shm_root / "held").exists()


def test_gc_orphans_skips_a_segment_a_live_process_holds(stores: Path) -> None:
    root, shm_root = stores / "gone", stores / "shm"
    _save(root, 1.0, tiers=[TierSpec("shm", "shm://left", {"root": str(shm_root)})])
    shutil.rmtree(root)  # the old way to delete a store: the segment stays behind
    assert [o.segment.name for o in find_orphans([shm_root])] == ["left"]
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, "shm://left", str(shm_root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        assert find_orphans([shm_root]) == []
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.close()
        holder.wait(timeout=60)
    done = _cli("gc", "--orphans", "--yes", "--shm-root", str(shm_root), "--json")
    assert done.returncode == 0, done.stderr
    assert not (shm_root / "left").exists()


# --- 6. per-user shared memory ---------------------------------------------------------


def test_segments_live_in_a_private_directory_per_user(stores: Path) -> None:
    root = stores / "run"
    _save(root, 1.0)
    segment = _segment(root)
    assert segment.parent == Path(f"/dev/shm/tiercheck-{os.getuid()}")
    for directory in (segment.parent, segment, segment / "blobs"):
        st = directory.stat()
        assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700, directory
    files = [p for p in segment.rglob("*") if p.is_file()]
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_another_users_segments_and_shm_root_are_left_alone(stores: Path) -> None:
    shm_root = stores / "shm"
    _save(stores / "gone", 1.0, tiers=[TierSpec("shm", "shm://theirs", {"root": str(shm_root)})])
    shutil.rmtree(stores / "gone")
    os.chown(shm_root / "theirs", 4242, 4242)
    assert find_orphans([shm_root]) == []  # another user's orphan is theirs to judge
    foreign_root = stores / "their-root"
    foreign_root.mkdir()
    os.chown(foreign_root, 4242, 4242)
    with pytest.raises(Exception, match="belongs to uid 4242"):
        open_tier("shm://mine", root=str(foreign_root))
    os.chown(shm_root / "theirs", os.getuid(), os.getgid())
    shutil.rmtree(shm_root / "theirs")


def test_the_orphan_warning_is_given_once_per_process(
    stores: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm_a, shm_b = stores / "shm-a", stores / "shm-b"
    for shm_root in (shm_a, shm_b):
        gone = stores / f"gone-{shm_root.name}"
        _save(gone, 1.0, tiers=[TierSpec("shm", "shm://left", {"root": str(shm_root)})])
        shutil.rmtree(gone)
    monkeypatch.setattr("tiercheck.store.lifecycle._warned", False)  # a fresh process
    with caplog.at_level(logging.WARNING, logger="tiercheck"):
        for shm_root in (shm_a, shm_b):
            tiers = [TierSpec("shm", "shm://alive", {"root": str(shm_root)})]
            _save(stores / f"alive-{shm_root.name}", 1.0, tiers=tiers)
    warnings = [r for r in caplog.records if "gc --orphans" in r.getMessage()]
    assert len(warnings) == 1
    for shm_root in (shm_a, shm_b):
        shutil.rmtree(shm_root / "left")


def test_an_s3_prefix_records_its_owner_and_refuses_another_store(
    stores: Path, s3_bucket: tuple[str, dict[str, object]]
) -> None:
    """The remote tier's marker object under the prefix, through a real S3 endpoint."""
    url, storage_options = s3_bucket
    tiers = [TierSpec("remote", url, {"storage_options": storage_options})]
    a, b = stores / "a", stores / "b"
    _save(a, 1.0, tiers=tiers)
    with open_tier(url, storage_options=storage_options, read_only=True) as tier:
        owner = tier.read_owner()
    assert owner is not None and owner.store_id == load_config(a / CONFIG_NAME).store_id
    with pytest.raises(ForeignTier, match=str(a.resolve())):
        Checkpointer(b, tiers=tiers)
    shared = [
        TierSpec("remote", url, {"storage_options": storage_options, "shared_by_stores": True})
    ]
    _save(b, 2.0, step=5, tiers=shared)
    assert _restored(b, tiers=shared) == 2.0 and _restored(a) == 1.0


@pytest.mark.parametrize("kind", ["shm", "lmdb", "file"])
def test_a_claim_judged_on_a_stale_record_loses_to_the_store_that_got_there_first(
    stores: Path, kind: str
) -> None:
    """The window of two stores opened at once, made deterministic: store b read the tier
    as unowned, store a claimed it since; b's claim loses, writes nothing and is refused
    as foreign (issue 33 item 3). On the old code b overwrote a's record."""
    from tiercheck.store import identity

    spec = {
        "shm": TierSpec("shm", "shm://stale", {"root": str(stores / "shm")}),
        "lmdb": TierSpec("lmdb", f"lmdb://{stores / 'tiers' / 'lmdb'}"),
        "file": TierSpec("remote", f"file://{stores / 'tiers' / 'remote'}"),
    }[kind]
    a, b = stores / "a", stores / "b"
    with open_tier(spec.url, **spec.options) as tier:
        assert tier.read_owner() is None  # what b judged
        identity.claim(tier, spec, "a" * 32, a, read_only=False, owner=None)
        with pytest.raises(ForeignTier, match=str(a)):
            identity.claim(tier, spec, "b" * 32, b, read_only=False, owner=None)
        recorded = tier.read_owner()
    assert recorded is not None
    assert (recorded.store_id, recorded.root) == ("a" * 32, str(a))
