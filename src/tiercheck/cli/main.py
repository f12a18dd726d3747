"""The ``tiercheck`` command line (also ``python -m tiercheck``).

Commands: ``ls``, ``show``, ``diff``, ``verify``, ``gc`` (also ``gc --orphans``), ``rm``,
``adopt``, ``export``, ``migrate``, ``peer serve`` / ``peer status`` / ``peer token`` and ``plan``.
Every command takes ``--json`` for scripts (stable keys, one JSON document on stdout). Long
commands draw a progress bar on stderr when it is a terminal and stay quiet otherwise. Exit
status: 0 ok, 1 problems found (or an operation failed), 2 usage errors (bad arguments,
store root, version, tier or output path), each reported as one line on stderr.

Commands that only read open the store read-only (no writer lock), so they work next to a
running trainer; ``verify --repair``, ``gc`` (without ``--dry-run``) and ``migrate`` to one
of the store's own tiers take the writer lock.

The engine is imported by the commands that open a store, not at import: ``peer serve``,
``peer status`` and ``--help`` start without it (and without torch, which it imports).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

from tiercheck.cli.browse import cmd_diff, cmd_ls, cmd_show
from tiercheck.cli.common import (
    UsageError,
    nonneg_float,
    nonneg_int,
    parse_size,
    positive_float,
    positive_int,
)
from tiercheck.cli.export import cmd_export
from tiercheck.cli.manage import cmd_adopt, cmd_gc, cmd_migrate, cmd_rm
from tiercheck.cli.peer import cmd_peer_serve, cmd_peer_status, cmd_peer_token
from tiercheck.cli.plan import cmd_plan
from tiercheck.cli.verify import cmd_verify

__all__ = ["build_parser", "main"]

PROG = "tiercheck"


class _BadArguments(Exception):
    """A usage error argparse found; its message, for :func:`main` to report."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser (its subcommands' too) whose usage errors :func:`main` reports
    as any other, so that ``--json`` prints the error document for them as well."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        raise _BadArguments(message)


