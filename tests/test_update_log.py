"""The update log: capture at every step, replay from a full version, verification.

SPEC.md section 12. The resume test runs the replay in a new process, from a full version
restored by the engine and a log version written to files in the format's layout.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import _fresh
import pytest
import torch
import update_log_run as ulr
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tiercheck.errors import BlobCorrupt, ReplayMismatch, ReplayRefused, StateError
from tiercheck.formats import chunk_id
from tiercheck.formats.manifest import (
    Fingerprint,
    GroupOptions,
    LogStep,
    ParamSpec,
    ReplayLog,
    ShardManifest,
    SmallTensor,
    pack_manifest,
    unpack_manifest,
)
from tiercheck.logversions.fingerprint import fingerprint, fingerprints, wsum64_reference
from tiercheck.logversions.replay import replay
from tiercheck.logversions.update_log import LoggedSteps, UpdateLog, plan_log

RUNNER = Path(__file__).resolve().parent / "update_log_run.py"


# --- a small model for the in-process tests ---------------------------------------------


class Small:
    """An MLP with AdamW; ``step`` trains one step on fixed data (optionally via a scaler)."""

    def __init__(self, seed: int = 0, **opt: Any) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, **opt)
        self.scaler: torch.amp.GradScaler | None = None
        self.x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        self.y = torch.randn(16, 4, generator=torch.Generator().manual_seed(2))
        self.n = 0

    def step(self, inf: bool = False) -> None:
        self.n += 1
        self.opt.zero_grad()
        loss = nn.functional.mse_loss(self.model(self.x * self.n), self.y)
        if self.scaler is None:
            loss.backward()
            self.opt.step()
            return
        self.scaler.scale(loss).backward()
        if inf:
            self.model[0].weight.grad[0, 0] = float("inf")
        self.scaler.step(self.opt)
        self.scaler.update()

    def base(self) -> dict[str, Any]:
        return copy.deepcopy({"model": self.model.state_dict(), "opt": self.opt.state_dict()})

    def load(self, base: dict[str, Any]) -> None:
        base = copy.deepcopy(base)  # load_state_dict keeps the tensors it is given
        self.model.load_state_dict(base["model"])
        self.opt.load_state_dict(base["opt"])

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"m/{k}": v.clone() for k, v in self.model.state_dict().items()}
        for pid, s in self.opt.state_dict()["state"].items():
            out.update({f"o/{pid}/{k}": v.clone() for k, v in s.items()})
        return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def _stream(logged: LoggedSteps, chunk_size: int = 256) -> tuple[Any, bytes]:
    layout = plan_log(logged, chunk_size)
    stream = bytearray(layout.end)
    for offset, data in layout.segments:
        stream[offset : offset + len(data)] = data
    return layout, bytes(stream)


def _replay_from(layout: Any, stream: bytes, opt: torch.optim.Optimizer, **kw: Any) -> Any:
    manifest = ShardManifest(0, 0, 1, 64, len(stream), layout.entries, (), None)
    return replay(opt, layout.replay, ulr.gradients(manifest, stream), **kw)


# --- exact resume in a new process --------------------------------------------------------


@pytest.mark.slow
def test_resume_in_a_new_process_is_bit_identical(tmp_path: Path) -> None:
    """fp32 AdamW, a schedule, clipping, a CPU GradScaler and a skipped step: restore the
    full version, replay the log in another process, train on: every bit as never stopped."""
    run = ulr.Run()
    ulog = UpdateLog()
    ulog.attach(run.opt, run.scaler)
    for _ in range(ulr.BASE_STEP):
        run.step()
    with ulr.open_store(tmp_path / "store") as ckpt:
        ckpt.save(ulr.BASE_STEP, run.state(), role="base").wait()
        ulog.reset()
        for _ in range(ulr.LOG_STEPS):
            run.step()
    logged = ulog.take()
    assert [s.skipped for s in logged.steps] == [False, True, False, False]
    ulr.write_log(logged, run.leaves(), tmp_path / "log")
    ulog.release(logged)
    for _ in range(ulr.AFTER):
        run.step()
    out = tmp_path / "resumed.json"
    _fresh.run(
        [
            str(RUNNER),
            "resume",
            str(tmp_path / "store"),
            str(tmp_path / "log"),
            str(out),
        ],
        check=True,
        timeout=240,
    )
    resumed = json.loads(out.read_text())
    assert (resumed["steps"], resumed["skipped"]) == (ulr.LOG_STEPS - 1, 1)
    assert resumed["digests"] == run.digests()


# --- verification and refusal -----------------------------------------------------------


def _logged_run(edit: bool = False, **opt: Any) -> tuple[Small, dict[str, Any], LoggedSteps]:
    s = Small(**opt)
    ulog = UpdateLog()
    ulog.attach(s.opt)
    s.step()
    base = s.base()
    ulog.reset()
    s.step()
    if edit:  # through .data (a version counter of its own): the log cannot know
        s.model[2].bias.data.add_(1e-3)
    s.step()
    return s, base, ulog.take()


def test_a_parameter_edited_outside_the_optimizer_is_detected() -> None:
    _, base, logged = _logged_run(edit=True)
    layout, stream = _stream(logged)
    fresh = Small(seed=3)
    fresh.load(base)
    with pytest.raises(ReplayMismatch) as err:
        _replay_from(layout, stream, fresh.opt)
    assert err.value.tensors == ("param/3",)  # model[2].bias
    assert "param/3" in str(err.value)


def test_replay_onto_the_wrong_base_is_detected_before_it_steps() -> None:
    s, _, logged = _logged_run()
    layout, stream = _stream(logged)
    with pytest.raises(ReplayMismatch) as err:  # s is at the end of the log already
        _replay_from(layout, stream, s.opt)
    assert err.value.tensors == ("state/0/step",)


def test_replay_refuses_other_implementation_flags_and_changes_nothing() -> None:
    s, base, logged = _logged_run(foreach=False)
    layout, stream = _stream(logged)
    other = Small(seed=3)
    other.load(base)  # load_state_dict restores the saved flags: change one after it
    other.opt.param_groups[0]["foreach"] = True
    before = other.tensors()
    with pytest.raises(ReplayRefused) as err:
        _replay_from(layout, stream, other.opt)
    assert any("foreach" in d for d in err.value.differences)
    assert _same(other.tensors(), before)
    newer = dataclasses.replace(layout, replay=dataclasses.replace(layout.replay, torch="9.9.9"))
    with pytest.raises(ReplayRefused, match="torch version"):
        _replay_from(newer, stream, s.opt)


def test_fused_adamw_with_a_scaler_replays_exactly() -> None:
    """A fused optimizer unscales inside its kernel: the log carries grad_scale/found_inf."""
    s = Small(fused=True)
    s.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6, growth_interval=1)
    ulog = UpdateLog()
    ulog.attach(s.opt, s.scaler)
    s.step()
    base = s.base()
    ulog.reset()
    for i in range(4):
        s.step(inf=i == 1)
    logged = ulog.take()
    assert all(set(st.attrs) == {"grad_scale", "found_inf"} for st in logged.steps)
    layout, stream = _stream(logged)
    fresh = Small(seed=3, fused=True)
    fresh.load(base)
    report = _replay_from(layout, stream, fresh.opt)
    assert report.steps == 4 and report.verified == len(logged.fingerprints)
    assert _same(fresh.tensors(), s.tensors())


def test_mirrors_are_recomputed_and_verified() -> None:
    """bf16 weights kept as copies of fp32 master weights: not stored, replayed, checked."""
    s = Small()
    copies = [p.detach().to(torch.bfloat16) for p in s.model.parameters()]
    pairs = list(zip(s.model.parameters(), copies))
    ulog = UpdateLog()
    ulog.attach(s.opt, mirrors=pairs)
    s.step()
    base, base_copies = s.base(), [c.clone() for c in copies]
    ulog.reset()
    for _ in range(2):
        s.step()
        for master, c in pairs:
            c.copy_(master.detach())
    copies[1].add_(1)  # a mirror that is not its master's cast
    logged = ulog.take()
    assert logged.mirrors == tuple((i, "bfloat16") for i in range(4))
    layout, stream = _stream(logged)
    fresh = Small(seed=3)
    fresh.load(base)
    fresh_pairs = list(zip(fresh.model.parameters(), [c.clone() for c in base_copies]))
    with pytest.raises(ReplayMismatch) as err:
        _replay_from(layout, stream, fresh.opt, mirrors=fresh_pairs)
    assert err.value.tensors == ("mirror/1",)
    with pytest.raises(ReplayRefused, match="mirrors"):
        _replay_from(layout, stream, fresh.opt)


def test_gradients_of_exact_bf16_values_are_logged_as_bf16_and_replay_bit_for_bit() -> None:
    """SPEC.md 12.3: a float32 gradient whose elements are all exact bf16 values is stored as
    their high halves (half the bytes) and widened for the replay; any other one as it is."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5000)) for _ in range(3)]
    opt = torch.optim.AdamW(params, lr=1e-2)
    ulog = UpdateLog()
    ulog.attach(opt)
    base = [p.detach().clone() for p in params]
    ulog.reset()
    exact = torch.randn(5000).to(torch.bfloat16).float()
    specials = [-0.0, float("inf"), float("-inf"), 1e-40, 3.0e38]
    exact[: len(specials)] = torch.tensor(specials).to(torch.bfloat16).float()
    exact[10] = torch.tensor(0x7FC1_0000, dtype=torch.int32).view(torch.float32)  # NaN payload
    late = exact.clone()
    late[-1] = torch.tensor(0x3F80_0001, dtype=torch.int32).view(torch.float32)  # low bit set
    for grads in ([exact, late, torch.randn(5000)], [late, exact, exact]):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    logged = ulog.take()
    dtypes = [[g.dtype for g in step.grads if g is not None] for step in logged.steps]
    assert dtypes == [["bfloat16", "float32", "float32"], ["float32", "bfloat16", "bfloat16"]]
    assert [g.nbytes for g in logged.steps[0].grads if g is not None] == [10000, 20000, 20000]
    saved = [p.detach().clone() for p in params]
    layout, stream = _stream(logged)
    fresh = [nn.Parameter(b.clone()) for b in base]
    fresh_opt = torch.optim.AdamW(fresh, lr=1e-2)
    report = _replay_from(layout, stream, fresh_opt)  # verifies every fingerprint
    assert report.steps == 2 and report.verified > 0
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(fresh, saved))


