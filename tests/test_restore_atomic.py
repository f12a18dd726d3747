"""A restore that fails leaves the caller's state exactly as it was (issue 21, item 4).

Each test restores into a state that cannot take the saved version, for a reason found
only after some of the state has been written (a module, an optimizer, a scheduler or a
user object whose ``load_state_dict`` raises; a leaf that cannot be decoded; a log
version whose replay fails), and checks that every tensor, every object's
``state_dict()`` and every container of the state are bit-identical to what they were
before, and that the error is typed and names what failed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tiercheck
from tiercheck.core.entries import is_stateful
from tiercheck.errors import StateError, UnsupportedValue


def image(value: Any, path: str = "", *, ids: bool = True) -> dict[str, Any]:
    """What ``value`` holds, by path, as plain data that compares equal only if nothing
    changed: every tensor's dtype, shape and bytes, every stateful object's
    ``state_dict()``, every container's type and keys in order, and (``ids``) which
    objects the caller's containers hold."""
    who = id(value) if ids else None
    out: dict[str, Any] = {}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        out[path] = ("tensor", who, str(t.dtype), tuple(t.shape), raw)
    elif isinstance(value, np.ndarray):
        out[path] = ("ndarray", who, value.dtype.str, value.shape, value.tobytes())
    elif isinstance(value, Mapping):
        out[path] = (type(value).__name__, who, list(value))
        for k, v in value.items():
            out.update(image(v, f"{path}/{k}", ids=ids))
    elif isinstance(value, (list, tuple)):
        out[path] = (type(value).__name__, who, len(value))
        for i, v in enumerate(value):
            out.update(image(v, f"{path}/{i}", ids=ids))
    elif is_stateful(value):
        # a state_dict's tensors are fresh views (a module's): compare their bytes only
        out[path] = ("object", who, type(value).__qualname__)
        out.update(image(value.state_dict(), f"{path}.state_dict()", ids=False))
    else:
        out[path] = ("value", repr(value))
    return out


@pytest.fixture
def ckpt(memory_ckpt: tiercheck.Checkpointer) -> tiercheck.Checkpointer:
    """A store of one in-process memory tier (these tests are not about tiers)."""
    return memory_ckpt


def train(model: nn.Linear, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, model.in_features)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def failed_restore(ckpt: tiercheck.Checkpointer, target: dict[str, Any]) -> BaseException:
    """Restore into ``target``, which must fail; assert ``target`` is as it was; return
    the error (the state is checked first: on a failure it says what was overwritten)."""
    before = image(target)
    with pytest.raises(Exception) as caught:
        ckpt.restore(target)
    after = image(target)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"changed by the failed restore: {changed}"
    return caught.value


# --- nn.Module ---------------------------------------------------------------------------


def test_a_module_whose_last_layer_does_not_fit_leaves_every_module_as_it_was(
    ckpt: tiercheck.Checkpointer,
) -> None:
    """``load_state_dict`` of a module copies the layers that fit before it raises for the
    one that does not; the encoder before it was loaded whole."""
    torch.manual_seed(0)
    saved = {
        "encoder": nn.Linear(16, 16),
        "model": nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)),
        "step": 7,
    }
    ckpt.save(7, saved).wait()
    torch.manual_seed(1)
    target = {
        "encoder": nn.Linear(16, 16),
        "model": nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)),
        "step": 0,
    }
    error = failed_restore(ckpt, target)
    assert isinstance(error, StateError), error
    assert error.key == "model" and "size mismatch" in str(error)


# --- optimizer -------------------------------------------------------------------------


def test_an_optimizer_with_other_param_groups_leaves_model_and_optimizer_as_they_were(
    tmp_path: Path,
) -> None:
    """The reported case: model + optimizer restored into an optimizer with two param
    groups where one was saved. The default store (shm, LMDB, file)."""
    ckpt = tiercheck.Checkpointer(tmp_path / "store")
    try:
        torch.manual_seed(0)
        model = nn.Linear(32, 8)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train(model, opt, 2)
        ckpt.save(2, {"model": model, "optim": opt}).wait()

        torch.manual_seed(1)
        model2 = nn.Linear(32, 8)
        opt2 = torch.optim.AdamW(
            [{"params": [model2.weight]}, {"params": [model2.bias], "weight_decay": 0.0}],
            lr=1e-3,
        )
        train(model2, opt2, 1)  # its moments are there to be overwritten in place
        error = failed_restore(ckpt, {"model": model2, "optim": opt2})
        assert isinstance(error, StateError), error
        assert error.key == "optim" and "parameter groups" in str(error)
    finally:
        ckpt.destroy()


