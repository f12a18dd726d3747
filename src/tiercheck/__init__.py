"""tiercheck: tiered, content-addressed, transactional checkpoint storage for training.

The public API::

    ckpt = tiercheck.Checkpointer("./ckpt")
    h = ckpt.save(step, {"model": model, "optim": opt, "rng": tiercheck.rng_state()})
    h.wait_staged(); h.wait()
    info = ckpt.restore({"model": model, "optim": opt})

The engine's names are imported on first use (PEP 562), so that tier-only users — the
``tiercheck peer serve`` daemon, third-party tiers, ``open_tier`` — do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tiercheck import errors
from tiercheck.backends import Capabilities, FailureDomain, Tier, open_tier, register_tier

if TYPE_CHECKING:
    from tiercheck.checkpointer import (
        Checkpointer,
        RestoreInfo,
        SaveHandle,
        SaveResult,
        VersionSummary,
    )
    from tiercheck.core.rng import rng_state, set_rng_state
    from tiercheck.history.diff import Diff
    from tiercheck.history.versions import Version
    from tiercheck.store.config import TierSpec
    from tiercheck.store.policy import Policy, TierPolicy

__version__ = "0.1.0"

_LAZY = {
    "Checkpointer": "tiercheck.checkpointer",
    "RestoreInfo": "tiercheck.checkpointer",
    "SaveHandle": "tiercheck.checkpointer",
    "SaveResult": "tiercheck.checkpointer",
    "VersionSummary": "tiercheck.checkpointer",
    "TierSpec": "tiercheck.store.config",
    "Diff": "tiercheck.history.diff",
    "Version": "tiercheck.history.versions",
    "Policy": "tiercheck.store.policy",
    "TierPolicy": "tiercheck.store.policy",
    "rng_state": "tiercheck.core.rng",
    "set_rng_state": "tiercheck.core.rng",
}

__all__ = [
    "Capabilities",
    "Checkpointer",
    "Diff",
    "FailureDomain",
    "Policy",
    "RestoreInfo",
    "SaveHandle",
    "SaveResult",
    "Tier",
    "TierPolicy",
    "TierSpec",
    "Version",
    "VersionSummary",
    "__version__",
    "errors",
    "open_tier",
    "register_tier",
    "rng_state",
    "set_rng_state",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tiercheck' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
