"""tiercheck: tiered, content-addressed, transactional checkpoint storage."""

from tiercheck.backends import Capabilities, FailureDomain, Tier, open_tier, register_tier

__version__ = "0.1.0"

__all__ = [
    "Capabilities",
    "FailureDomain",
    "Tier",
    "__version__",
    "open_tier",
    "register_tier",
]
