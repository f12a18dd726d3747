"""More input a new user passed to the Python API and got silently accepted, or refused
with a message that did not say what to pass instead (see tests/test_api_mends.py): each
is refused before anything is written, with a typed error that says what is accepted."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tiercheck
from tiercheck.errors import StateError, UnsupportedValue


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4)


@pytest.fixture
def saved(memory_ckpt: tiercheck.Checkpointer) -> tiercheck.Checkpointer:
    memory_ckpt.save(1, {"model": _linear(), "t": torch.arange(4.0)}).wait()
    return memory_ckpt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_module_of_another_dtype_is_refused(
    saved: tiercheck.Checkpointer, dtype: torch.dtype
) -> None:
    """A bare tensor of another dtype was refused, a module's parameter was not: its
    ``load_state_dict`` cast the saved float32 weights (lossily, into bfloat16)."""
    model = torch.nn.Linear(4, 4).to(dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {"model": model, "t": torch.zeros(4)}
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(
        StateError,
        match=rf"^model/weight: saved tensor float32 \(4, 4\) does not match the state's "
        rf"tensor {name} \(4, 4\)$",
    ):
        saved.restore(state)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not state["t"].any()


def test_an_optimizer_state_of_another_dtype_is_still_converted_as_torch_does(
    memory_ckpt: tiercheck.Checkpointer,
) -> None:
    """The check covers a module's own tensors only: an optimizer's ``load_state_dict``
    converts its state to its parameters' dtype, as torch's own load does."""
    model = _linear()
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    memory_ckpt.save(1, {"opt": opt}).wait()
    other = torch.nn.Linear(4, 4).bfloat16()
    other_opt = torch.optim.Adam(other.parameters())
    other(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()
    other_opt.step()  # its state is bfloat16, the saved one float32
    reference = torch.optim.Adam(torch.nn.Linear(4, 4).bfloat16().parameters())
    reference.load_state_dict(opt.state_dict())
    memory_ckpt.restore({"opt": other_opt})
    got = other_opt.state[other.weight]["exp_avg"]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, reference.state_dict()["state"][0]["exp_avg"])


def test_restore_and_version_refuse_both_version_and_step(
    memory_ckpt: tiercheck.Checkpointer,
) -> None:
    """``version=0, step=3`` restored version 0 (of step 1) and ignored the step."""
    for step in (1, 2, 3):
        memory_ckpt.save(step, {"w": torch.full((2,), float(step))}).wait()
    state = {"w": torch.zeros(2)}
    with pytest.raises(ValueError, match="pass version or step, not both"):
        memory_ckpt.restore(state, version=0, step=3)
    assert not state["w"].any()
    with pytest.raises(ValueError, match="pass version or step, not both"):
        memory_ckpt.version(0, step=3)
    assert memory_ckpt.version(step=3).step == 3


def test_metadata_holding_a_tensor_says_what_metadata_takes(
    memory_ckpt: tiercheck.Checkpointer,
) -> None:
    """It said to pass allow_pickle=True, which metadata does not take, and listed
    tensors among what can be stored."""
    with pytest.raises(UnsupportedValue, match=r"^metadata must be plain msgpack") as caught:
        memory_ckpt.save(1, {"w": torch.ones(2)}, metadata={"loss": torch.tensor(0.5)})
    message = str(caught.value)
    assert "allow_pickle" not in message
    assert "metadata['loss'] is a tensor" in message and ".item()" in message
    assert list(memory_ckpt.history()) == []


@pytest.mark.parametrize("metadata", ["epoch 3", [("epoch", 3)], 3])
def test_metadata_that_is_not_a_mapping_is_refused(
    memory_ckpt: tiercheck.Checkpointer, metadata: Any
) -> None:
    """A string raised "dictionary update sequence element #0 has length 1"; a list of
    pairs was stored as if it were a dict."""
    with pytest.raises(TypeError, match="metadata must be a mapping of str keys"):
        memory_ckpt.save(1, {"w": torch.ones(2)}, metadata=metadata)
    assert list(memory_ckpt.history()) == []


def test_guard_refuses_what_is_not_an_optimizer(memory_ckpt: tiercheck.Checkpointer) -> None:
    """A module raised AttributeError: 'Linear' object has no attribute
    'register_step_pre_hook'."""
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        memory_ckpt.guard(torch.nn.Linear(4, 4))