# --- LR scheduler ----------------------------------------------------------------------


def test_a_scheduler_whose_load_state_dict_raises_undoes_the_model_and_optimizer(
    ckpt: tiercheck.Checkpointer,
) -> None:
    """Model and optimizer load (their tensors in place, the optimizer's param groups
    replaced), then the scheduler refuses: a StepLR was saved, the state has a LambdaLR,
    whose ``load_state_dict`` raises ``KeyError('lr_lambdas')``."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        train(model, opt, 1)
        sched.step()
    ckpt.save(3, {"model": model, "optim": opt, "sched": sched}).wait()

    torch.manual_seed(1)
    model2 = nn.Linear(16, 16)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=3e-4)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda step: 1.0 / (step + 1))
    train(model2, opt2, 1)
    sched2.step()
    error = failed_restore(ckpt, {"model": model2, "optim": opt2, "sched": sched2})
    assert isinstance(error, StateError), error
    assert error.key == "sched" and "lr_lambdas" in str(error)


# --- a user object -----------------------------------------------------------------------


class Loader:
    """A data loader's position: ``load_state_dict`` sets the position, then refuses a
    state saved with another shuffling seed (it has already changed itself by then)."""

    def __init__(self, seed: int, position: int = 0) -> None:
        self.seed = seed
        self.position = position

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.position = sd["position"]
        if sd["seed"] != self.seed:
            raise ValueError(f"saved with seed {sd['seed']}, this loader shuffles with {self.seed}")


def test_a_user_object_whose_load_state_dict_raises_half_way_is_put_back(
    ckpt: tiercheck.Checkpointer,
) -> None:
    torch.manual_seed(0)
    ckpt.save(1, {"model": nn.Linear(16, 16), "loader": Loader(seed=0, position=40)}).wait()
    torch.manual_seed(1)
    loader = Loader(seed=1, position=3)
    error = failed_restore(ckpt, {"model": nn.Linear(16, 16), "loader": loader})
    assert loader.position == 3
    assert isinstance(error, StateError), error
    assert error.key == "loader" and "seed" in str(error)


# --- plain tensors and dict leaves -------------------------------------------------------


class Note:
    """A leaf only pickle can store."""

    def __init__(self, text: str) -> None:
        self.text = text


def test_plain_tensors_and_dict_leaves_are_put_back_when_a_later_leaf_cannot_be_loaded(
    tmp_path: Path,
) -> None:
    """Tensors and an array are written in place and dict and list members replaced
    before a leaf stored with pickle is met by a store opened without ``allow_pickle``.
    The default store, closed and opened again."""
    root = tmp_path / "store"
    ckpt = tiercheck.Checkpointer(root, allow_pickle=True)
    try:
        saved = {
            "w": torch.randn(4096),
            "arr": np.arange(64, dtype=np.float64),
            "hist": [1, 2, 3],
            "cfg": {"lr": 0.1, "name": "saved", "sizes": [1, 2]},
            "note": Note("pickled"),
        }
        ckpt.save(1, saved).wait()
        ckpt.close()
        ckpt = tiercheck.Checkpointer(root)
        target = {
            "w": torch.zeros(4096),
            "arr": np.zeros(64, dtype=np.float64),
            "hist": [0, 0, 0],
            "cfg": {"lr": 0.5, "name": "mine", "sizes": [3, 4]},
            "note": None,
        }
        error = failed_restore(ckpt, target)
        assert isinstance(error, UnsupportedValue), error
        assert error.key == "note" and "allow_pickle" in str(error)
    finally:
        ckpt.destroy()


def test_plain_tensors_beside_a_module_that_does_not_fit_are_never_written(
    ckpt: tiercheck.Checkpointer,
) -> None:
    """A restore keeps no copy of tensors outside stateful objects: it writes them last,
    once every ``load_state_dict`` and leaf has succeeded. Here the module fails, so the
    plain tensors (before and after it in the tree), the array and the shared view of
    the module's weight are as they were."""
    torch.manual_seed(0)
    saved_model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
    saved = {
        "a": torch.randn(1 << 18),
        "model": saved_model,
        "z": torch.randn(3, 5).double(),
        "arr": np.arange(100, dtype=np.float32),
        "w0": saved_model[0].weight.detach(),
    }
    ckpt.save(1, saved).wait()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    target = {
        "a": torch.zeros(1 << 18),
        "model": model,
        "z": torch.zeros(3, 5).double(),
        "arr": np.zeros(100, dtype=np.float32),
        "w0": model[0].weight.detach(),
    }
    error = failed_restore(ckpt, target)
    assert isinstance(error, StateError) and error.key == "model", error


