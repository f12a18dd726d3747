"""Engine behaviour: bad input, tier loss, corruption with fallback and repair, retention,
GC, background failures, busy policy, the writer lock and the store configuration."""

from __future__ import annotations

import io
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiercheck
from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.backends import DEFAULT_SHM_ROOT
from tiercheck.backends._memory import MemoryTier
from tiercheck.errors import (
    BlobCorrupt,
    CheckpointError,
    ConfigError,
    DurabilityError,
    NoRestorableVersion,
    StateError,
    StoreLocked,
    TierUnavailable,
    UnfinishedWork,
    UnsupportedValue,
)
from tiercheck.formats.codecs import decode_blob
from tiercheck.formats.ids import chunk_id
from tiercheck.history.verify import verify
from tiercheck.store.catalog import read_tier_log
from tiercheck.store.config import default_config
from tiercheck.testing.faults import FaultPlan, inject

CHUNK = 4096
EVERY_RAW = TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=None)


def mem() -> str:
    return f"memory://{uuid.uuid4().hex}"


def small_policy(**tiers: TierPolicy) -> Policy:
    return Policy(base_every=3, chunk_size=CHUNK, gc_grace_seconds=0, tiers=tiers)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Checkpointer]:
    ckpt = Checkpointer(tmp_path / "s", tiers=[("fast", mem())], policy=small_policy())
    yield ckpt
    ckpt.close()


def state_of(seed: int = 0, n: int = 3000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(n, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "np": np.arange(5, dtype=np.int16) + seed,
        "meta": {"step": seed, "name": "x", "pair": (1, 2)},
    }


# --- bad input fails before anything is written -----------------------------------


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (lambda: 1, UnsupportedValue),
        (io.BytesIO(b"x"), UnsupportedValue),
        (torch.zeros(3, 3).to_sparse(), UnsupportedValue),
        (torch.empty(3, device="meta"), UnsupportedValue),
        (torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8), UnsupportedValue),
        ({1.5: torch.ones(1)}, StateError),
        ({"a/b": torch.ones(1)}, StateError),
        (object(), UnsupportedValue),
    ],
)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bad_values_are_refused_before_writing(
    store: Checkpointer, value: Any, error: type[Exception]
) -> None:
    tier = store.tierset.get("fast").tier
    assert tier is not None
    before = (len(tier.read_log()), len(list(tier.list())))
    with pytest.raises(error) as exc:
        store.save(1, {"model": {"w": torch.ones(2)}, "bad": value})
    assert "bad" in str(exc.value)
    store.flush()
    assert (len(tier.read_log()), len(list(tier.list()))) == before


def test_duplicate_keys_after_flattening(store: Checkpointer) -> None:
    with pytest.raises(StateError, match="a/b"):
        store.save(1, {"a": {"b": torch.ones(1)}, "a/b": torch.ones(1)})


def test_unpicklable_metadata_refused(store: Checkpointer) -> None:
    with pytest.raises(UnsupportedValue):
        store.save(1, {"w": torch.ones(1)}, metadata={"f": lambda: 0})


def test_pickle_opt_in_round_trip(tmp_path: Path) -> None:
    from fractions import Fraction

    with Checkpointer(tmp_path / "p", tiers=[mem()], allow_pickle=True) as ckpt:
        ckpt.save(0, {"frac": Fraction(1, 3), "w": torch.ones(2)}).wait()
        out: dict[str, Any] = {"frac": None, "w": torch.zeros(2)}
        ckpt.restore(out)
        assert out["frac"] == Fraction(1, 3)


@pytest.mark.parametrize(
    ("target", "key"),
    [
        ({"w": torch.zeros(3000)}, "b"),  # missing keys in the state
        ({**state_of(), "extra": torch.zeros(1)}, "extra"),
        ({**state_of(), "w": torch.zeros(10)}, "w"),  # wrong shape
        ({**state_of(), "w": torch.zeros(3000, dtype=torch.float64)}, "w"),  # wrong dtype
    ],
)
def test_structure_mismatch_on_restore(
    store: Checkpointer, target: dict[str, Any], key: str
) -> None:
    store.save(0, state_of()).wait()
    with pytest.raises(StateError) as exc:
        store.restore(target)
    assert exc.value.key.startswith(key)


