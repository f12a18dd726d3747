"""Shared fixtures: a real S3 endpoint (moto's server) on loopback, and a check that no test
leaks an shm segment.

- ``_no_leaked_segments`` (autouse): fails a test that leaves behind, in
  ``/dev/shm/tiercheck-UID``, a segment it created: one whose owner record names this test
  process, or a store under this session's temporary directory (a subprocess's). Other
  processes' segments (other test runs on the machine) are never counted. A leaked
  segment is removed after it is reported.

- ``s3_server`` (session): a :class:`MotoS3Server` already started; ``.endpoint_url``,
  ``.storage_options`` (for ``open_tier(..., storage_options=...)``), ``.client()``
  (a boto3 client), and ``.stop()`` / ``.start()`` to take the endpoint down and bring it
  back on the same port with its buckets intact (for "remote tier down" tests). A test
  that stops it must start it again (use ``with s3_server.down(): ...``).
- ``s3_bucket`` (function): a fresh bucket; yields ``(url, storage_options)`` where url is
  ``s3://BUCKET/tier``.
- ``_quick_migration_retries`` (autouse): a failed migration is retried after 50 ms
  doubling to 1 s, not 1 s doubling to 60 s (``tiercheck.upkeep.migration``): the tests
  of failing migrations wait for their retries (three tries each) and test what the
  retries do, not how long a real remote is given to come back.

Dummy credentials are set in the environment for the whole session, shared AWS config
files and instance metadata are switched off, and proxies are bypassed for loopback, so
nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak",
        action="store_true",
        help="long fault-injection run: thousands of kill points, 25x fuzz examples "
        "(the same as TIERCHECK_SOAK=1)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests marked ``slow`` (multi-process runs of many seconds each) go first, so
    that the workers of ``-n 2`` share them out at the start and finish together, instead
    of one worker running the last long test alone. ``-m "not slow"`` leaves them out."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# the host's default shm root, left as the run found it (entered in the controlling process)
_SHM_ROOT = pytest.StashKey[contextlib.AbstractContextManager[None]]()


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--soak"):
        os.environ["TIERCHECK_SOAK"] = "1"  # read by the test modules as they are imported
    if not hasattr(config, "workerinput"):  # not in an xdist worker: tests still run there
        from tiercheck.store.lifecycle import shm_root_left_as_found

        config.stash[_SHM_ROOT] = shm_root_left_as_found()
        config.stash[_SHM_ROOT].__enter__()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Each test's segments are checked by ``_no_leaked_segments``; the empty root the run
    made goes too, once every worker has finished."""
    ctx = config.stash.get(_SHM_ROOT, None)
    if ctx is not None:
        ctx.__exit__(None, None, None)


_FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
_UNSET_ENV = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


class MotoS3Server:
    """moto's S3 server in a thread of this process, stoppable and restartable on one port.

    Its buckets live in moto's in-process backend, so they survive ``stop()``/``start()``.
    Requests are served one at a time: moto checks ``If-None-Match`` and then stores, in two
    steps, so concurrent conditional writes would race inside moto; AWS makes them atomic,
    and serialising the requests makes moto behave like AWS.
    """

    host = "127.0.0.1"

    def __init__(self) -> None:
        self.port = 0  # chosen by the kernel on the first start, then kept
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def endpoint_url(self) -> str:
        if not self.port:
            raise RuntimeError("the moto server was never started")
        return f"http://{self.host}:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs options for this endpoint: one attempt per request, short timeouts, so
        that a stopped server fails fast instead of being retried for seconds."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
            "config_kwargs": {
                "retries": {"max_attempts": 1, "mode": "standard"},
                "connect_timeout": 5,
                "read_timeout": 60,
            },
        }

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def start(self) -> None:
        """Serve on ``self.port`` (a free port the first time); returns once listening."""
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        if self._server is not None:
            return
        app = DomainDispatcherApplication(create_backend_app)
        lock = threading.Lock()

        def serialised(environ: Any, start_response: Any) -> Any:
            with lock:
                return list(app(environ, start_response))

        server = make_server(
            self.host, self.port, serialised, threaded=True, request_handler=MotoRequestHandler
        )
        self.port = server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, name="moto-s3", daemon=True)
        self._thread.start()
        self._server = server

    def stop(self) -> None:
        """Stop serving and close the listening socket: new connections are refused."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join()

    @contextlib.contextmanager
    def down(self) -> Iterator[None]:
        """Stop the server for the body of a ``with`` block, then start it again."""
        self.stop()
        try:
            yield
        finally:
            self.start()


def _segments() -> dict[str, Any]:
    from tiercheck.backends import DEFAULT_SHM_ROOT, list_segments

    return {s.path: s for s in list_segments(DEFAULT_SHM_ROOT, sizes=False)}


@pytest.fixture
def memory_ckpt(tmp_path: Any) -> Iterator[Any]:
    """A store of one in-process memory tier (for tests that are not about tiers)."""
    import tiercheck

    store = tiercheck.Checkpointer(
        tmp_path / "store", tiers=[("mem", f"memory://{uuid.uuid4().hex}")]
    )
    try:
        yield store
    finally:
        store.close()


@pytest.fixture(autouse=True)
def _quick_migration_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    from tiercheck.upkeep import migration

    monkeypatch.setattr(migration, "RETRY_FIRST", 0.05)
    monkeypatch.setattr(migration, "RETRY_MAX", 1.0)


@pytest.fixture(autouse=True)
def _no_leaked_segments(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    before = set(_segments())
    yield
    from tiercheck.backends import remove_segment

    base = str(tmp_path_factory.getbasetemp().resolve())
    leaked = [
        seg
        for path, seg in _segments().items()
        if path not in before
        and (
            seg.pid == os.getpid()
            or (seg.store is not None and (seg.store == base or seg.store.startswith(base + "/")))
        )
    ]
    for seg in leaked:
        remove_segment(seg.path)
    if leaked:
        pytest.fail(
            "the test left shm segments in /dev/shm (removed now): "
            + ", ".join(f"{s.path} (store {s.store})" for s in leaked)
            + "; delete stores with Checkpointer.destroy() or "
            + "tiercheck.store.lifecycle.destroy_store",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoS3Server]:
    """A started moto S3 server on 127.0.0.1, with dummy AWS credentials in the env."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in _FAKE_AWS_ENV.items():
            mp.setenv(name, value)
        for name in _UNSET_ENV:
            mp.delenv(name, raising=False)
        # werkzeug logs every request at INFO; keep test output readable.
        mp.setattr(logging.getLogger("werkzeug"), "level", logging.WARNING)
        server = MotoS3Server()
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(s3_server: MotoS3Server) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh, empty bucket: yields ``("s3://BUCKET/tier", storage_options)``."""
    if not s3_server.running:  # a previous test left it down: bring it back
        s3_server.start()
    bucket = f"tiercheck-{uuid.uuid4().hex[:20]}"
    s3_server.client().create_bucket(Bucket=bucket)
    yield f"s3://{bucket}/tier", s3_server.storage_options
