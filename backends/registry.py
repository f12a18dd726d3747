"""The tier registry: URL scheme -> tier class, imported lazily, extensible by entry points.

Built-in schemes map to ``"module:Class"`` strings so that opening an ``lmdb://`` tier never
imports s3fs and vice versa. Third parties register in one of two ways:

- at run time: ``register_tier("mytier", MyTier)`` or ``register_tier("mytier", "pkg.mod:MyTier")``;
- by packaging: an entry point in the ``tiercheck.tiers`` group whose name is the scheme and
  whose value is ``"pkg.mod:MyTier"``.

A tier class is called as ``cls(url, **options)``.

Scheme resolution: ``memory://`` is the in-process tier; ``shm://``, ``lmdb://`` and
``peer://`` are the built-in tiers; ``fsspec+PROTO://...`` forces fsspec for any protocol
(``fsspec+memory://`` is fsspec's memory file system); any other scheme that fsspec knows
(``file://``, ``s3://``, ``gs://``, ...) is served by the fsspec tier.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any
from urllib.parse import urlsplit

from tiercheck.backends.base import Tier, invalid_url
from tiercheck.errors import UnknownScheme

__all__ = ["available_schemes", "open_tier", "register_tier", "scheme_of"]

TierFactory = Callable[..., Tier]

_BUILTIN: dict[str, str] = {
    "memory": "tiercheck.backends._memory:MemoryTier",
    "shm": "tiercheck.backends._shm:ShmTier",
    "lmdb": "tiercheck.backends._lmdb:LmdbTier",
    "peer": "tiercheck.backends._peer:PeerTier",
    "collective": "tiercheck.backends._collective:CollectivePeerTier",
}
_FSSPEC = "tiercheck.backends._fsspec.tier:FsspecTier"

# The one piece of global mutable state tiercheck keeps (see STYLE.md).
_registry: dict[str, str | TierFactory] = dict(_BUILTIN)
_lock = threading.Lock()
_entry_points_loaded = False


def register_tier(scheme: str, factory: str | TierFactory, *, replace: bool = False) -> None:
    """Register ``factory`` (a class, callable, or ``"module:attr"`` string) for ``scheme``."""
    scheme = scheme.lower()
    if not scheme.replace("+", "").replace("-", "").replace(".", "").isalnum():
        raise ValueError(f"invalid scheme {scheme!r}")
    with _lock:
        if scheme in _registry and not replace and _registry[scheme] != factory:
            raise ValueError(f"scheme {scheme!r} is already registered; pass replace=True")
        _registry[scheme] = factory


def _load_entry_points() -> None:
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        for ep in entry_points(group="tiercheck.tiers"):
            _registry.setdefault(ep.name.lower(), ep.value)


def _resolve(factory: str | TierFactory) -> TierFactory:
    if not isinstance(factory, str):
        return factory
    module_name, _, attr = factory.partition(":")
    module = importlib.import_module(module_name)
    obj: TierFactory = getattr(module, attr)
    return obj


def scheme_of(url: str) -> str:
    """Return the lower-cased scheme of ``url``; raise ``InvalidURL`` if there is none."""
    if not isinstance(url, str) or "://" not in url:
        raise invalid_url(str(url), "expected SCHEME://..., e.g. lmdb:///path or shm://name")
    scheme = urlsplit(url).scheme.lower()
    if not scheme:
        raise invalid_url(url, "missing scheme")
    return scheme


def available_schemes() -> list[str]:
    """Schemes with a registered tier (fsspec protocols are served in addition)."""
    _load_entry_points()
    return sorted(_registry)


def _fsspec_knows(protocol: str) -> bool:
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:  # pragma: no cover - fsspec is a hard dependency
        return False
    return protocol in known_implementations or protocol in registry


def open_tier(url: str, **options: Any) -> Tier:
    """Open the tier that serves ``url``.

    Raises ``InvalidURL`` for a malformed URL and ``UnknownScheme`` when no tier serves its
    scheme. ``options`` go to the tier class (e.g. ``read_only=True``).
    """
    scheme = scheme_of(url)
    _load_entry_points()
    factory: str | TierFactory | None
    with _lock:
        factory = _registry.get(scheme)
    if factory is None:
        if scheme.startswith("fsspec+") or _fsspec_knows(scheme):
            factory = _FSSPEC
        else:
            raise UnknownScheme(
                f"no tier is registered for scheme {scheme!r} (known: "
                f"{', '.join(available_schemes())}, or any fsspec protocol)",
                url=url,
            )
    return _resolve(factory)(url, **options)
