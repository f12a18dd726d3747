"""Storage tiers. The interface lives in :mod:`tiercheck.backends.base`; one private module
per built-in tier; :func:`open_tier` opens any of them by URL."""

from tiercheck.backends.base import Capabilities, FailureDomain, Tier
from tiercheck.backends.registry import available_schemes, open_tier, register_tier

__all__ = [
    "Capabilities",
    "FailureDomain",
    "Tier",
    "available_schemes",
    "open_tier",
    "register_tier",
]