def test_a_plain_state_is_restored_exactly_in_place(
    ckpt: tiercheck.Checkpointer,
) -> None:
    """Tensors outside stateful objects (written last, with no undo copy) get the saved
    bytes in their own storage."""
    torch.manual_seed(0)
    saved = {"a": torch.randn(1 << 18), "b": torch.randn(7, 9).half(), "step": 3}
    ckpt.save(3, saved).wait()
    target = {"a": torch.zeros(1 << 18), "b": torch.zeros(7, 9).half(), "step": 0}
    where = {k: v.data_ptr() for k, v in target.items() if isinstance(v, torch.Tensor)}
    ckpt.restore(target)
    assert torch.equal(target["a"], saved["a"]) and torch.equal(target["b"], saved["b"])
    assert target["step"] == 3
    assert {k: v.data_ptr() for k, v in target.items() if isinstance(v, torch.Tensor)} == where


# --- what the saved version holds against what the state holds -----------------------------


@pytest.mark.parametrize(
    ("saved", "held", "says"),
    [
        (torch.ones(2), nn.Linear(2, 2), "saved a tensor float32 (2,), the state has Linear"),
        (torch.ones(2), {"a": 1}, "saved a tensor float32 (2,), the state has dict"),
        (torch.ones(2), [1, 2], "saved a tensor float32 (2,), the state has list"),
        (torch.ones(2), 7, "saved a tensor float32 (2,), the state has int"),
        (np.ones(2), "text", "saved a ndarray <f8 (2,), the state has str"),
        (7, torch.zeros(1), "saved a Python value (msgpack), the state has Tensor"),
        (7, nn.Linear(2, 2), "saved a Python value (msgpack), the state has Linear"),
        (7, {"a": 1}, "saved a value of type int, the state has dict"),
        ({"a": 1}, [1], "saved a value of type dict, the state has list"),
    ],
    ids=["tensor/module", "tensor/dict", "tensor/list", "tensor/int", "array/str",
         "int/tensor", "int/module", "int/dict", "dict/list"],
)  # fmt: skip
def test_a_saved_value_of_another_kind_than_the_states_is_refused(
    ckpt: tiercheck.Checkpointer, saved: Any, held: Any, says: str
) -> None:
    """Where the state holds something of another kind than the version saved there (a
    module, a container or a Python value where a tensor was saved, or the reverse), the
    restore raises ``StateError`` naming the key and leaves the state as it was. Before,
    only a tensor against a tensor (or array) of another shape or dtype was refused; the
    rest had its place in the caller's dict silently given the saved value."""
    torch.manual_seed(0)
    ckpt.save(1, {"w": torch.randn(64), "x": saved}).wait()
    error = failed_restore(ckpt, {"w": torch.zeros(64), "x": held})
    assert isinstance(error, StateError) and error.key == "x", error
    assert says in str(error)