def build_parser() -> argparse.ArgumentParser:
    """The full ``tiercheck`` argument parser (docs/gen_cli.py renders it to docs/cli.md)."""
    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document")
    common.add_argument(
        "-v", "--verbose", action="store_true", help="show tiercheck's log and tracebacks"
    )
    version_help = "a version id (also 'version:N'), 'latest' or 'step:N'"
    root_help = (
        "store root (the directory with tiercheck.toml), a DCP root (TierWriter's, with one "
        "store per rank), or a tier URL such as one `migrate --to` wrote (read-only)"
    )
    url_help = "store root, or a tier URL (read-only)"

    parser = _Parser(
        prog=PROG,
        description="Browse and manage tiercheck checkpoint stores.",
        epilog="Exit status: 0 ok, 1 problems found, 2 usage error.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "ls",
        parents=[common],
        help="list the versions of a store",
        description="List every committed version: step, role (base; diff of N; log of N: "
        "the state of N with the optimizer steps logged since replayed), time, sizes (of the "
        "state, and stored in its tiers) and, per tier, committed / migrating / missing / "
        "dropped / unreachable. Reads the logs only.",
    )
    p.add_argument("root", metavar="ROOT", help=root_help)
    p.add_argument("--limit", type=nonneg_int, metavar="N", help="only the newest N versions")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "show",
        parents=[common],
        help="show one version: entries, chunks, ratios, metadata",
        description="Show a version: the entries of its state (dtype, shape, size), chunks, "
        "dedup ratio, changed chunks against its base, per-tier stored bytes, and metadata. "
        "For a log version: the replay chain, what it stores (logged gradients, own leaves) "
        "and which entries its replay reproduces from the base. Reads the shard manifests "
        "only (a log version's and its base's).",
    )
    p.add_argument("root", metavar="ROOT", help=url_help)
    p.add_argument("version", metavar="VERSION", help=version_help)
    p.add_argument("--rank", type=nonneg_int, metavar="N", help="shard of rank N (default 0)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser(
        "diff",
        parents=[common],
        help="compare two versions entry by entry",
        description="List entries added, removed, changed (max abs difference, relative L2 "
        "change) and unchanged between the states of versions A and B. Entries whose chunks "
        "are identical are decided without reading data. A log version's replayed entries "
        "are read by replaying its log as export does, so `diff BASE LOG` shows what the "
        "logged optimizer steps changed.",
    )
    p.add_argument("root", metavar="ROOT", help=url_help)
    p.add_argument("a", metavar="A", help=version_help)
    p.add_argument("b", metavar="B", help=version_help)
    p.add_argument("--rank", type=nonneg_int, metavar="N", help="shard of rank N (default 0)")
    p.add_argument("--unchanged", action="store_true", help="also list unchanged entries")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser(
        "verify",
        parents=[common],
        help="re-hash every blob of every kept version",
        description="Read and re-hash every blob (manifests, chunks, delta bases) of every "
        "version each tier keeps. Exit status 1 if a problem remains. With --repair, bad or "
        "missing copies are rewritten from an intact copy in another tier (takes the writer "
        "lock). A blob written by a newer major format is reported as newer-format (upgrade "
        "tiercheck to check it) and left as it is.",
    )
    p.add_argument("root", metavar="ROOT", help=root_help)
    p.add_argument(
        "--tier",
        action="append",
        metavar="NAME",
        help="check only this tier (name or URL; repeatable)",
    )
    p.add_argument("--repair", action="store_true", help="repair from another tier")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "gc",
        parents=[common],
        help="delete blobs no kept version references, or orphaned shm segments",
        description="Apply each tier's retention, then mark and sweep every tier: blobs "
        "referenced by no version the tier keeps are deleted once past the grace period. "
        "Takes the writer lock unless --dry-run. A tier shared with a process that is "
        "writing to it is skipped (its write lease says so). With --orphans (and no ROOT): "
        "list your shm segments on this node whose store is gone or no longer names them; "
        "--yes deletes them.",
    )
    p.add_argument("root", metavar="ROOT", nargs="?", help="store root")
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    p.add_argument(
        "--orphans",
        action="store_true",
        help="find shm segments of deleted stores on this node (a dry run unless --yes)",
    )
    p.add_argument(
        "--yes", "--delete", dest="yes", action="store_true", help="with --orphans: delete them"
    )
    p.add_argument(
        "--shm-root",
        action="append",
        metavar="DIR",
        help="with --orphans: shm root to scan (repeatable; default /dev/shm/tiercheck-UID, yours)",
    )
    p.add_argument(
        "--grace",
        type=nonneg_float,
        metavar="SECONDS",
        help="grace period for this run (default: the policy's); a blob's age counts from "
        "when it was written where the tier says (file mtime, object time, LMDB), else "
        "from now; 0 deletes at once",
    )
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser(
        "rm",
        parents=[common],
        help="delete a store with its shm segments and LMDB",
        description="Delete the store at ROOT: the root directory, the shm segments it owns "
        "(also those a deleted root left behind) and its LMDB environments. Refused while a "
        "process holds the store open for writing. Remote tiers outside the root and peer "
        "daemons are kept and listed. A DCP root (one store per rank in ROOT/rank{r}) is "
        "deleted rank by rank, none if any is held open. ROOT may also be shm://NAME: a "
        "segment that is no store's tier (one `migrate --to` wrote, or a deleted store's).",
    )
    p.add_argument("root", metavar="ROOT", help="store root, DCP root, or shm://NAME")
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser(
        "adopt",
        parents=[common],
        help="make a copied store root a store of its own",
        description="A copy of a store root (cp -r, or a copied tiercheck.toml) has the "
        "original's store id, and opens read-only while the original is there. adopt gives "
        "ROOT a new store id and new shm segment names, and records it as the owner of the "
        "tiers inside ROOT (their versions become its own). Tiers outside ROOT stay their "
        "owner's. Refused while a process holds ROOT open for writing.",
    )
    p.add_argument("root", metavar="ROOT", help="store root")
    p.set_defaults(func=cmd_adopt)

    p = sub.add_parser(
        "export",
        parents=[common],
        help="write a version to .safetensors or .pt",
        description="Export a version's entries to OUT: .safetensors (tensors only; version, "
        "step and metadata in the header) or .pt/.pth (a flat dict that loads with "
        "torch.load(weights_only=True)). Keys are the flattened paths, e.g. "
        "model/layers.0.weight; with --only PREFIX only those entries, the prefix removed. "
        "A log version is replayed first: its base's tensors, with the logged optimizer "
        "steps (a torch.optim optimizer, under the run's torch version and device type).",
    )
    p.add_argument("root", metavar="ROOT", help=root_help)
    p.add_argument("version", metavar="VERSION", help=version_help)
    p.add_argument("out", metavar="OUT", help="output file (.safetensors, .pt or .pth)")
    p.add_argument("--only", metavar="PREFIX", help="only entries under PREFIX, e.g. model/")
    p.add_argument("--keep-prefix", action="store_true", help="keep PREFIX in the keys")
    p.add_argument("--rank", type=nonneg_int, metavar="N", help="shard of rank N (default 0)")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "migrate",
        parents=[common],
        help="copy a version (and its base) to a tier",
        description="Copy a version, every rank's shard and the base it needs, to --to: one "
        "of the store's tiers (name or URL; takes the writer lock) or any tier URL, which "
        "then holds a self-contained copy (browse it with `tiercheck ls URL`).",
    )
    p.add_argument("root", metavar="ROOT", help="store root")
    p.add_argument("version", metavar="VERSION", help=version_help)
    p.add_argument("--to", required=True, metavar="URL", help="target tier name or URL")
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser(
        "peer",
        help="run or query a peer-memory daemon",
        description="The peer-memory daemon that serves peer:// tiers.",
    )
    peer = p.add_subparsers(dest="peer_command", metavar="COMMAND", required=True)
    from tiercheck.peer import daemon as peer_daemon

    ps = peer.add_parser(
        "serve",
        parents=[common],
        help="run the daemon",
        description="Run the peer-memory daemon until SIGTERM/SIGINT; prints the bound "
        "address once clients can connect.",
    )
    peer_daemon.add_serve_arguments(ps)
    ps.set_defaults(func=cmd_peer_serve)
    pq = peer.add_parser(
        "status",
        parents=[common],
        help="show what a daemon holds",
        description="Ask the daemon at HOST:PORT for its statistics. Exit status 1 if it "
        "cannot be reached.",
    )
    peer_daemon.add_status_arguments(pq)
    pq.set_defaults(func=cmd_peer_status)
    pt = peer.add_parser(
        "token",
        parents=[common],
        help="print the token of one namespace",
        description="Print the token that opens NAMESPACE only, derived from the daemon's "
        "token (--token-file or TIERCHECK_PEER_TOKEN). Give each rank its own namespace's "
        "token: it cannot read, overwrite or delete another namespace. Store it in a file "
        "of mode 0600 and pass it as the tier's token_file option.",
    )
    pt.add_argument("namespace", metavar="NAMESPACE")
    pt.add_argument(
        "--token-file", metavar="FILE", help="the daemon's token file (else $TIERCHECK_PEER_TOKEN)"
    )
    pt.set_defaults(func=cmd_peer_token)

    p = sub.add_parser(
        "plan",
        parents=[common],
        help="plan checkpoint intervals and compare tier designs at scale",
        description="Simulate a job of --gpus GPUs under a failure model (default: the 419 "
        "interruptions of a 54-day run on 16,384 GPUs) with tier costs measured by "
        "tiercheck's benchmarks and scaled to the target hardware, for a single remote tier, "
        "tiercheck's default store and the full tiered store, each with and without log "
        "versions. Prints each design's best interval, goodput and gain over the single "
        "remote tier, and per tier and failure class the interval (simulated, Young, Daly), "
        "lost work and recovery time. Model and sources: docs/goodput.md.",
    )
    p.add_argument("--gpus", type=positive_int, default=16384, metavar="N", help="GPUs (16384)")
    p.add_argument(
        "--gpus-per-node",
        type=positive_int,
        metavar="N",
        help="GPUs per node (8, or --gpus if fewer)",
    )
    p.add_argument(
        "--state-per-rank",
        type=parse_size,
        default="4GB",
        metavar="SIZE",
        help="largest rank's checkpointed state, e.g. 4GB, 512MiB (4GB)",
    )
    p.add_argument(
        "--mean-state-per-rank",
        type=parse_size,
        metavar="SIZE",
        help="mean bytes a rank adds to the shared remote tier (396MB, 405e9 params x 16 B "
        "over 16384 GPUs, or --state-per-rank if smaller)",
    )
    p.add_argument(
        "--step-time", type=positive_float, default=5.9, metavar="SECONDS", help="step (5.9)"
    )
    p.add_argument(
        "--days", type=positive_float, default=54.0, metavar="DAYS", help="run length (54)"
    )
    p.add_argument("--failures", metavar="FILE", help="failure model TOML (see --write-failures)")
    p.add_argument("--hardware", metavar="FILE", help="target bandwidths TOML (--write-hardware)")
    p.add_argument(
        "--remote-gbps",
        type=positive_float,
        metavar="GBPS",
        help="remote store aggregate GB/s, both ways (overrides the hardware's; 2000)",
    )
    p.add_argument(
        "--bench", metavar="DIR", help="read measured tier rates from a benchmarks/results DIR"
    )
    p.add_argument(
        "--design",
        action="append",
        metavar="NAME",
        help="only this design (repeatable): remote, remote+log, local+remote, "
        "local+remote+log, tiered, tiered+log",
    )
    p.add_argument(
        "--log-bytes-per-step",
        type=positive_float,
        default=0.35,
        metavar="F",
        help="log version bytes per logged step, x the state (0.35)",
    )
    p.add_argument("--runs", type=positive_int, default=16, metavar="N", help="seeds (16)")
    p.add_argument("--seed", type=nonneg_int, default=0, metavar="N", help="first seed (0)")
    p.add_argument(
        "--config-out", metavar="FILE", help="write the recommended tiercheck.toml to FILE"
    )
    p.add_argument(
        "--write-failures", metavar="FILE", help="write the default failure model and exit"
    )
    p.add_argument(
        "--write-hardware", metavar="FILE", help="write the default hardware model and exit"
    )
    p.set_defaults(func=cmd_plan)
    return parser


