"""Running the peer-memory daemon: ``tiercheck peer serve`` and ``tiercheck peer status``.

:func:`serve` runs a :class:`~tiercheck.peer.server.PeerServer` until a signal (or an
event) stops it; :func:`peer_status` asks a running daemon what it holds. The argument
parsers here are shared by the ``tiercheck`` CLI and by ``python -m tiercheck.peer.daemon
[serve] --listen HOST:PORT ...`` / ``python -m tiercheck.peer.daemon status HOST:PORT``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from tiercheck.backends._peer_protocol import (
    DEFAULT_MAX_FRAME,
    TOKEN_ENV,
    load_token_file,
    token_from_env,
)
from tiercheck.core.sizes import parse_size
from tiercheck.errors import ConfigError
from tiercheck.peer.server import (
    DEFAULT_FRAME_TIMEOUT,
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_KEEPALIVE,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_UNAUTHENTICATED,
    DEFAULT_MAX_UNAUTHENTICATED_PER_ADDRESS,
    DEFAULT_MIN_RATE,
    PeerServer,
)

__all__ = [
    "add_serve_arguments",
    "add_status_arguments",
    "main",
    "main_serve",
    "main_status",
    "peer_status",
    "run_serve",
    "run_status",
    "serve",
]

log = logging.getLogger(__name__)


def serve(
    listen: str,
    *,
    memory_limit: int,
    token: bytes | None,
    max_frame: int = DEFAULT_MAX_FRAME,
    insecure_no_auth: bool = False,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
    keepalive: float | None = DEFAULT_KEEPALIVE,
    announce: Callable[[str], None] | None = None,
    stop: threading.Event | None = None,
    **limits: Any,
) -> None:
    """Run the daemon until SIGTERM/SIGINT (or until ``stop`` is set, when given).

    A token is required unless ``insecure_no_auth``. ``announce`` is called with the bound
    ``HOST:PORT`` once clients can connect. Without ``stop`` this must run on the main
    thread: it blocks SIGTERM and SIGINT and waits for them with ``sigwait``. ``limits``
    are :class:`PeerServer`'s other keyword arguments (deadlines, unauthenticated caps,
    the namespace quota).
    """
    if token is None and not insecure_no_auth:
        raise ConfigError(
            "the peer daemon needs a shared-secret token: pass --token-file FILE or set "
            f"{TOKEN_ENV}; --insecure-no-auth disables authentication"
        )
    if token is not None and insecure_no_auth:
        raise ConfigError("a token and --insecure-no-auth were both given; choose one")
    server = PeerServer(
        listen,
        memory_limit=memory_limit,
        token=token,
        max_frame=max_frame,
        max_connections=max_connections,
        idle_timeout=idle_timeout,
        keepalive=keepalive,
        **limits,
    )
    if token is None and server._host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("authentication is OFF on a non-loopback address %s", listen)
    if stop is not None:
        server.start()
        try:
            if announce is not None:
                announce(server.address)
            stop.wait()
        finally:
            server.stop()
        return
    signals = {signal.SIGTERM, signal.SIGINT}
    # Blocked before any thread starts, so every thread inherits the mask and a signal
    # waits, pending, for sigwait below (no handler runs in the middle of anything).
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        server.start()
        try:
            if announce is not None:
                announce(server.address)
            received = signal.sigwait(signals)
            log.info("received %s, shutting down", signal.Signals(received).name)
        finally:
            server.stop()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def peer_status(
    address: str,
    *,
    token: bytes | str | None = None,
    token_file: str | None = None,
    timeout: float = 10.0,
) -> dict[str, Any]:
    """Ask the daemon at ``HOST:PORT`` what it holds (the ``stats`` reply as a dict).

    The token comes from ``token``, ``token_file`` or ``TIERCHECK_PEER_TOKEN``. Raises
    ``TierUnavailable`` when the daemon cannot be reached.
    """
    from tiercheck.backends._peer import PeerTier

    tier = PeerTier(f"peer://{address}", token=token, token_file=token_file, timeout=timeout)
    try:
        return tier.stats()
    finally:
        tier.close()


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tiercheck peer serve`` (shared with ``python -m``)."""
    parser.add_argument("--listen", required=True, metavar="HOST:PORT", help="address to bind")
    parser.add_argument(
        "--memory-limit",
        required=True,
        type=parse_size,
        metavar="SIZE",
        help="bytes of blobs and log records to hold, e.g. 64GiB",
    )
    parser.add_argument(
        "--token-file", metavar="FILE", help=f"shared-secret token file (else ${TOKEN_ENV})"
    )
    parser.add_argument(
        "--insecure-no-auth", action="store_true", help="accept clients without a token"
    )
    parser.add_argument(
        "--max-frame",
        type=parse_size,
        default=DEFAULT_MAX_FRAME,
        metavar="SIZE",
        help="largest frame accepted (default 64MiB)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"authenticated connections (default {DEFAULT_MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--max-unauthenticated",
        type=int,
        default=DEFAULT_MAX_UNAUTHENTICATED,
        metavar="N",
        help="connections still in their handshake, counted apart from authenticated ones "
        f"(default {DEFAULT_MAX_UNAUTHENTICATED})",
    )
    parser.add_argument(
        "--max-unauthenticated-per-address",
        type=int,
        default=DEFAULT_MAX_UNAUTHENTICATED_PER_ADDRESS,
        metavar="N",
        help=f"of those, from one address (default {DEFAULT_MAX_UNAUTHENTICATED_PER_ADDRESS})",
    )
    parser.add_argument(
        "--handshake-timeout",
        type=float,
        default=DEFAULT_HANDSHAKE_TIMEOUT,
        metavar="SECONDS",
        help=f"total time from connect to hello answered (default {DEFAULT_HANDSHAKE_TIMEOUT:g})",
    )
    parser.add_argument(
        "--frame-timeout",
        type=float,
        default=DEFAULT_FRAME_TIMEOUT,
        metavar="SECONDS",
        help="time a frame may take from its first byte, besides its length at "
        f"--min-rate (default {DEFAULT_FRAME_TIMEOUT:g})",
    )
    parser.add_argument(
        "--min-rate",
        type=parse_size,
        default=DEFAULT_MIN_RATE,
        metavar="SIZE",
        help="bytes a second a frame's body must keep up (default 1MiB)",
    )
    parser.add_argument(
        "--namespace-quota",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="most one namespace may hold, payload and overhead (default: the memory limit)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=_seconds_or_off,
        default=DEFAULT_IDLE_TIMEOUT,
        metavar="SECONDS",
        help="close a connection that sends nothing for this long; 0 never "
        f"(default {DEFAULT_IDLE_TIMEOUT:g})",
    )
    parser.add_argument(
        "--keepalive",
        type=_seconds_or_off,
        default=DEFAULT_KEEPALIVE,
        metavar="SECONDS",
        help="TCP keepalive probes after this much silence, to drop connections of dead "
        f"nodes; 0 off (default {DEFAULT_KEEPALIVE:g})",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")


def _seconds_or_off(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if value < 0 or value != value:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value or None


def run_serve(args: argparse.Namespace) -> int:
    """Run ``tiercheck peer serve`` from parsed arguments; prints ``listening on HOST:PORT``."""
    logging.basicConfig(
        level=str(args.log_level).upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        token = load_token_file(args.token_file) if args.token_file else token_from_env()
        if args.insecure_no_auth and not args.token_file:
            token = None
        serve(
            args.listen,
            memory_limit=args.memory_limit,
            token=token,
            max_frame=args.max_frame,
            insecure_no_auth=args.insecure_no_auth,
            max_connections=args.max_connections,
            idle_timeout=args.idle_timeout,
            keepalive=args.keepalive,
            announce=lambda address: print(f"listening on {address}", flush=True),
            max_unauthenticated=args.max_unauthenticated,
            max_unauthenticated_per_address=args.max_unauthenticated_per_address,
            handshake_timeout=args.handshake_timeout,
            frame_timeout=args.frame_timeout,
            min_rate=args.min_rate,
            namespace_quota=args.namespace_quota,
        )
    except (ConfigError, ValueError, OSError) as exc:
        print(f"tiercheck peer serve: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main_serve(argv: Sequence[str] | None = None) -> int:
    """``tiercheck peer serve --listen HOST:PORT --memory-limit SIZE [...]``."""
    parser = argparse.ArgumentParser(
        prog="tiercheck peer serve", description="Run the peer-memory daemon."
    )
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tiercheck peer status``."""
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument(
        "--token-file", metavar="FILE", help=f"shared-secret token file (else ${TOKEN_ENV})"
    )
    parser.add_argument("--timeout", type=float, default=10.0)


def run_status(args: argparse.Namespace) -> int:
    """Print the daemon's stats as JSON; exit status 1 when it cannot be reached."""
    from tiercheck.errors import TiercheckError

    try:
        stats = peer_status(args.address, token_file=args.token_file, timeout=args.timeout)
    except TiercheckError as exc:
        print(f"tiercheck peer status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2, sort_keys=True))
    return 0


def main_status(argv: Sequence[str] | None = None) -> int:
    """``tiercheck peer status HOST:PORT [--token-file F]``."""
    parser = argparse.ArgumentParser(
        prog="tiercheck peer status", description="Show what a peer daemon holds."
    )
    add_status_arguments(parser)
    return run_status(parser.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tiercheck.peer.daemon [serve] --listen ...`` or ``... status HOST:PORT``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["status"]:
        return main_status(args[1:])
    if args[:1] == ["serve"]:
        args = args[1:]
    return main_serve(args)


if __name__ == "__main__":
    sys.exit(main())
