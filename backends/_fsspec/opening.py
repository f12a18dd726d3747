"""Opening the fsspec tier's store from its URL (a local path or any fsspec protocol, a
bucket checked at open), and the default capabilities of each kind of store."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlsplit

from tiercheck.backends._fsspec.errors import is_unavailable, missing_credentials
from tiercheck.backends._fsspec.local import LocalStore
from tiercheck.backends._fsspec.remote import FsspecStore
from tiercheck.backends._fsspec.store import Store
from tiercheck.backends.base import Capabilities, FailureDomain, invalid_url
from tiercheck.errors import InvalidURL, TierUnavailable, UnknownScheme

__all__ = ["default_capabilities", "open_store", "url_credentials"]

_LOCAL_PROTOCOLS = frozenset({"file", "local"})
# Protocols whose first path component is a bucket (checked at open).
_BUCKET_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"})


# Protocols whose file system takes a URL's user and password, as these options
_USERINFO_OPTIONS = {"s3": ("key", "secret"), "s3a": ("key", "secret")}


def url_credentials(url: str, storage_options: Any) -> tuple[str, Any]:
    """``url`` without the user and password of its authority, and ``storage_options``
    with them as the file system's credentials: ``s3://KEY:SECRET@bucket/run`` opens
    ``s3://bucket/run`` with s3fs's ``key=KEY, secret=SECRET`` (percent-decoded: a ``/``
    in a secret is written ``%2F``). Only the URL without them is used from here on, so
    no message shows them. ``InvalidURL``, without them, for a protocol whose file system
    takes no credentials this way, for credentials given in ``storage_options`` too, and
    for an s3 URL whose bucket part still holds a ``:`` (a secret with a bare ``/``)."""
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    protocol = scheme.lower().removeprefix("fsspec+")
    names = _USERINFO_OPTIONS.get(protocol)
    if sep and names is not None and ":" in authority and "@" not in authority:
        # never shown: this is a secret cut at a '/' it holds
        raise InvalidURL(
            f"the bucket of an {protocol}:// URL cannot hold ':' (a secret with a bare '/' "
            "cuts the URL there): write credentials as KEY:SECRET@bucket, percent-encoded "
            "('/' as %2F), or pass them in storage_options"
        )
    if not sep or "@" not in authority:
        return url, storage_options
    userinfo, _, host = authority.rpartition("@")
    bare = f"{scheme}://{host}{slash}{path}"
    if names is None:
        raise invalid_url(
            bare,
            "only s3:// and s3a:// URLs take credentials (KEY:SECRET@bucket); pass them "
            "in storage_options, or as a reference ({env = NAME})",
        )
    if storage_options is not None and not isinstance(storage_options, dict):
        return bare, storage_options  # refused as it is by the tier
    options = dict(storage_options or {})
    if any(name in options for name in names):
        raise invalid_url(
            bare, f"credentials both in the URL and in storage_options ({'/'.join(names)})"
        )
    user, has_password, password = userinfo.partition(":")
    options[names[0]] = unquote(user)
    if has_password:
        options[names[1]] = unquote(password)
    return bare, options


def default_capabilities(*, local: bool, memory: bool, shared: bool | None) -> Capabilities:
    # a file system of this node (or process memory) takes bytes faster than zstd makes them
    if memory:
        return Capabilities(
            survives=FailureDomain.NONE,
            shared=bool(shared),
            persistent=False,
            speed_rank=5,
            compress=False,
            host_memory=True,  # fsspec's memory://: this process's own
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
        missing = missing_credentials(exc, url, f"open of bucket {bucket!r}")
        if missing is not None:
            _forget(store.fs)
            raise missing from exc  # this tier is unavailable; the store's others open
        raise


def _forget(fs: Any) -> None:
    """Drop ``fs`` from fsspec's instance cache. Its client looked for credentials once,
    when it was made: without this, every later open with the same options in this
    process would get it back, and find none even once the environment has them."""
    cache = getattr(type(fs), "_cache", None)
    if isinstance(cache, dict):
        cache.pop(getattr(fs, "_fs_token", None), None)