# --- the capture ring -------------------------------------------------------------------


def test_the_ring_reuses_its_buffers_and_honours_leases() -> None:
    s = Small()
    ulog = UpdateLog()
    ulog.attach(s.opt)
    assert ulog.status is not None and "no full version" in ulog.status
    with pytest.raises(StateError):
        ulog.take()
    s.step()
    ulog.reset()
    s.step()
    s.step()
    held = ulog.held_bytes
    first = ulog.take()
    kept = bytes(first.steps[0].data)
    ulog.reset()  # a full version; `first` is still being written
    for _ in range(2):
        s.step()
    assert bytes(first.steps[0].data) == kept  # leased buffers are not reused
    ulog.release(first)
    for _ in range(6):  # from now on at most 2 steps are live: the ring stops growing
        ulog.reset()
        s.step()
        s.step()
        ulog.release(ulog.take(fingerprint=False))
    assert ulog.held_bytes <= held * 2
    assert ulog.steps_since_reset == 2
    assert ulog.bytes_since_reset == sum(st.nbytes for st in ulog.take().steps)


def test_the_ring_budget_makes_the_log_unusable_until_a_full_version() -> None:
    s = Small()
    grad_bytes = sum(p.numel() * 4 for p in s.model.parameters())
    ulog = UpdateLog(max_bytes=(1 << 16) * 2)  # two buffers of the ring's granule
    ulog.attach(s.opt)
    s.step()
    ulog.reset()
    for _ in range(3):
        s.step()
    assert grad_bytes < 1 << 16 and ulog.status is not None and "max_bytes" in ulog.status
    ulog.reset()
    s.step()
    assert ulog.status is None and ulog.steps_since_reset == 1