def test_round_trip_many_kinds(store: Checkpointer) -> None:
    src = state_of(5)
    src["nested"] = [torch.arange(4), (torch.ones(2, 2).t(), 3)]  # non-contiguous view
    src["empty"] = torch.empty(0, 4)
    src["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    src["c"] = torch.randn(3, dtype=torch.complex64)
    src["f8"] = torch.ones(5).to(torch.float8_e4m3fn)
    src["bool"] = torch.tensor([True, False])
    src["big"] = 2**70
    store.save(0, src).wait()
    out = store.restore(None).state
    assert torch.equal(out["w"], src["w"]) and torch.equal(out["b"], src["b"])
    assert np.array_equal(out["np"], src["np"]) and out["np"].dtype == np.int16
    assert out["meta"] == {"step": 5, "name": "x", "pair": (1, 2)}
    assert isinstance(out["nested"][1], tuple)
    assert torch.equal(out["nested"][1][0], src["nested"][1][0]) and out["nested"][1][1] == 3
    assert out["empty"].shape == (0, 4) and out["scalar"].item() == 2.5
    assert torch.equal(out["c"], src["c"]) and torch.equal(out["bool"], src["bool"])
    assert torch.equal(out["f8"].view(torch.uint8), src["f8"].view(torch.uint8))
    assert out["big"] == 2**70


def test_restore_writes_into_callers_tensors(store: Checkpointer) -> None:
    src = state_of(1)
    store.save(0, src).wait()
    target = state_of(2)
    w = target["w"]
    store.restore(target)
    assert target["w"] is w and torch.equal(w, src["w"])


# --- tiers lost, corrupted, repaired -------------------------------------------------


def two_tier_store(tmp_path: Path, shm_name: str) -> Checkpointer:
    return Checkpointer(
        tmp_path / "s",
        tiers=[
            TierSpec("shm", f"shm://{shm_name}", {"root": str(tmp_path / "shm")}),
            TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}"),
        ],
        policy=Policy(base_every=3, chunk_size=CHUNK, gc_grace_seconds=0),
    )


def test_lost_shm_restores_base_from_lmdb_and_hides_orphan_diffs(tmp_path: Path) -> None:
    name = uuid.uuid4().hex
    ckpt = two_tier_store(tmp_path, name)
    for step in range(5):  # v0 base, v1 v2 diffs, v3 base, v4 diff
        ckpt.save(step, state_of(step)).wait()
        ckpt.flush()  # LMDB commits a base after shm, on the tail: under load, later
    roles = {v.id: (v.role, v.tiers["lmdb"]) for v in ckpt.history()}
    assert roles[3] == ("base", "committed") and roles[4] == ("diff", "missing")
    ckpt.close()
    shutil.rmtree(tmp_path / "shm")  # the node's shared memory is gone
    ckpt = two_tier_store(tmp_path, name)
    # its only commit record was in the lost tier: history lists it as lost, not restorable
    gone = {v.id: (v.restorable, v.gone) for v in ckpt.history() if v.id == 4}
    assert gone == {4: (False, "lost with tier shm")}
    info = ckpt.restore(state_of(0))
    assert (info.version, info.source) == (3, "lmdb")
    assert info.lost is not None and 4 in info.lost.versions
    ckpt.close()


