"""Storage tiers. The interface lives in :mod:`tiercheck.backends.base`; one private module
per built-in tier; :func:`open_tier` opens any of them by URL. The shm tier's segments
(stores in /dev/shm) are listed and removed with :func:`list_segments` and
:func:`remove_segment` (used by :mod:`tiercheck.store.lifecycle`)."""

from typing import TYPE_CHECKING, Any

from tiercheck.backends.base import Capabilities, FailureDomain, PendingPut, StoreOwner, Tier
from tiercheck.backends.registry import available_schemes, open_tier, register_tier

if TYPE_CHECKING:
    from tiercheck.backends._shm_segments import DEFAULT_ROOT as DEFAULT_SHM_ROOT
    from tiercheck.backends._shm_segments import Segment, list_segments, remove_segment

# Imported on first use: the peer daemon and ``tiercheck --help`` have no use for them.
_SHM_NAMES = {
    "DEFAULT_SHM_ROOT": "DEFAULT_ROOT",
    "Segment": "Segment",
    "list_segments": "list_segments",
    "remove_segment": "remove_segment",
}

__all__ = [
    "DEFAULT_SHM_ROOT",
    "Capabilities",
    "FailureDomain",
    "PendingPut",
    "Segment",
    "StoreOwner",
    "Tier",
    "available_schemes",
    "list_segments",
    "open_tier",
    "register_tier",
    "remove_segment",
]


def __getattr__(name: str) -> Any:
    if name in _SHM_NAMES:
        from tiercheck.backends import _shm_segments

        return getattr(_shm_segments, _SHM_NAMES[name])
    raise AttributeError(f"module 'tiercheck.backends' has no attribute {name!r}")
