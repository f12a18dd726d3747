"""Opening the fsspec tier's store from its URL (a local path or any fsspec protocol, a
bucket checked at open), and the default capabilities of each kind of store."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from tiercheck.backends._fsspec.errors import is_unavailable
from tiercheck.backends._fsspec.local import LocalStore
from tiercheck.backends._fsspec.remote import FsspecStore
from tiercheck.backends._fsspec.store import Store
from tiercheck.backends.base import Capabilities, FailureDomain, invalid_url
from tiercheck.errors import InvalidURL, TierUnavailable, UnknownScheme

__all__ = ["default_capabilities", "open_store"]

_LOCAL_PROTOCOLS = frozenset({"file", "local"})
# Protocols whose first path component is a bucket (checked at open).
_BUCKET_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"})


def default_capabilities(*, local: bool, memory: bool, shared: bool | None) -> Capabilities:
    # a file system of this node (or process memory) takes bytes faster than zstd makes them
    if memory:
        return Capabilities(
            survives=FailureDomain.NONE,
            shared=bool(shared),
            persistent=False,
            speed_rank=5,
            compress=False,
        )
    if local:
        return Capabilities(
            survives=FailureDomain.NODE if shared else FailureDomain.PROCESS,
            shared=bool(shared),
            persistent=True,
            speed_rank=40,
            compress=False,
        )
    return Capabilities(
        survives=FailureDomain.CLUSTER,
        shared=True if shared is None else shared,
        persistent=True,
        speed_rank=50,
    )


def open_store(url: str, storage_options: dict[str, Any]) -> tuple[str, str, Store]:
    """Parse ``url``; return (protocol, root path in the store, store)."""
    if any(c in url for c in "?#") or any(not c.isprintable() for c in url):
        raise invalid_url(url, "no query, fragment or control characters in a tier URL")
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep:
        raise invalid_url(url, "expected PROTOCOL://PATH")
    protocol = scheme[len("fsspec+") :] if scheme.startswith("fsspec+") else scheme
    if not protocol:
        raise invalid_url(url, "fsspec+ needs a protocol, e.g. fsspec+memory://root")
    if protocol in _LOCAL_PROTOCOLS:
        if storage_options:
            raise invalid_url(url, f"storage_options are not used by {protocol}://")
        parts = urlsplit(f"file://{rest}")
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise invalid_url(url, "expected an absolute path: file:///abs/path")
        root = os.path.normpath(parts.path)
        if root in ("/", "//"):
            raise invalid_url(url, "refusing to use / as a tier root")
        return protocol, root, LocalStore(root)

    import fsspec

    if not rest.strip("/"):
        raise invalid_url(url, f"expected {protocol}://ROOT, e.g. s3://bucket/prefix")
    if protocol not in ("memory",):
        # Listings must be fresh: another writer may have added log records.
        storage_options.setdefault("use_listings_cache", False)
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise UnknownScheme(f"fsspec knows no protocol {protocol!r}", url=url) from None
    except ImportError as exc:
        raise invalid_url(
            url, f"protocol {protocol!r} needs a package that is missing: {exc}"
        ) from None
    try:
        fs = cls(**storage_options)
    except TypeError as exc:
        raise invalid_url(url, f"bad storage_options for {protocol}://: {exc}") from None
    root = str(cls._strip_protocol(f"{protocol}://{rest}")).rstrip("/")
    if not root or root == "/":
        raise invalid_url(url, "refusing to use the store's top level as a tier root")
    store = FsspecStore(fs, protocol)
    if protocol in _BUCKET_PROTOCOLS:
        _check_bucket(url, store, root.split("/", 1)[0])
    return protocol, root, store


def _check_bucket(url: str, store: FsspecStore, bucket: str) -> None:
    try:
        store.fs.invalidate_cache(bucket)
        store.fs.info(bucket)
    except FileNotFoundError:
        raise InvalidURL(
            f"bucket {bucket!r} does not exist; create it or fix the URL", url=url
        ) from None
    except PermissionError:
        raise InvalidURL(
            f"access to bucket {bucket!r} denied; check the credentials in storage_options "
            "or the environment",
            url=url,
        ) from None
    except Exception as exc:
        if is_unavailable(exc):
            raise TierUnavailable(
                f"cannot reach the store to open bucket {bucket!r}: {exc}", url=url
            ) from exc
        raise