def _fail(code: int, message: str, *, as_json: bool = False) -> int:
    """Report a failure as one line on stderr (and, with ``--json``, as one JSON document
    ``{"error": ..., "exit_status": ...}`` on stdout, so a script reading stdout sees it)."""
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    print(f"{PROG}: error: {first}", file=sys.stderr)
    if as_json:
        print(json.dumps({"error": first, "exit_status": code}))
    return code


def _library_error(exc: BaseException) -> str:
    """One line naming a library's own error: ``botocore NoCredentialsError: ...``."""
    module = type(exc).__module__.partition(".")[0]
    origin = "" if module in ("builtins", "tiercheck") else f"{module} "
    return f"{origin}{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def _logging_for(verbose: bool) -> Iterator[None]:
    """Quiet tiercheck's logger for the command (it reports problems itself); restored after,
    so that calling :func:`main` in a process leaves its logging as it was."""
    logger = logging.getLogger("tiercheck")
    level = logger.level
    handler: logging.Handler | None = None
    if verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    else:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)
        if handler is not None:
            logger.removeHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _BadArguments as exc:
        given = sys.argv[1:] if argv is None else argv
        return _fail(2, str(exc), as_json="--json" in given)
    except SystemExit as exc:  # argparse: --help
        return int(exc.code) if isinstance(exc.code, int) else 2
    func: Callable[[argparse.Namespace], int] = args.func
    verbose = bool(getattr(args, "verbose", False))
    as_json = bool(getattr(args, "json", False))
    try:
        if func is cmd_peer_serve:  # configures its own logging
            return func(args)
        with _logging_for(verbose):
            return func(args)
    except UsageError as exc:
        return _fail(2, str(exc), as_json=as_json)
    except KeyboardInterrupt:
        return _fail(130, "interrupted", as_json=as_json)
    except BrokenPipeError:
        return 0
    except Exception as exc:
        # tiercheck's typed errors, and the ones a backend library raises as its own
        # (botocore's NoCredentialsError, lmdb.Error, fsspec's, ...): one line, not a
        # traceback; -v shows the traceback
        if verbose:
            raise
        return _fail(1, _library_error(exc), as_json=as_json)
