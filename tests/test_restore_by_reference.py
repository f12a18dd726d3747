"""A module or optimizer that loads by reference is restored with no copy of its bytes
(issue 32, item 2: "no full host snapshot of the state ... keep copies only of what can
still fail"): its ``load_state_dict`` runs with its own tensors, then their bytes are
written last, as the loose tensors' are. Where the load kept a copy after all (an
optimizer state tensor of another dtype than its parameter), the restore writes the bytes
first and loads it again, with a copy to put back; the result is what torch's own load
gives. A real memory tier and real torch objects.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import tiercheck
from tiercheck.errors import StateError
from tiercheck.restore import service
from tiercheck.restore import undo as undo_module
from tiercheck.restore.binding import loads_by_reference


@pytest.fixture
def ckpt(memory_ckpt: tiercheck.Checkpointer) -> tiercheck.Checkpointer:
    return memory_ckpt


def trained(seed: int, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1))
    for _ in range(steps):
        model(torch.randn(16, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


class _Hooked(nn.Linear):
    """A layer whose ``_load_from_state_dict`` reads the values it is given."""

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        self.seen = float(state_dict[prefix + "weight"].sum())
        super()._load_from_state_dict(state_dict, prefix, *args)


def test_which_objects_load_by_reference() -> None:
    """torch's own layers (norm layers included) and optimizers load by reference; a layer
    that overrides its loading, one with a load hook, an optimizer with a load hook and a
    scheduler do not."""
    model, opt = trained(0, steps=1)
    assert loads_by_reference(model) and loads_by_reference(opt)
    assert not loads_by_reference(nn.Sequential(nn.Linear(2, 2), _Hooked(2, 2)))
    hooked = nn.Linear(2, 2)
    hooked.register_load_state_dict_post_hook(lambda module, keys: None)
    assert not loads_by_reference(nn.Sequential(hooked))
    opt.register_load_state_dict_pre_hook(lambda optimizer, sd: None)
    assert not loads_by_reference(opt)
    assert not loads_by_reference(torch.optim.lr_scheduler.StepLR(trained(1)[1], 1))


def test_a_model_and_optimizer_are_restored_exactly_with_no_copy_of_their_bytes(
    ckpt: tiercheck.Checkpointer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every tensor of the model and the optimizer (state and param groups) is restored,
    in place, and no undo copy of any of them is made (before this, each restore copied
    the whole model and optimizer state to fresh host memory first)."""
    model, opt = trained(0)
    ckpt.save(2, {"model": model, "optim": opt}).wait()
    want_model, want_opt = model.state_dict(), opt.state_dict()
    model2, opt2 = trained(1)
    params = [p.data_ptr() for p in model2.parameters()]
    copies: list[Any] = []
    copy_of = undo_module._copy_of
    monkeypatch.setattr(undo_module, "_copy_of", lambda t: copies.append(t) or copy_of(t))
    ckpt.restore({"model": model2, "optim": opt2})
    assert copies == []
    assert same(model2.state_dict(), want_model)
    assert same(opt2.state_dict(), want_opt)
    assert [p.data_ptr() for p in model2.parameters()] == params  # in place


def test_an_optimizer_whose_load_converts_its_state_is_loaded_again_after_the_write(
    ckpt: tiercheck.Checkpointer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An AdamW whose moments are kept in bfloat16 beside float32 parameters: torch's
    ``load_state_dict`` converts them (a copy of the values it was given), so the restore
    writes the saved bytes first and loads it again. The optimizer ends exactly as torch's
    own load of the saved state leaves it."""

    def low_moments(opt: torch.optim.Optimizer) -> None:
        for state in opt.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                state[k] = state[k].to(torch.bfloat16)

    model, opt = trained(0)
    low_moments(opt)
    ckpt.save(2, {"model": model, "optim": opt}).wait()
    saved = {k: v for k, v in opt.state_dict().items()}
    reference = trained(2)[1]
    reference.load_state_dict(saved)  # torch's own load of the same state

    model2, opt2 = trained(1)
    low_moments(opt2)
    late: list[set[int]] = []
    copied_on_load = service.copied_on_load
    monkeypatch.setattr(
        service, "copied_on_load", lambda b: late.append(copied_on_load(b)) or late[-1]
    )
    ckpt.restore({"model": model2, "optim": opt2})
    assert [len(nodes) for nodes in late] == [1]  # the optimizer, not the model
    assert same(model2.state_dict(), model.state_dict())
    assert same(opt2.state_dict()["state"], reference.state_dict()["state"])
    assert opt2.state_dict()["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]


def test_a_failure_after_a_model_loaded_by_reference_leaves_it_as_it_was(
    ckpt: tiercheck.Checkpointer,
) -> None:
    """A model and optimizer load by reference (their bytes not written yet), then an
    object after them refuses its state: the model, the optimizer and its param groups
    are as they were, with no copy of their bytes having been made."""

    class Refuses:
        def state_dict(self) -> dict[str, Any]:
            return {"n": 1}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            raise ValueError("refused")

    model, opt = trained(0)
    ckpt.save(2, {"model": model, "optim": opt, "last": Refuses()}).wait()
    model2, opt2 = trained(1)
    before = (
        {k: v.clone() for k, v in model2.state_dict().items()},
        {
            k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in opt2.param_groups[0].items()
            if k != "params"
        },
        {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt2.state.values())},
    )
    with pytest.raises(StateError, match="refused"):
        ckpt.restore({"model": model2, "optim": opt2, "last": Refuses()})
    assert same(model2.state_dict(), before[0])
    group = {k: v for k, v in opt2.param_groups[0].items() if k != "params"}
    assert same(group, before[1])
    assert same({i: dict(s) for i, s in enumerate(opt2.state.values())}, before[2])
