"""Storage tiers. The interface lives in :mod:`tiercheck.backends.base`; one private module
per built-in tier; :func:`open_tier` opens any of them by URL. The shm tier's segments
(stores in /dev/shm) are listed and removed with :func:`list_segments` and
:func:`remove_segment` (used by :mod:`tiercheck.lifecycle`)."""

from tiercheck.backends._shm import DEFAULT_ROOT as DEFAULT_SHM_ROOT
from tiercheck.backends._shm import Segment, list_segments, remove_segment
from tiercheck.backends.base import Capabilities, FailureDomain, Tier
from tiercheck.backends.registry import available_schemes, open_tier, register_tier

__all__ = [
    "DEFAULT_SHM_ROOT",
    "Capabilities",
    "FailureDomain",
    "Segment",
    "Tier",
    "available_schemes",
    "list_segments",
    "open_tier",
    "register_tier",
    "remove_segment",
]
