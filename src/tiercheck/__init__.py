"""tiercheck: tiered, content-addressed, transactional checkpoint storage for training.

The public API::

    ckpt = tiercheck.Checkpointer("./ckpt")
    h = ckpt.save(step, {"model": model, "optim": opt, "rng": tiercheck.rng_state()})
    h.wait_staged(); h.wait()
    info = ckpt.restore({"model": model, "optim": opt})
"""

from tiercheck import errors
from tiercheck.backends import Capabilities, FailureDomain, Tier, open_tier, register_tier
from tiercheck.checkpointer import (
    Checkpointer,
    RestoreInfo,
    SaveHandle,
    SaveResult,
    VersionSummary,
)
from tiercheck.config import TierSpec
from tiercheck.placement import Policy, TierPolicy
from tiercheck.rng import rng_state, set_rng_state

__version__ = "0.1.0"

__all__ = [
    "Capabilities",
    "Checkpointer",
    "FailureDomain",
    "Policy",
    "RestoreInfo",
    "SaveHandle",
    "SaveResult",
    "Tier",
    "TierPolicy",
    "TierSpec",
    "VersionSummary",
    "__version__",
    "errors",
    "open_tier",
    "register_tier",
    "rng_state",
    "set_rng_state",
]