def test_diff_whose_base_was_only_in_a_lost_tier_is_not_offered(tmp_path: Path) -> None:
    from tiercheck.upkeep.retention import drop_versions

    name = uuid.uuid4().hex
    ckpt = two_tier_store(tmp_path, name)
    ckpt.close()
    policy = Policy(
        base_every=3,
        chunk_size=CHUNK,
        gc_grace_seconds=0,
        tiers={"lmdb": TierPolicy(versions="all", keep_bases=None)},
    )
    specs = [s.spec for s in ckpt.tierset.slots]
    ckpt = Checkpointer(tmp_path / "s", tiers=specs, policy=policy)
    for step in range(5):  # v0 base, v1 v2 diffs, v3 base, v4 diff
        ckpt.save(step, state_of(step)).wait()
    drop_versions(ckpt.tierset.get("lmdb"), [3])  # the base of v4 now lives in shm only
    ckpt.close()
    shutil.rmtree(tmp_path / "shm")
    ckpt = Checkpointer(tmp_path / "s", tiers=specs, policy=policy)
    versions = {v.id: v.restorable for v in ckpt.history()}
    assert versions[4] is False and versions[2] is True
    with pytest.raises(NoRestorableVersion):
        ckpt.restore(state_of(0), version=4)
    assert ckpt.restore(state_of(0)).version == 2
    ckpt.close()


def test_corrupt_blob_falls_back_and_repairs(tmp_path: Path) -> None:
    ckpt = Checkpointer(
        tmp_path / "s",
        tiers=[("lmdb", f"lmdb://{tmp_path / 'lmdb'}"), ("file", f"file://{tmp_path / 'f'}")],
        policy=small_policy(
            lmdb=TierPolicy(versions="all"), file=TierPolicy(versions="all", codec="zstd")
        ),
    )
    src = state_of(3)
    ckpt.save(0, src).wait()
    lmdb = ckpt.tierset.get("lmdb").tier
    assert lmdb is not None
    mid = ckpt.refresh().versions[0].shards[0]
    chunk = _manifest(ckpt, mid).chunks[0].id
    good = bytes(lmdb.get(chunk))
    bad = bytearray(good)
    bad[-1] ^= 0xFF
    lmdb.put(chunk, bytes(bad), overwrite=True)
    target = state_of(0)
    info = ckpt.restore(target)
    assert torch.equal(target["w"], src["w"])
    assert ("lmdb", chunk) in info.corrupt and ("lmdb", chunk) in info.repaired
    assert info.chunks_from.get("file", 0) >= 1 and info.source == "lmdb"
    assert bytes(lmdb.get(chunk)) == good  # repaired with the same raw encoding
    ckpt.close()


def test_every_copy_corrupt_is_an_error_not_data(store: Checkpointer) -> None:
    store.save(0, state_of(1)).wait()
    tier = store.tierset.get("fast").tier
    assert tier is not None
    for blob_id in list(tier.list()):
        data = bytearray(tier.get(blob_id))
        data[-1] ^= 1
        tier.put(blob_id, bytes(data), overwrite=True)
    with pytest.raises((NoRestorableVersion, tiercheck.errors.BlobCorrupt)):
        store.restore(state_of(0))


# --- retention and GC ------------------------------------------------------------------


def test_retention_keeps_newest_base_and_its_diffs_and_gc_frees_blobs(
    store: Checkpointer,
) -> None:
    for step in range(7):  # bases at 0, 3, 6
        store.save(step, state_of(step)).wait()
    hist = {v.id: v.tiers["fast"] for v in store.history()}
    assert hist == {
        0: "dropped",
        1: "dropped",
        2: "dropped",
        3: "dropped",
        4: "dropped",
        5: "dropped",
        6: "committed",
    }
    tier = store.tierset.get("fast").tier
    assert tier is not None
    log = read_tier_log("fast", tier)
    from tiercheck.upkeep.retention import mark

    live = mark(log, lambda mid: _manifest(store, mid))
    assert set(tier.list()) == live  # nothing unreferenced left behind


def _manifest(store: Checkpointer, mid: str) -> Any:
    from tiercheck.store.fetch import ChunkFetcher

    return ChunkFetcher(store.tierset.by_speed()).manifest(mid)


