"""``tiercheck peer serve``, ``peer status`` and ``peer token``: the peer-memory daemon."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from tiercheck.cli.common import UsageError, emit_json, human_size, make_console, plain
from tiercheck.errors import (
    ConfigError,
    InvalidURL,
    TierError,
)


def cmd_peer_serve(args: argparse.Namespace) -> int:
    from tiercheck.backends._peer_protocol import load_token_file, token_from_env
    from tiercheck.peer import daemon as peer_daemon

    if not args.json:
        return peer_daemon.run_serve(args)
    logging.basicConfig(level=str(args.log_level).upper(), stream=sys.stderr)
    try:
        token = load_token_file(args.token_file) if args.token_file else token_from_env()
        peer_daemon.serve(
            args.listen,
            memory_limit=args.memory_limit,
            token=None if args.insecure_no_auth and not args.token_file else token,
            max_frame=args.max_frame,
            insecure_no_auth=args.insecure_no_auth,
            max_connections=args.max_connections,
            idle_timeout=args.idle_timeout,
            keepalive=args.keepalive,
            announce=lambda address: print(json.dumps({"listening": address}), flush=True),
        )
    except (ConfigError, ValueError, OSError) as exc:
        raise UsageError(f"peer serve: {exc}") from None
    return 0


def cmd_peer_status(args: argparse.Namespace) -> int:
    from tiercheck.backends._peer_protocol import PeerRejected
    from tiercheck.peer import daemon as peer_daemon

    try:
        stats = peer_daemon.peer_status(
            args.address, token_file=args.token_file, timeout=args.timeout
        )
    except InvalidURL as exc:
        raise UsageError(str(exc)) from None
    except TierError as exc:
        cause = exc.__cause__
        if isinstance(cause, PeerRejected) and cause.code == "NoToken":
            # the library's message names its arguments (token=, token_file=), not the flag
            raise UsageError(
                f"peer status: the daemon at {args.address} requires a token: "
                "--token-file FILE or TIERCHECK_PEER_TOKEN"
            ) from None
        raise
    if args.json:
        emit_json(stats)
        return 0
    from rich.table import Table

    t = Table(title=f"peer {plain(args.address)}", title_justify="left")
    t.add_column("field")
    t.add_column("value")
    for k, value in sorted(stats.items()):
        shown = human_size(value) if "bytes" in k and isinstance(value, int) else str(value)
        t.add_row(plain(k), plain(shown))
    make_console().print(t)
    return 0


def cmd_peer_token(args: argparse.Namespace) -> int:
    from tiercheck.backends._peer_protocol import load_token_file, token_from_env
    from tiercheck.peer.server import namespace_token

    try:
        admin = load_token_file(args.token_file) if args.token_file else token_from_env()
    except (OSError, ValueError) as exc:
        raise UsageError(f"peer token: {exc}") from None
    if admin is None:
        raise UsageError(
            "peer token needs the daemon's token: --token-file FILE or TIERCHECK_PEER_TOKEN"
        )
    token = namespace_token(admin, args.namespace).decode()
    if args.json:
        emit_json({"namespace": args.namespace, "token": token})
    else:
        print(token)
    return 0