def test_a_closure_or_a_failed_step_make_the_log_unusable() -> None:
    s = Small()
    ulog = UpdateLog()
    ulog.attach(s.opt)
    ulog.reset()

    def closure() -> float:
        return 0.0

    s.opt.step(closure)
    assert ulog.status is not None and "closure" in ulog.status
    ulog.reset()

    def boom(*_: Any) -> None:
        raise RuntimeError("the step fails after the log's pre-hook ran")

    failing = s.opt.register_step_pre_hook(boom)
    with pytest.raises(RuntimeError):
        s.step()
    failing.remove()
    assert ulog.status is not None and "not finished" in ulog.status
    s.step()
    assert ulog.status is not None and "raised" in ulog.status
    ulog.detach()
    assert ulog.optimizer is None and not s.opt._optimizer_step_pre_hooks


def test_repeated_and_replicated_steps_are_the_same_chunks() -> None:
    """A step's chunks do not depend on what precedes it (SPEC.md section 12.3): a later
    log version repeats them, and a data-parallel replica with the same gradients too."""
    a, b = Small(), Small()
    logs = [UpdateLog(), UpdateLog()]
    for s, ulog in zip((a, b), logs):
        ulog.attach(s.opt)
        ulog.reset()
    a.step()
    first = _chunk_ids(logs[0].take(fingerprint=False))
    a.step()
    b.step()
    b.step()
    second = _chunk_ids(logs[0].take(fingerprint=False))
    replica = _chunk_ids(logs[1].take(fingerprint=False))
    assert second[: len(first)] == first
    assert replica == second