def test_retention_never_drops_a_base_a_kept_diff_needs() -> None:
    from tiercheck.formats.manifest import VersionInfo
    from tiercheck.store.catalog import TierLog
    from tiercheck.upkeep.retention import plan_drops

    tl = TierLog("t")
    for vid, role, base in [(0, "base", None), (1, "diff", 0), (2, "base", None)]:
        tl.committed[vid] = VersionInfo(vid, vid, role, base, 1, (), 0.0, 0)  # type: ignore[arg-type]
    assert plan_drops(tl, TierPolicy(keep_bases=1), pinned={1}) == []
    assert plan_drops(tl, TierPolicy(keep_bases=1)) == [0, 1]


def test_a_base_tier_keeps_a_log_it_took_in_place_of_a_memory_tier_only_while_newest() -> None:
    """LMDB (bases only) takes a log or diff version when shm, over its budget, could not:
    a stopgap, dropped once a newer version is there, not kept as long as its base (which
    left LMDB 2.4 states after gc where the footprint formula says 2)."""
    from tiercheck.formats.manifest import VersionInfo
    from tiercheck.store.catalog import TierLog
    from tiercheck.upkeep.retention import Protection, plan_drops

    tl = TierLog("lmdb")
    for vid, role, base in [(0, "base", None), (1, "log", 0), (2, "diff", 0), (3, "base", None)]:
        tl.committed[vid] = VersionInfo(vid, vid, role, base, 1, (), 0.0, 0)  # type: ignore[arg-type]
    bases_only = TierPolicy(versions="base", keep_bases=2)
    assert plan_drops(tl, bases_only, protect=Protection(frozenset({3}))) == [1, 2]
    assert plan_drops(tl, TierPolicy(keep_bases=2)) == []  # a tier of every version keeps them
    del tl.committed[3]  # while the diff is the newest there, it stays with its base
    assert plan_drops(tl, bases_only, protect=Protection(frozenset({2}))) == [1]


def test_unchanged_content_is_stored_once(store: Checkpointer) -> None:
    big = {"frozen": torch.randn(40_000), "lora": torch.zeros(100)}
    r0 = store.save(0, big).wait()
    big["lora"] += 1
    r1 = store.save(1, big).wait()
    assert r1.role == "diff"
    assert r1.bytes_written["fast"] < r0.bytes_written["fast"] / 10


# --- background failures, busy policy, lock, config -------------------------------------


class FlakyTier(MemoryTier):
    """A memory tier whose puts fail while ``fail`` is set (registered as ``flaky://``)."""

    fail = False

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__("memory://flaky-" + url.split("://", 1)[1], **options)

    def put(self, blob_id: str, data: Any, *, overwrite: bool = False) -> bool:
        if FlakyTier.fail:
            raise TierUnavailable("injected outage", url=self.url, key=blob_id)
        return super().put(blob_id, data, overwrite=overwrite)


def test_a_background_failure_is_raised_by_its_own_handle_only(tmp_path: Path) -> None:
    tiercheck.register_tier("flaky", FlakyTier, replace=True)
    ckpt = Checkpointer(tmp_path / "s", tiers=["flaky://x"], policy=small_policy())
    try:
        FlakyTier.fail = True
        h = ckpt.save(0, state_of())
        ckpt.save(1, state_of())  # fails too; nobody waits on its handle
        ckpt.flush()
        with pytest.raises(CheckpointError, match="injected outage"):
            h.wait()
        FlakyTier.fail = False
        assert ckpt.save(2, state_of()).wait().committed_tiers == ("flaky",)  # not blamed
    finally:
        FlakyTier.fail = False
        with pytest.raises(UnfinishedWork) as err:
            ckpt.close()
    assert [step for step, _, _ in err.value.saves] == [1]  # the failure nobody saw
    assert "injected outage" in err.value.saves[0][2]


