"""Capturing and restoring the random number generators a training run depends on."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """The state of Python's, NumPy's and torch's (CPU and, if present, CUDA) generators.

    The result can be saved as part of a state; pass it back to :func:`set_rng_state`.
    """
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the generators captured by :func:`rng_state`.

    CUDA states are restored per device index, as many as both the saving and this process
    have (a generator's state lives on the host: no device is touched).
    """
    if "python" in state:
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
    if "numpy" in state:
        np.random.set_state(tuple(state["numpy"]))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # one state per GPU of the saving process; a node with fewer GPUs takes the first
        # ones (setting a generator's state touches no device: no context is created)
        states = list(state["cuda"])[: torch.cuda.device_count()]
        for index, cuda_state in enumerate(states):
            torch.cuda.set_rng_state(cuda_state, index)
