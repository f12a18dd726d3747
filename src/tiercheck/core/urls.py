"""URLs as they may be shown: without the credentials an authority can carry."""

from __future__ import annotations

import urllib.parse

__all__ = ["without_userinfo"]


def without_userinfo(url: str) -> str:
    """``url`` without the user and password of its authority (``s3://KEY:SECRET@b/x``
    -> ``s3://b/x``); any other string is returned as it is."""
    if "@" not in url or "://" not in url:
        return url
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # not a URL after all (an unbalanced '[' ...): nothing to strip
        return url
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
