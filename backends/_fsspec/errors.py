"""How the fsspec tier's store exceptions become tiercheck's typed errors: by type and
errno, never by message (``TierUnavailable`` for what a retry may cure, ``TierFull`` for
no space, ``TierError`` for the rest a device reports, credentials that cannot be found
included: no retry finds them)."""

from __future__ import annotations

import asyncio
import errno
from typing import NoReturn

from tiercheck.errors import TierError, TierFull, TierUnavailable

__all__ = ["is_unavailable", "missing_credentials", "raise_typed"]

_UNAVAILABLE_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EPIPE,
        errno.EBUSY,  # s3fs: SlowDown / ServiceUnavailable
        getattr(errno, "EREMOTEIO", 121),  # s3fs: InternalError (HTTP 500)
    }
)
_FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG})


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the store cannot be reached (retryable), by type, not message."""
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _UNAVAILABLE_ERRNOS:
        return True
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
    except ImportError:  # pragma: no cover - botocore comes with s3fs
        pass
    else:
        if isinstance(exc, (BotoConnectionError, HTTPClientError)):
            return True
    try:
        from aiohttp import ClientConnectionError
    except ImportError:  # pragma: no cover - aiohttp comes with s3fs / gcsfs
        pass
    else:
        if isinstance(exc, ClientConnectionError):
            return True
    from fsspec.exceptions import FSTimeoutError

    return isinstance(exc, FSTimeoutError)


def missing_credentials(exc: BaseException, url: str, what: str, key: str = "") -> TierError | None:
    """The typed error for a store that found no credentials (botocore's
    ``NoCredentialsError``; ``PartialCredentialsError``: a key without its secret), or None
    for any other exception. Not ``TierUnavailable``: a retry would not find them either."""
    try:
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError
    except ImportError:  # pragma: no cover - botocore comes with s3fs
        return None
    if not isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return None
    return TierError(
        f"{what} failed, credentials missing ({exc}): credentials given in the URL "
        "(s3://KEY:SECRET@bucket/...) are not written to tiercheck.toml; give them again "
        "in the URL or storage_options of this open, as a reference in storage_options "
        "(key = {env = NAME}), or in the environment (AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY, AWS_PROFILE)",
        url=url,
        key=key,
    )


def _translate(exc: BaseException, url: str, key: str, what: str) -> TierError | None:
    """The typed error for a store exception, or None if it is not one we classify."""
    if isinstance(exc, TierError):
        return exc
    if is_unavailable(exc):
        return TierUnavailable(f"{what} failed, store unreachable: {exc}", url=url, key=key)
    if (missing := missing_credentials(exc, url, what, key)) is not None:
        return missing
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
        return TierFull(f"{what} failed, no space left: {exc}", url=url, key=key)
    if isinstance(exc, PermissionError):
        return TierError(f"{what} failed, permission denied: {exc}", url=url, key=key)
    if isinstance(exc, OSError) and exc.errno is not None:  # EIO, EROFS, ... from the device
        return TierError(f"{what} failed: {exc}", url=url, key=key)
    return None


def raise_typed(exc: BaseException, url: str, key: str, what: str) -> NoReturn:
    typed = _translate(exc, url, key, what)
    if typed is None or typed is exc:
        raise exc
    raise typed from exc
