"""Packs on the fsspec tier (SPEC section 15): the conformance suite on packed file://,
fsspec+memory:// and s3:// (moto on loopback) tiers, and what packs add: few objects, a
pack visible only whole, validated indexes, deletion and repacking."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tiercheck.backends.base import Tier
from tiercheck.backends.registry import open_tier
from tiercheck.testing.conformance import TierConformance

# --- conformance: small packs, so that a test's blobs span several -------------------

_SMALL = 64 * 1024


class _Packed(TierConformance):
    pack_size: ClassVar[int | str] = _SMALL
    options: ClassVar[dict[str, Any]] = {}

    def url(self, tmp_path: Path) -> str:
        raise NotImplementedError

    def make_tier(self, tmp_path: Path) -> Tier:
        return open_tier(self.url(tmp_path), pack_size=self.pack_size, **self.options)

    def reopen(self, tier: Tier) -> Tier:
        tier.close()
        return open_tier(tier.url, pack_size=self.pack_size, **self.options)

    def open_read_only(self, tier: Tier) -> Tier:
        return open_tier(tier.url, read_only=True, pack_size=self.pack_size, **self.options)


class TestPackedFileTier(_Packed):
    def url(self, tmp_path: Path) -> str:
        return f"file://{tmp_path}/tier"


class TestPackedFileTierLargePacks(_Packed):
    pack_size = "128MiB"  # everything a test writes waits in one pack until a flush

    def url(self, tmp_path: Path) -> str:
        return f"file://{tmp_path}/tier"


class TestPackedMemoryTier(_Packed):
    def url(self, tmp_path: Path) -> str:
        return f"fsspec+memory://tiercheck-{uuid.uuid4().hex}"


class TestPackedS3Tier(_Packed):
    concurrency_rounds = 10

    @pytest.fixture(autouse=True)
    def _bucket(self, s3_bucket: tuple[str, dict[str, Any]]) -> None:
        self._url, storage = s3_bucket
        self.options = {"storage_options": storage}

    def url(self, tmp_path: Path) -> str:
        return self._url