def test_python_values_are_restored_into_the_states_own_dicts_and_lists(
    ckpt: tiercheck.Checkpointer,
) -> None:
    """A dict or list of Python values (no tensor: stored as one value) is restored into
    the dict or list the state holds there, nested ones too, as a dict of tensors is: the
    caller's objects keep their identity and get the saved members; with ``strict`` (the
    default) keys that differ raise ``StateError`` naming one and leave the state as it
    was, ``strict=False`` adds the saved keys and leaves the others. A state of no tensor
    at all is restored into the caller's dict. Before, the caller's dicts were replaced in
    their parent (or, at the top, left untouched: the values only in ``info.state``) and
    their keys never checked."""
    loader = {"epoch": 3, "pos": 17, "sampler": {"seed": 5, "order": [3, 1, 2]}}
    ckpt.save(1, {"w": torch.ones(8), "loader": loader}).wait()
    order: list[int] = []
    sampler = {"seed": 0, "order": order}
    mine = {"epoch": 0, "pos": 0, "sampler": sampler}
    state = {"w": torch.zeros(8), "loader": mine}
    ckpt.restore(state)
    assert state["loader"] is mine and mine["sampler"] is sampler and sampler["order"] is order
    assert mine == loader and torch.equal(state["w"], torch.ones(8))

    short = {"epoch": 0}
    error = failed_restore(ckpt, {"w": torch.zeros(8), "loader": short})
    assert isinstance(error, StateError) and error.key == "loader/pos", error
    error = failed_restore(ckpt, {"w": torch.zeros(8), "loader": {**loader, "extra": 1}})
    assert isinstance(error, StateError) and error.key == "loader/extra", error
    ckpt.restore(state := {"w": torch.zeros(8), "loader": {"epoch": 0, "mine": 1}}, strict=False)
    assert state["loader"] == {**loader, "mine": 1}

    ckpt.save(2, {"epoch": 4, "hist": [1, 2]}).wait()
    hist: list[int] = []
    top = {"epoch": 0, "hist": hist}
    info = ckpt.restore(top)
    assert info.step == 2 and top == {"epoch": 4, "hist": [1, 2]} and top["hist"] is hist
    assert info.state is top


# --- a log version whose replay fails ------------------------------------------------------


@pytest.mark.parametrize("where", ["replay", "after the replay"])
def test_a_log_version_whose_restore_fails_leaves_the_state_as_it_was(
    ckpt: tiercheck.Checkpointer, where: str
) -> None:
    """A guarded restore of a log version loads the base, replays the logged steps into the
    optimizer, then loads the version's own leaves. ``replay``: ``optimizer.step()`` raises
    during the replay (a step hook of the training script here; out of memory, say).
    ``after the replay``: the loader, loaded after the replay, refuses its saved state.
    Either way the base is loaded and steps replayed before the failure."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = Loader(seed=0)
    ckpt.guard(opt)
    roles = []
    for step in range(1, 4):
        train(model, opt, 1)
        loader.position = step
        state = {"model": model, "optim": opt, "loader": loader}
        roles.append(ckpt.save(step, state).result().role)
    assert roles == ["base", "log", "log"]

    train(model, opt, 2)  # the state moves on from the saved one, then is restored
    model(torch.randn(4, 16)).square().mean().backward()  # gradients pending, too
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert len(grads) == 2

    def out_of_memory(*_: Any) -> None:
        raise RuntimeError("out of memory in optimizer.step()")

    if where == "replay":
        hook = opt.register_step_pre_hook(out_of_memory)
    else:
        loader.seed = 1
    error = failed_restore(ckpt, {"model": model, "optim": opt, "loader": loader})
    after = [p.grad for p in model.parameters()]
    assert all(a is not None and torch.equal(a, g) for a, g in zip(after, grads))
    assert isinstance(error, StateError), error
    if where == "replay":
        assert "replay" in str(error) and "out of memory" in str(error)
        hook.remove()
    else:
        assert error.key == "loader" and "seed" in str(error)
        loader.seed = 0
    # the cause gone, the same restore replays the log version as usual
    info = ckpt.restore({"model": model, "optim": opt, "loader": loader})
    assert (info.role, info.replayed_steps, info.fallback) == ("log", 2, None)
    assert loader.position == 3


# --- what cannot be put back is said ------------------------------------------------------


class LoadCounter:
    """Counts the loads it was given (in its own state) and refuses another run's state:
    no ``load_state_dict`` can give it back the state it had."""

    def __init__(self, run: int) -> None:
        self.run = run
        self.loads = 0

    def state_dict(self) -> dict[str, Any]:
        return {"run": self.run, "loads": self.loads}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.loads += 1
        if sd["run"] != self.run:
            raise ValueError(f"state of run {sd['run']}, this is run {self.run}")


def test_an_object_that_cannot_be_put_back_is_named_and_the_rest_is_put_back(
    ckpt: tiercheck.Checkpointer,
) -> None:
    torch.manual_seed(0)
    ckpt.save(1, {"model": nn.Linear(16, 16), "counter": LoadCounter(run=1)}).wait()
    model = nn.Linear(16, 16)
    before = image(model)
    counter = LoadCounter(run=2)
    with pytest.raises(StateError, match="partly restored") as caught:
        ckpt.restore({"model": model, "counter": counter})
    assert caught.value.key == "counter" and "counter: StateError" in str(caught.value)
    assert image(model) == before
