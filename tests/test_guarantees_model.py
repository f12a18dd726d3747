"""A model-based test of "nothing acknowledged is lost" (docs/concepts.md, "Guarantees").

A Hypothesis state machine drives the default store (shm in /dev/shm, LMDB, a ``file://``
remote, default memory budgets) through saves of random sizes, changes and roles, GC,
migrations left running or waited for, crashes at the points where versions are dropped
or committed, and reopenings, against a reference model: every step of every save it made
and the newest one ``wait()`` acknowledged. After every step, the store restores the newest
acknowledged version (or a newer one it saved) bit for bit.

A crash is simulated in process: an exception at a named point of the engine (right after
making room in a tier, after a retention drop, inside a GC sweep, before a commit record is
appended), then the store is abandoned (``close(abandon=True)``) and opened again. The
SIGKILL tests (tests/test_crash_engine.py, tests/test_guarantees.py) kill real processes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from _models import snapshot_of
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import tiercheck.engine.saving as saving_mod
import tiercheck.upkeep.maintenance as maintenance_mod
from tiercheck import Checkpointer
from tiercheck.errors import TiercheckError


class SimulatedCrash(TiercheckError):
    """Raised at a named point to stop the engine there, as a crash would."""


#: name -> (module, attribute) of the function the crash interrupts (after it ran)
POINTS: dict[str, tuple[Any, str]] = {
    "make_room": (maintenance_mod.Maintenance, "_make_room"),
    "retention_drop": (maintenance_mod, "drop_versions"),
    "gc_sweep": (maintenance_mod, "collect_garbage"),
    "commit": (saving_mod, "commit_on"),
}


@contextmanager
def crash_after(point: str) -> Iterator[None]:
    """Raise :class:`SimulatedCrash` right after the first call of ``point`` returns."""
    owner, name = POINTS[point]
    original: Callable[..., Any] = getattr(owner, name)
    fired: list[bool] = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if not fired:
            fired.append(True)
            raise SimulatedCrash(f"simulated crash after {point}")
        return out

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


class _Machine(RuleBasedStateMachine):
    """What both machines share: a store in a directory of its own that crashes and is
    opened again, GC, and the reference model (every step saved, the newest acknowledged)."""

    ckpt: Checkpointer

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.step = 0
        self.saved: dict[int, dict[str, torch.Tensor]] = {}
        self.acked: int | None = None

    def _reopen(self) -> None:
        raise NotImplementedError

    def _destroy(self) -> None:
        try:
            self.ckpt.destroy()
        except TiercheckError:
            from tiercheck.store.lifecycle import destroy_store

            destroy_store(self.dir / "store")
        shutil.rmtree(self.dir, ignore_errors=True)

    def _save_and_crash_after(self, point: str, save: Callable[[], None]) -> None:
        """``save``, stopped by a crash right after ``point``, then a restart."""
        with crash_after(point):
            try:
                save()
            except TiercheckError:
                pass  # not acknowledged: the model keeps the previous ack
            self.ckpt.flush()  # let maintenance reach its crash point, if it is there
        self._reopen()

    @rule()
    def crash(self) -> None:
        self._reopen()

    @rule()
    def gc(self) -> None:
        self.ckpt.gc()


class Store(_Machine):
    def __init__(self) -> None:
        super().__init__("tc-model-")
        self.ckpt = Checkpointer(self.dir / "store")
        self.state = {"a": torch.zeros(64 * 1024), "b": torch.zeros(16 * 1024)}

    def teardown(self) -> None:
        self._destroy()

    # --- the trainer ------------------------------------------------------------------

    def _next_state(self, change: str, scale: int) -> None:
        g = torch.Generator().manual_seed(self.step)
        if scale != self.state["a"].numel():
            self.state["a"] = torch.randn(scale, generator=g)
        elif change == "dense":
            self.state["a"] = torch.randn(scale, generator=g)
            self.state["b"] = torch.randn(self.state["b"].numel(), generator=g)
        elif change == "sparse":
            self.state["a"] = self.state["a"].clone()
            self.state["a"][: scale // 16] += 1.0
        self.saved[self.step] = {k: v.clone() for k, v in self.state.items()}

    def _save(self, role: str | None) -> None:
        handle = self.ckpt.save(self.step, self.state, role=role)
        handle.wait()
        self.acked = self.step

    @rule(
        change=st.sampled_from(["dense", "sparse", "none"]),
        scale=st.sampled_from([64 * 1024, 256 * 1024, 512 * 1024]),
        role=st.sampled_from([None, None, "base", "diff"]),
    )
    def save(self, change: str, scale: int, role: str | None) -> None:
        self.step += 1
        self._next_state(change, scale)
        self._save(role)

    @rule(
        point=st.sampled_from(sorted(POINTS)),
        change=st.sampled_from(["dense", "sparse"]),
        role=st.sampled_from([None, "diff"]),
    )
    def save_then_crash(self, point: str, change: str, role: str | None) -> None:
        self.step += 1
        self._next_state(change, self.state["a"].numel())
        self._save_and_crash_after(point, lambda: self._save(role))

    @rule()
    def wait_migrations(self) -> None:
        self.ckpt.wait_migrations(timeout=60)

    def _reopen(self) -> None:
        self.ckpt.close(abandon=True)
        self.ckpt = Checkpointer(self.dir / "store")

    # --- what must hold after every step ------------------------------------------------

    @precondition(lambda self: self.acked is not None)
    @invariant()
    def newest_acknowledged_version_restores_exactly(self) -> None:
        assert self.acked is not None
        target: dict[str, Any] = dict.fromkeys(self.state)  # placeholders: what was saved
        info = self.ckpt.restore(target)
        target = info.state
        assert info.step >= self.acked, f"acknowledged step {self.acked}, restored step {info.step}"
        expected = self.saved[info.step]
        for key, tensor in expected.items():
            assert torch.equal(target[key], tensor), f"step {info.step}: {key} differs"


TestNothingAcknowledgedIsLost = Store.TestCase
TestNothingAcknowledgedIsLost.pytestmark = [pytest.mark.slow]
TestNothingAcknowledgedIsLost.settings = settings(
    max_examples=int(os.environ.get("TIERCHECK_MODEL_EXAMPLES", "12")),
    stateful_step_count=14,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class Dense(torch.nn.Module):
    """Big enough (1.5 MiB of parameters and AdamW state) for shm's default budget to
    make room between bases."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))


