"""Capturing and restoring the random number generators a training run depends on.

The captured state holds only tensors and plain Python values (ints, floats, strings,
lists, tuples, dicts), so it can be kept in any checkpoint: tiercheck's (msgpack, no
pickle) and ``torch.save`` files loaded with ``torch.load(weights_only=True)`` (Lightning's
own checkpoints, for one). NumPy's generator is stored as its legacy dict with the key as a
list of ints instead of an ndarray.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state"]


def _numpy_state() -> dict[str, Any]:
    st = np.random.get_state(legacy=False)
    return {
        "bit_generator": str(st["bit_generator"]),
        "key": [int(k) for k in st["state"]["key"]],
        "pos": int(st["state"]["pos"]),
        "has_gauss": int(st["has_gauss"]),
        "gauss": float(st["gauss"]),
    }


def _set_numpy_state(saved: Any) -> None:
    if isinstance(saved, Mapping):
        key = saved["key"]
        if isinstance(key, torch.Tensor):
            key = key.numpy()
        np.random.set_state(
            {
                "bit_generator": saved["bit_generator"],
                "state": {"key": np.asarray(key, dtype=np.uint32), "pos": int(saved["pos"])},
                "has_gauss": int(saved["has_gauss"]),
                "gauss": float(saved["gauss"]),
            }
        )
    elif isinstance(saved, Sequence):
        # the form tiercheck stored before (np.random.get_state()'s tuple, key an ndarray)
        name, key, pos, has_gauss, gauss = saved
        np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    else:
        raise TypeError(f"not a NumPy generator state: {type(saved).__qualname__}")


def rng_state() -> dict[str, Any]:
    """The state of Python's, NumPy's and torch's (CPU and, if present, CUDA) generators.

    The result holds tensors and plain values only (no NumPy arrays): it can be saved with
    tiercheck or ``torch.save`` and loaded with ``torch.load(weights_only=True)``. Pass it
    back to :func:`set_rng_state`.
    """
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the generators captured by :func:`rng_state` (or by an older tiercheck,
    whose NumPy state was ``np.random.get_state()``'s tuple); bit-exact.

    CUDA states are restored per device index, as many as both the saving and this process
    have (a generator's state lives on the host: no device is touched).
    """
    if "python" in state:
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
    if "numpy" in state:
        _set_numpy_state(state["numpy"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # one state per GPU of the saving process; a node with fewer GPUs takes the first
        # ones (setting a generator's state touches no device: no context is created)
        states = list(state["cuda"])[: torch.cuda.device_count()]
        for index, cuda_state in enumerate(states):
            torch.cuda.set_rng_state(cuda_state, index)