def _chunk_ids(logged: LoggedSteps) -> list[str]:
    layout, stream = _stream(logged, chunk_size=512)
    return [chunk_id(stream[o : o + n]) for o, n in layout.windows]


# --- fingerprints -----------------------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


@settings(max_examples=30, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=300),
    start=st.integers(0, 3),
    bit=st.integers(0, 10_000),
    algo=st.sampled_from(["blake3", "wsum64"]),
)
def test_every_single_bit_flip_changes_the_fingerprint(
    data: bytes, start: int, bit: int, algo: str
) -> None:
    """Also for views that do not start on a 4-byte boundary (wsum64 then copies)."""
    raw = torch.frombuffer(bytearray(bytes(start) + data), dtype=torch.uint8)[start:]
    before = fingerprint(raw, algo)
    if algo == "wsum64":
        assert before.digest == wsum64_reference(data)
    flipped = raw.clone()
    flipped[(bit // 8) % len(data)] ^= 1 << (bit % 8)
    assert fingerprint(flipped, algo) != before


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fingerprints_of_any_dtype_are_those_of_its_bytes(dtype: torch.dtype) -> None:
    t = (torch.arange(37, dtype=torch.float32) * 0.37).to(dtype)
    raw = (
        bytes(t.view(-1).view(torch.uint8).numpy())
        if dtype != torch.bool
        else bytes(t.numpy().view("u1"))
    )
    fps = fingerprints({"a": t, "b": t}, {"b": "wsum64"})
    assert fps["b"] == Fingerprint("wsum64", wsum64_reference(raw))
    assert fps["a"].algo == "blake3" and len(fps["a"].digest) == 16
    assert fingerprint(7.0) == Fingerprint("value", fingerprint(7.0).digest)
    assert fingerprint(7.0) != fingerprint(8.0)


# --- the format's log map ---------------------------------------------------------------

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "int64": 8}


@st.composite
def _small(draw: st.DrawFn) -> SmallTensor:
    """An inline tensor whose data is as long as its dtype and shape say (SPEC.md 12.2)."""
    dtype = draw(st.sampled_from(sorted(_ITEMSIZE)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=2)))
    n = _ITEMSIZE[dtype] * math.prod(shape)
    return SmallTensor(dtype, shape, draw(st.binary(min_size=n, max_size=n)))


_opts = st.builds(
    GroupOptions,
    packed=st.binary(max_size=32),
    tensors=st.lists(st.tuples(st.integers(0, 3), st.text(max_size=5), _small()), max_size=2).map(
        tuple
    ),
)
_scalar_map = st.dictionaries(st.text(max_size=6), st.integers(-5, 5) | st.floats(0, 4), max_size=3)