def _trainer(seed: int) -> tuple[Dense, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = Dense()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


class GuardedStore(_Machine):
    """The same promise for a guarded optimizer: log versions between full ones, checked
    at every restart (each crash, and the end)."""

    def __init__(self) -> None:
        super().__init__("tc-model-log-")
        self.model, self.opt = _trainer(0)
        self.data = torch.Generator().manual_seed(1)
        self._open()

    def _open(self) -> None:
        self.ckpt = Checkpointer(self.dir / "store")
        self.ckpt.guard(self.opt)

    def _train(self, steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(8, 256, generator=self.data)
            self.opt.zero_grad()
            self.model.net(x).square().mean().backward()
            self.opt.step()
            self.step += 1
        self.saved[self.step] = snapshot_of(self.model, self.opt)

    def _save(self) -> None:
        self.ckpt.save(self.step, {"model": self.model, "optim": self.opt}).wait()
        self.acked = self.step

    @rule(steps=st.integers(1, 3))
    def train_and_save(self, steps: int) -> None:
        self._train(steps)
        self._save()

    @rule(point=st.sampled_from(sorted(POINTS)))
    def train_save_then_crash(self, point: str) -> None:
        self._train(1)
        self._save_and_crash_after(point, self._save)

    def _reopen(self) -> None:
        """A restart: a new process opens the store, guards a fresh optimizer, restores
        the newest version (replaying a log version) and trains on from it. (A read-only
        reader cannot replay log versions, so the check is made here, at every restart,
        rather than after every step.)"""
        self.ckpt.close(abandon=True)
        self.ckpt = Checkpointer(self.dir / "store")
        if self.acked is None:
            self.ckpt.guard(self.opt)
            return
        model, opt = _trainer(5)
        self.ckpt.guard(opt)
        info = self.ckpt.restore({"model": model, "optim": opt})
        assert info.step >= self.acked, (
            f"acknowledged step {self.acked}, restored step {info.step} ({info.fallback})"
        )
        got, expected = snapshot_of(model, opt), self.saved[info.step]
        assert got.keys() == expected.keys()
        for key, tensor in expected.items():
            assert torch.equal(got[key], tensor), f"step {info.step}: {key} differs"
        self.model, self.opt, self.step, self.acked = model, opt, info.step, info.step

    def teardown(self) -> None:
        try:
            self._reopen()  # the last check: a restart after the last step
        finally:
            self._destroy()


TestNothingAcknowledgedIsLostWithLogVersions = GuardedStore.TestCase
TestNothingAcknowledgedIsLostWithLogVersions.pytestmark = [pytest.mark.slow]
TestNothingAcknowledgedIsLostWithLogVersions.settings = settings(
    max_examples=int(os.environ.get("TIERCHECK_MODEL_EXAMPLES", "8")),
    stateful_step_count=14,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