def test_a_failing_required_tier_makes_wait_raise_and_the_version_stays_restorable(
    tmp_path: Path,
) -> None:
    tiercheck.register_tier("flaky", FlakyTier, replace=True)
    ckpt = Checkpointer(
        tmp_path / "s", tiers=[("ok", mem()), ("flaky", "flaky://y")], policy=small_policy()
    )
    try:
        FlakyTier.fail = True
        h = ckpt.save(0, state_of())
        with pytest.raises(DurabilityError, match="required tier flaky failed") as err:
            h.wait()  # a synchronous tier is required by default
        assert err.value.failed.keys() == {"flaky"}
        assert "injected outage" in err.value.failed["flaky"]
        assert err.value.committed == ("ok",) and "restored from ok" in str(err.value)
        r = h.result_now()
        assert r.tiers == {"ok": "committed", "flaky": "failed"}
        (v,) = ckpt.history()
        assert v.holders == ("ok",) and v.restorable and v.tiers["flaky"] == "missing"
        out = ckpt.restore(state_of(9)).state
        assert torch.equal(out["w"], state_of()["w"]) and out["meta"] == state_of()["meta"]
    finally:
        FlakyTier.fail = False
        ckpt.close()


def test_a_failing_best_effort_tier_only_lowers_the_commit_level(tmp_path: Path) -> None:
    tiercheck.register_tier("flaky", FlakyTier, replace=True)
    best_effort = TierPolicy(keep_bases=None, guarantee="best_effort")
    ckpt = Checkpointer(
        tmp_path / "s",
        tiers=[("ok", mem()), ("flaky", "flaky://y")],
        policy=small_policy(flaky=best_effort),
    )
    try:
        FlakyTier.fail = True
        r = ckpt.save(0, state_of()).wait()
        assert r.tiers == {"ok": "committed", "flaky": "failed"}
        assert "injected outage" in r.errors["flaky"]
    finally:
        FlakyTier.fail = False
        ckpt.close()


def test_durability_asks_for_a_failure_domain(tmp_path: Path) -> None:
    shm = f"shm://d{uuid.uuid4().hex[:10]}"
    tiers = [
        TierSpec("shm", shm, {"root": str(tmp_path / "shm")}),
        ("disk", f"lmdb://{tmp_path}/l"),
    ]
    every = TierPolicy(keep_bases=None)
    with Checkpointer(
        tmp_path / "s", tiers=tiers, policy=small_policy(shm=every, disk=every)
    ) as ckpt:
        assert ckpt.save(0, state_of()).wait().committed_tiers == ("shm", "disk")
    node = Policy(chunk_size=CHUNK, durability="node", tiers={"shm": every, "disk": every})
    with Checkpointer(tmp_path / "s", tiers=tiers, policy=node) as ckpt:
        with pytest.raises(DurabilityError, match="survives losing a node"):
            ckpt.save(1, state_of(1)).wait()  # shm and LMDB are both lost with the node
        assert ckpt.restore(state_of(9)).step == 1  # committed all the same


def test_skip_when_busy_reports_skipped(tmp_path: Path) -> None:
    import threading

    gate = threading.Event()

    class SlowTier(MemoryTier):
        def __init__(self, url: str, **options: Any) -> None:
            super().__init__("memory://slow-" + uuid.uuid4().hex, **options)

        def append(self, record: bytes, *, blobs: Any = ()) -> None:
            gate.wait(30)
            super().append(record, blobs=blobs)

    tiercheck.register_tier("slowtier", SlowTier, replace=True)
    policy = Policy(chunk_size=CHUNK, on_busy="skip")
    with Checkpointer(tmp_path / "s", tiers=["slowtier://z"], policy=policy) as ckpt:
        first = ckpt.save(0, state_of())
        first.wait_staged()
        second = ckpt.save(1, state_of())
        third = ckpt.save(2, state_of())
        assert second.skipped or third.skipped
        gate.set()
        assert first.wait().version == 0


