"""Retry with backoff and connection limits as tier wrappers (tiercheck.backends.resilience),
against a flaky S3 endpoint: moto's server behind a proxy on loopback that answers some
requests with 503 (tests/_flaky_s3.py). The wrappers and the S3 tier are the real ones; the
faults come from the endpoint."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _flaky_s3 import FlakyS3

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.backends.registry import open_tier
from tiercheck.backends.resilience import DEFAULT_RETRY, LimitTier, RetryPolicy, RetryTier, wrapping
from tiercheck.errors import ConfigError, DurabilityError, NotFound, TierUnavailable
from tiercheck.formats.ids import chunk_id


@pytest.fixture
def flaky(s3_server: Any) -> Iterator[FlakyS3]:
    if not s3_server.running:
        s3_server.start()
    with FlakyS3(s3_server.endpoint_url) as proxy:
        yield proxy


def bucket_url(s3_server: Any) -> str:
    bucket = f"tiercheck-{uuid.uuid4().hex[:20]}"
    s3_server.client().create_bucket(Bucket=bucket)
    return f"s3://{bucket}/tier"


def options_via(proxy: FlakyS3, s3_server: Any, **extra: Any) -> dict[str, Any]:
    """s3fs through the proxy with botocore's own retries off (``total_max_attempts`` 1;
    its ``max_attempts`` counts retries, not tries), so that a 503 reaches the tier."""
    storage = dict(s3_server.storage_options)
    storage["endpoint_url"] = proxy.endpoint_url
    storage["config_kwargs"] = {
        **storage["config_kwargs"],
        "retries": {"total_max_attempts": 1, "mode": "standard"},
    }
    return {"storage_options": storage, **extra}


def state_of(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64 << 10, generator=g), "b": torch.randn(300, generator=g)}


def test_an_outage_costs_one_try_per_call_once_a_call_gave_up(
    flaky: FlakyS3, s3_server: Any
) -> None:
    """An outage: the call that finds it tries ``attempts`` times, every later call once
    (the tier is down), until one succeeds; then a call retries again. Counted in
    requests at the endpoint, no clock involved."""
    naps: list[float] = []
    url = bucket_url(s3_server)
    # one object per blob: a packed tier would answer size() from the pack in memory
    inner = open_tier(url, **options_via(flaky, s3_server, pack_size=0))
    tier = RetryTier(inner, RetryPolicy(attempts=4, initial=0.01), sleep=naps.append)
    try:
        blob = b"x" * 100
        bid = chunk_id(blob)
        tier.put(bid, blob)
        flaky.down()
        before = flaky.requests
        with pytest.raises(TierUnavailable):
            tier.size(bid)
        assert len(naps) == 3  # 4 tries, 3 backoffs between them
        assert tier.down and tier.gave_up == 1
        first = flaky.requests - before
        assert first % 4 == 0
        per_try = first // 4  # requests one try of size() makes (s3fs may fall back to a list)
        for _ in range(3):
            before = flaky.requests
            with pytest.raises(TierUnavailable):
                tier.size(bid)
            assert flaky.requests - before == per_try  # one try while down: no multiplying
        assert len(naps) == 3
        flaky.up()
        assert tier.size(bid) == len(tier.inner.get(bid)) and not tier.down
        flaky.down()
        before = flaky.requests
        with pytest.raises(TierUnavailable):
            tier.size(bid)
        assert flaky.requests - before == 4 * per_try and len(naps) == 6  # a blip: retried
        assert all(0 <= n <= 2.0 for n in naps)
    finally:
        flaky.up()
        tier.close()


def store(
    tmp_path: Path, flaky: FlakyS3, s3_server: Any, guarantee: str = "required", **wrappers: Any
) -> Checkpointer:
    tiers = [
        TierSpec("mem", f"memory://{uuid.uuid4().hex}"),
        TierSpec("s3sync", bucket_url(s3_server), options_via(flaky, s3_server, **wrappers)),
        TierSpec("s3", bucket_url(s3_server), options_via(flaky, s3_server, **wrappers)),
    ]
    policy = Policy(
        base_every=2,
        gc_grace_seconds=0,
        tiers={
            "mem": TierPolicy(keep_bases=1, keep_diffs=1),
            "s3sync": TierPolicy(versions="all", mode="sync", keep_bases=1, keep_diffs=1),
            "s3": TierPolicy(versions="base", mode="async", keep_bases=1, guarantee=guarantee),
        },
    )
    return Checkpointer(tmp_path / "s", tiers=tiers, policy=policy)


@pytest.mark.slow
def test_save_migration_restore_and_gc_ride_out_a_flaky_endpoint(
    tmp_path: Path, flaky: FlakyS3, s3_server: Any
) -> None:
    """A fifth of the requests fail once with 503. With the default wrappers of an s3://
    tier every save commits in the synchronous S3 tier, every base migrates, a restore from
    each S3 tier alone is bit for bit, and GC deletes what retention dropped."""
    flaky.fraction = 0.2
    ckpt = store(tmp_path, flaky, s3_server)
    try:
        for name in ("s3sync", "s3"):
            tier = ckpt.tierset.get(name).tier
            assert isinstance(tier, RetryTier) and isinstance(tier.inner, LimitTier)
        written = 0
        for step in range(1, 7):
            r = ckpt.save(step, state_of(step)).wait_migrated()
            written += r.chunks_written["s3sync"]
            assert r.tiers["s3sync"] == "committed", r.errors
            if r.role == "base":
                assert r.tiers["s3"] == "committed", r.errors
        ckpt.gc(grace=0)  # what retention dropped goes (here or already in the background)
        sync = ckpt.tierset.get("s3sync").tier
        assert sync is not None
        assert len(list(sync.list())) < written
        for tiers, step in ((["s3sync"], 6), (["s3"], 5)):
            got = ckpt.restore(None, tiers=tiers).state
            want = state_of(step)
            assert all(torch.equal(got[k], want[k]) for k in want)
        retried = sum(ckpt.tierset.get(n).tier.retries for n in ("s3sync", "s3"))  # type: ignore[union-attr]
        assert flaky.injected > 0 and retried > 0
    finally:
        ckpt.destroy()


def test_without_the_retry_the_same_faults_fail_the_save(
    tmp_path: Path, flaky: FlakyS3, s3_server: Any
) -> None:
    """The faults above are real: with ``retry = false`` the synchronous S3 tier fails."""
    flaky.fraction = 0.2
    # the asynchronous tier best effort: the faults may keep it from opening, and a required
    # one that could not be opened fails every wait_migrated() (close() says so)
    ckpt = store(tmp_path, flaky, s3_server, guarantee="best_effort", retry=False)
    try:
        assert not isinstance(ckpt.tierset.get("s3sync").tier, RetryTier)
        failed = 0
        for step in range(1, 5):
            try:
                ckpt.save(step, state_of(step)).wait()
            except DurabilityError as exc:
                assert "s3sync" in exc.failed, exc
                failed += 1
        assert failed > 0 and flaky.injected > 0
        # the migrations to the asynchronous S3 tier are the scheduler's to retry, whole
        assert ckpt.wait_migrations(timeout=300) is True
    finally:
        ckpt.destroy()


def test_a_connection_limit_bounds_the_requests_in_flight(flaky: FlakyS3, s3_server: Any) -> None:
    url = bucket_url(s3_server)
    tier = wrapping(url, {"max_in_flight": 2, "retry": False})(
        open_tier(url, **options_via(flaky, s3_server))
    )
    assert isinstance(tier, LimitTier)
    blobs = [bytes([i]) * 2000 for i in range(24)]
    try:
        threads = [threading.Thread(target=lambda b=b: tier.put(chunk_id(b), b)) for b in blobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert 1 <= flaky.peak <= 2  # at the endpoint: a put is one request at a time
        # a limit bounds calls, not requests: one has() of many ids asks them at once
        assert tier.has([chunk_id(b) for b in blobs]) == {chunk_id(b) for b in blobs}
    finally:
        tier.close()


def test_options_and_defaults(tmp_path: Path, s3_server: Any) -> None:
    """Defaults by URL: a network store gets retry and a limit, local tiers neither; the
    options are validated before anything opens, and written to tiercheck.toml."""
    assert isinstance(wrapping("s3://b/p", {})(object()), RetryTier)  # type: ignore[arg-type]
    for url in ("file:///tmp/x", "lmdb:///tmp/x", "memory://x", "shm://x", "peer://h:1"):
        marker = object()
        assert wrapping(url, {})(marker) is marker  # type: ignore[arg-type]
    for bad in (
        {"retry": {"attempts": 0}},
        {"retry": {"tries": 3}},
        {"retry": "yes"},
        {"max_in_flight": -1},
        {"max_in_flight": 1.5},
    ):
        with pytest.raises(ConfigError):
            wrapping("s3://b/p", bad)
    url = bucket_url(s3_server)
    opts = {
        **{"storage_options": s3_server.storage_options},
        "retry": {"attempts": 3, "max_delay": 0.5},
        "max_in_flight": 4,
    }
    with Checkpointer(tmp_path / "s", tiers=[TierSpec("s3", url, opts)]) as ckpt:
        tier = ckpt.tierset.get("s3").tier
        assert isinstance(tier, RetryTier) and tier.policy == RetryPolicy(3, 0.1, 0.5, 15.0)
        assert isinstance(tier.inner, LimitTier) and tier.inner.max_in_flight == 4
        ckpt.save(1, state_of(1)).wait()
    text = (tmp_path / "s" / "tiercheck.toml").read_text()
    assert "max_in_flight = 4" in text and "attempts = 3" in text
    with Checkpointer(tmp_path / "s", read_only=True) as again:  # read back from the file
        tier = again.tierset.get("s3").tier
        assert isinstance(tier, RetryTier) and tier.policy.attempts == 3
    with pytest.raises(ConfigError, match="max_in_flight"):
        Checkpointer(tmp_path / "bad", tiers=[TierSpec("s3", url, {**opts, "max_in_flight": -2})])


def test_a_permanent_error_is_not_retried(flaky: FlakyS3, s3_server: Any) -> None:
    """NotFound is an answer, not an outage: one try, no backoff, the tier is not down;
    and while down, such an answer marks it up again."""
    naps: list[float] = []
    url = bucket_url(s3_server)
    tier = RetryTier(open_tier(url, **options_via(flaky, s3_server)), sleep=naps.append)
    try:
        absent = chunk_id(b"never written")
        with pytest.raises(NotFound):
            tier.get(absent)
        assert naps == [] and not tier.down and tier.retries == 0
        flaky.down()
        with pytest.raises(TierUnavailable):
            tier.get(absent)
        assert tier.down and len(naps) == DEFAULT_RETRY.attempts - 1
        flaky.up()
        with pytest.raises(NotFound):
            tier.get(absent)
        assert not tier.down
    finally:
        flaky.up()
        tier.close()