@st.composite
def _replay_logs(draw: st.DrawFn) -> tuple[ReplayLog, int]:
    nparams = draw(st.integers(1, 4))
    nentries = draw(st.integers(1, 6))
    steps = []
    for index in range(draw(st.integers(0, 3))):
        skipped = draw(st.booleans())
        grads = (
            ()
            if skipped
            else tuple(draw(st.none() | st.integers(0, nentries - 1)) for _ in range(nparams))
        )
        steps.append(
            LogStep(
                index=index,
                skipped=skipped,
                grads=grads,
                options=None if skipped else draw(_opts),
                attrs=draw(st.dictionaries(st.sampled_from(["grad_scale", "found_inf"]), _small())),
                counter=draw(st.none() | st.floats(0, 1e6)),
                scaler=draw(st.none() | _scalar_map),
            )
        )
    log = ReplayLog(
        optimizer=draw(st.text(max_size=20)),
        torch=draw(st.text(max_size=10)),
        device=draw(st.sampled_from(["cpu", "cuda", "cpu,cuda"])),
        flags=({"foreach": draw(st.none() | st.booleans()), "fused": None},) * 2,
        params=tuple(
            ParamSpec(draw(st.integers(0, 1)), "float32", (draw(st.integers(0, 9)),))
            for _ in range(nparams)
        ),
        mirrors=tuple(
            draw(st.lists(st.tuples(st.integers(0, nparams - 1), st.just("bfloat16")), max_size=2))
        ),
        steps=tuple(steps),
        options=draw(_opts),
        fingerprints=draw(
            st.dictionaries(
                st.text(max_size=12),
                st.builds(
                    Fingerprint, st.sampled_from(["blake3", "wsum64"]), st.binary(max_size=16)
                ),
                max_size=4,
            )
        ),
        scaler=draw(st.none() | _scalar_map),
    )
    return log, nentries


@settings(max_examples=25, deadline=None)
@given(case=_replay_logs())
def test_replay_log_round_trips(case: tuple[ReplayLog, int]) -> None:
    from tiercheck.formats.manifest import Entry

    log, nentries = case
    entries = tuple(
        Entry(f"/log/0/{i}", "tensor", "float32", (1,), 64 * i, 4) for i in range(nentries)
    )
    m = ShardManifest(1, 0, 1, 64, 64 * nentries, entries, (), None, log=log)
    assert unpack_manifest(pack_manifest(m)) == m


def test_malformed_log_maps_are_corrupt() -> None:
    _, _, logged = _logged_run()
    layout, _ = _stream(logged)
    good = ShardManifest(1, 0, 1, 256, layout.end, layout.entries, (), None, log=layout.replay)
    assert unpack_manifest(pack_manifest(good)) == good
    step = layout.replay.steps[0]
    bad_steps = [
        dataclasses.replace(step, grads=step.grads[:-1]),  # one gradient per parameter
        dataclasses.replace(step, grads=(len(layout.entries), *step.grads[1:])),
        dataclasses.replace(step, skipped=True),  # skipped, yet options and gradients
    ]
    for bad in bad_steps:
        log = dataclasses.replace(layout.replay, steps=(bad,))
        with pytest.raises(BlobCorrupt):
            unpack_manifest(pack_manifest(dataclasses.replace(good, log=log)))


def test_replayed_leaves_are_found_by_storage() -> None:
    """What a log version leaves out of a flattened state: parameters and optimizer state."""
    from tiercheck.core.entries import flatten
    from tiercheck.logversions.update_log import replayed_leaves, replayed_tensors

    s = Small()
    s.step()
    extra = torch.ones(3)
    _, leaves = flatten({"model": s.model, "optim": s.opt, "other": extra, "n": 3})
    found = replayed_leaves(leaves, replayed_tensors(s.opt))
    tensor_keys = {leaf.key for leaf in leaves if leaf.kind == "tensor"}
    assert set(found) == tensor_keys - {"other"}
    assert found["model/0.weight"] == "param/0"
    assert found["optim/state/3/exp_avg_sq"] == "state/3/exp_avg_sq"


def test_a_log_version_is_restorable_where_its_base_is() -> None:
    """SPEC.md section 12.1: a log version needs its base (a base or a diff) like a diff."""
    from tiercheck.formats.manifest import VersionInfo
    from tiercheck.store.catalog import Catalog, TierLog

    def info(vid: int, role: Any, base: int | None) -> VersionInfo:
        return VersionInfo(vid, vid, role, base, 1, (chunk_id(b"x"),), 0.0, 0)

    tl = TierLog("shm")
    tl.committed = {
        1: info(1, "base", None),
        2: info(2, "log", 1),
        3: info(3, "diff", 1),
        4: info(4, "log", 3),
        5: info(5, "log", 9),  # its base is not held anywhere
    }
    assert Catalog({"shm": tl}, {}).restorable_versions() == [1, 2, 3, 4]
    tl.committed.pop(1)  # without the base, neither its diff nor the logs restore
    assert Catalog({"shm": tl}, {}).restorable_versions() == []