@pytest.mark.parametrize("log", [False, True])
def test_guard_never_lets_the_step_change_what_a_save_copies(tmp_path: Path, log: bool) -> None:
    """A guarded step never changes weights a save copies afterwards. The save before it
    holds the staging buffer and the pipeline (its log append waits on ``gate``), so the
    save of ``model`` stays unstaged; the step runs on a thread that is traced: once it is
    either inside the guard's wait or done, the gate opens. Without the update log the
    save gives way (latest wins: skipped, and the step goes on at once); with it, the save
    is planned on the pipeline thread and the step waits until it has been staged. Without
    the guard the step is done before that, and changes the weights the save then copies."""
    plan = FaultPlan()
    gate = threading.Event()
    plan.hook(lambda event: gate.wait(), "append")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(tmp_path / "s", tiers=[("fast", mem())], policy=small_policy()) as ckpt:
        inject(ckpt, "fast", plan)
        remove = ckpt.guard(opt, log=log)
        ckpt.save(0, state_of(0))  # its append waits on the gate: the pipeline is held
        h = ckpt.save(1, {"model": model})
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        model(torch.ones(1, 4)).sum().backward()
        staged_at_step: list[bool] = []
        opt.register_step_post_hook(lambda *_: staged_at_step.append(h._staged.is_set()))
        decided = threading.Event()  # the step is waiting in the guard, or done

        def trace(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code.co_name == "wait_staged":
                decided.set()

        def step() -> None:
            try:
                opt.step()
            finally:
                decided.set()

        threading.settrace(trace)
        try:
            stepper = threading.Thread(target=step)
            stepper.start()
        finally:
            threading.settrace(None)  # type: ignore[arg-type]
        decided.wait()
        gate.set()
        stepper.join()
        h.wait()
        assert staged_at_step == [True]
        assert h.skipped is not log
        if not log:
            assert "latest wins" in h.result().why_skipped
            assert 1 not in [v.step for v in ckpt.history()]
        else:
            restored = ckpt.restore({"model": torch.nn.Linear(4, 4)}, version=h.wait().version)
            for key, value in restored.state["model"].state_dict().items():
                assert torch.equal(value, saved[key]), key  # the weights before the step
        remove()


def test_second_writer_is_refused(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "s", tiers=[mem()]):
        with pytest.raises(StoreLocked):
            Checkpointer(tmp_path / "s", tiers=[mem()])
        reader = Checkpointer(tmp_path / "s", read_only=True)
        reader.close()


def test_default_config_is_written_and_reread(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with Checkpointer(root) as ckpt:
        names = [s.name for s in ckpt.tierset.slots]
        assert names == ["shm", "lmdb", "remote"]
        h = ckpt.save(0, state_of())
        r = h.wait_migrated()
        assert r.tiers == {"shm": "committed", "lmdb": "committed", "remote": "committed"}
        shm_url = ckpt.tierset.get("shm").spec.url
    text = (root / "tiercheck.toml").read_text()
    assert "[[tier]]" in text and shm_url in text
    with Checkpointer(root) as again:
        assert again.tierset.slots[0].spec.url == shm_url
        assert again.restore(state_of(1)).version == 0
        shm = again.tierset.get("shm").tier
        assert shm is not None
        # clean the shared memory this test created
        shm.delete(list(shm.list()))
    shutil.rmtree(f"{DEFAULT_SHM_ROOT}/{shm_url.removeprefix('shm://')}", ignore_errors=True)


def test_bad_config_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "tiercheck.toml").write_text("[policy]\nbase_every = 0\n")
    with pytest.raises(ConfigError):
        Checkpointer(tmp_path)
    with pytest.raises(ConfigError):
        Policy(chunk_size=1000)
    with pytest.raises(tiercheck.errors.UnknownScheme):
        Checkpointer(tmp_path / "x", tiers=["nosuch://a"])


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_a_copy_rewritten_by_repair_decodes_to_its_chunk(tmp_path: Path, codec: str) -> None:
    """A chunk damaged in the fast tier is read from LMDB and written back in the fast
    tier's codec, by a restore and by ``verify(repair=True)``: the copy then decodes to the
    chunk it names."""
    fast_policy = TierPolicy(versions="all", mode="sync", codec=codec, keep_bases=None)
    with Checkpointer(
        tmp_path / "s",
        tiers=[("fast", mem()), TierSpec("slow", f"lmdb://{tmp_path / 'lmdb'}")],
        policy=small_policy(fast=fast_policy, slow=EVERY_RAW),
    ) as ckpt:
        ckpt.save(0, state_of(0)).wait()
        fast = ckpt.tierset.get("fast").tier
        assert fast is not None
        cid = ckpt.version(0).manifest.chunks[0].id

        def damage() -> None:
            blob = bytearray(fast.get(cid))
            blob[-1] ^= 0xFF
            fast.put(cid, bytes(blob), overwrite=True)
            with pytest.raises(BlobCorrupt):
                decode_blob(fast.get(cid), cid)

        damage()
        info = ckpt.restore(state_of(1))
        assert ("fast", cid) in info.repaired
        assert chunk_id(decode_blob(fast.get(cid), cid)) == cid
        damage()
        report = verify(ckpt, repair=True)
        assert report.repaired == 1 and report.ok
        assert chunk_id(decode_blob(fast.get(cid), cid)) == cid


def test_a_store_created_again_at_the_same_path_starts_empty(tmp_path: Path) -> None:
    """Deleting a store's directory leaves its shm segment behind; a new store at the same
    path must not read it (it gets a segment of its own)."""
    root = tmp_path / "store"
    with Checkpointer(root) as first:
        first.save(0, state_of()).wait()
        old = first.tierset.get("shm").spec.url
    shutil.rmtree(root)  # the shm segment stays in /dev/shm
    new = old
    try:
        with Checkpointer(root) as second:
            new = second.tierset.get("shm").spec.url
            assert new != old
            assert second.history() == []
            with pytest.raises(NoRestorableVersion):
                second.restore(state_of(1))
    finally:
        for url in {old, new}:
            shutil.rmtree(f"{DEFAULT_SHM_ROOT}/{url.removeprefix('shm://')}", ignore_errors=True)


def test_default_config_for_several_ranks_is_per_rank() -> None:
    cfg = default_config(Path("/data/ckpt"), multi_rank=True)
    urls = {s.name: s.url for s in cfg.tiers}
    assert urls["shm"].endswith("-{rank}") and urls["lmdb"] == "lmdb://{root}/lmdb-{rank}"
    assert default_config(Path("/data/ckpt")).tiers[0].url != urls["shm"].removesuffix("-{rank}")


def test_a_store_without_a_diff_tier_saves_every_version_as_a_base(tmp_path: Path) -> None:
    """LMDB alone takes bases only by default: every save must still land (as a base)."""
    with Checkpointer(tmp_path / "s", tiers=[("lmdb", f"lmdb://{tmp_path / 'lmdb'}")]) as ckpt:
        roles = [ckpt.save(i, state_of(i)).wait().role for i in range(3)]
        assert roles == ["base"] * 3
        assert ckpt.restore(state_of(0)).step == 2


def test_a_store_of_remote_tiers_only_commits_synchronously_to_one(tmp_path: Path) -> None:
    remote = TierSpec("remote", f"file://{tmp_path / 'r'}", {"survives": "cluster", "shared": True})
    with Checkpointer(tmp_path / "s", tiers=[remote]) as ckpt:
        r = ckpt.save(0, state_of(0)).wait()
        assert r.tiers == {"remote": "committed"}
        assert ckpt.tierset.get("remote").policy.mode == "sync"  # type: ignore[union-attr]


def memory_and_delta_tier(tmp_path: Path, name: str, tier_policy: TierPolicy) -> Checkpointer:
    """A store of a memory tier and a second memory tier ``name`` placed by ``tier_policy``."""
    return Checkpointer(
        tmp_path / "s",
        tiers=[("mem", f"memory://{uuid.uuid4().hex}"), (name, f"memory://{uuid.uuid4().hex}")],
        policy=Policy(chunk_size=CHUNK, base_every=10, tiers={name: tier_policy}),
    )


def test_migration_delta_encodes_with_the_entry_element_size(tmp_path: Path) -> None:
    """A diff migrated to a delta tier is byte-shuffled by its tensor's element size, as a
    synchronous delta tier does (so deltas of fp32 weights compress as well there)."""
    from tiercheck.formats.codecs import read_header

    slow = TierPolicy(versions="all", mode="async", codec="delta", keep_bases=None)
    w = torch.randn(64 * 1024, generator=torch.Generator().manual_seed(0))
    with memory_and_delta_tier(tmp_path, "deltas", slow) as ckpt:
        ckpt.save(0, {"w": w}).wait_migrated()
        w[:100] += 1e-3
        r = ckpt.save(1, {"w": w}).wait_migrated()
        assert r.role == "diff" and r.tiers["deltas"] == "committed"
        changed = ckpt.version(r.version).entries["w"].chunks[0]
        tier = ckpt.tierset.get("deltas").tier
        assert tier is not None
        header = read_header(bytes(tier.get(changed)))
        assert (header.codec.name, header.elem_size) == ("DELTA", 4)
        assert torch.equal(ckpt.version(r.version)["w"], w)


def test_a_delta_tier_that_lost_the_base_stores_the_diff_whole(tmp_path: Path) -> None:
    """A delta against a base chunk the tier does not hold would depend on another tier's
    copy, which that tier's retention may drop: such chunks are stored zstd instead."""
    from tiercheck.formats.codecs import read_header

    every = TierPolicy(versions="all", codec="delta", keep_bases=None)
    w = torch.randn(16 * 1024, generator=torch.Generator().manual_seed(0))
    with memory_and_delta_tier(tmp_path, "d", every) as ckpt:
        ckpt.save(0, {"w": w}).wait()
        ckpt.flush()  # "d" has taken version 0 (under load it was still busy: latest wins)
        tier = ckpt.tierset.get("d").tier
        assert tier is not None
        tier.delete(list(tier.list()))  # the base's blobs are lost from this tier only
        w[:10] += 1e-3
        r = ckpt.save(1, {"w": w}).wait()
        assert r.role == "diff" and r.tiers["d"] == "committed"
        codecs = {read_header(tier.head(c)).codec.name for c in tier.list()}
        assert codecs == {"ZSTD"}


def test_a_store_of_asynchronous_tiers_only_is_refused(tmp_path: Path) -> None:
    lazy = TierPolicy(versions="all", mode="async", codec="zstd")
    with pytest.raises(ConfigError, match="asynchronous"):
        Checkpointer(
            tmp_path / "s",
            tiers=[("a", f"memory://{uuid.uuid4().hex}")],
            policy=Policy(tiers={"a": lazy}),
        )


@pytest.mark.parametrize("hard_links", [True, False])
def test_the_first_config_written_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hard_links: bool
) -> None:
    """Ranks opening one new root race to write its config: exactly one write lands, with or
    without hard links on the file system."""
    import os

    from tiercheck.store.config import load_config, save_config

    if not hard_links:

        def no_link(*_: Any) -> None:
            raise PermissionError("hard links are not supported here")

        monkeypatch.setattr(os, "link", no_link)
    path = tmp_path / "tiercheck.toml"
    first, second = default_config(tmp_path), default_config(tmp_path)
    assert save_config(path, first, exclusive=True)
    assert not save_config(path, second, exclusive=True)
    assert load_config(path).tiers == first.tiers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiercheck.toml"]  # no temp files
