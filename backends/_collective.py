"""``collective://NAME``: a partner rank's node memory, reached over torch.distributed.

Each rank replicates to a **partner** rank on another node; the partner keeps the blobs
and log records in its own node's shared memory (a ``shm://`` store named after the
sender), and sends them back when the sender restores, e.g. on a replaced node whose own
shm and disk are empty. The default partner of rank ``r`` is
``(r + ranks_per_node) % world_size``; the option ``partners`` (a list, entry ``r`` is
rank ``r``'s partner) sets another permutation.

Transport: point-to-point ``send``/``recv`` of uint8 tensors on a dedicated gloo group
that this tier creates (never the trainer's group). Blob bytes live in host memory here
(the staging buffer), so gloo moves them without a device round trip under an NCCL job
too. Every rank runs one server thread answering its **source** (the rank whose partner
it is); requests and replies are msgpack headers plus raw payloads — nothing is pickled.

Options: ``ranks_per_node`` (default ``LOCAL_WORLD_SIZE``), ``partners``, ``store``
(default ``"shm://{name}-from-{src}"``), ``shm_root`` (the shm root on the partner's node),
``budget`` (most bytes the store held for the source may take on this node, a size such as
``"8GiB"``: writes past it raise ``OverBudget`` on the source), ``timeout`` (seconds for the
group's operations). Every rank must open the tier, in the
same order relative to other process-group creation (the registry does this when each
rank's ``Checkpointer`` opens its tiers). With one rank, or a partner equal to the rank
itself, the store is local and nothing crosses the network. A partner on the rank's own
node (one node, or such ``partners``) keeps its copies in memory that a lost node takes
with it: the tier then declares it survives a crashed process only, and versions
acknowledged in such memory tiers alone are recorded as the ack ledger's
(:mod:`tiercheck.restore.losses`), reported if a reboot loses them.
"""

from __future__ import annotations

import builtins
import dataclasses
import datetime
import logging
import os
import socket
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import msgpack
import numpy as np
import torch

from tiercheck.backends.base import (
    Buffer,
    Capabilities,
    FailureDomain,
    Tier,
    check_blob_id,
    invalid_url,
    parse_budget,
)
from tiercheck.backends.registry import open_tier
from tiercheck.errors import NotFound, OverBudget, TierError, TierFull, TierUnavailable

__all__ = ["CollectivePeerTier"]

log = logging.getLogger(__name__)

_REQUEST = 11
_REPLY = 12
COLLECTIVE_CAPABILITIES = Capabilities(
    survives=FailureDomain.NODE, shared=False, persistent=False, speed_rank=25
)


def _send(dst: int, tag: int, header: dict[str, Any], data: Buffer | None, group: Any) -> None:
    import torch.distributed as dist

    head = msgpack.packb(header, use_bin_type=True)
    payload = b"" if data is None else data
    n = len(memoryview(payload).cast("B")) if payload else 0
    dist.send(torch.tensor([len(head), n], dtype=torch.int64), dst, group=group, tag=tag)
    dist.send(torch.frombuffer(bytearray(head), dtype=torch.uint8), dst, group=group, tag=tag)
    if n:
        t = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy())
        dist.send(t, dst, group=group, tag=tag)


def _recv(src: int, tag: int, group: Any) -> tuple[dict[str, Any], bytes]:
    import torch.distributed as dist

    sizes = torch.zeros(2, dtype=torch.int64)
    dist.recv(sizes, src, group=group, tag=tag)
    head = torch.empty(int(sizes[0]), dtype=torch.uint8)
    dist.recv(head, src, group=group, tag=tag)
    header = msgpack.unpackb(head.numpy().tobytes(), raw=False)
    data = b""
    if int(sizes[1]):
        body = torch.empty(int(sizes[1]), dtype=torch.uint8)
        dist.recv(body, src, group=group, tag=tag)
        data = body.numpy().tobytes()
    if not isinstance(header, dict):
        raise TierError("malformed collective peer message")
    return header, data


def _bind(held: Tier, root: str, host: str) -> None:
    """Record the source's store (on node ``host``) as the owner of what is held for it."""
    from tiercheck.backends._shm import ShmTier

    if isinstance(held, ShmTier):
        held.bind_store(root, host=host)
    else:
        held.bind_store(root)


class CollectivePeerTier(Tier):
    """Blobs and log of this rank, held by its partner rank's node (see module doc)."""

    scheme = "collective"

    def __init__(
        self,
        url: str,
        *,
        ranks_per_node: int | None = None,
        partners: builtins.list[int] | None = None,
        store: str | None = None,
        shm_root: str | None = None,
        budget: int | str | None = None,
        timeout: float = 120.0,
        read_only: bool = False,
    ) -> None:
        super().__init__(url, capabilities=COLLECTIVE_CAPABILITIES, read_only=read_only)
        if not url.startswith("collective://") or not url[len("collective://") :]:
            raise invalid_url(url, "expected collective://NAME")
        self.name = url[len("collective://") :].strip("/")
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world = dist.get_world_size() if distributed else 1
        per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        if partners is None:
            partners = [(r + per_node) % self.world for r in range(self.world)]
        if sorted(partners) != builtins.list(range(self.world)):
            raise invalid_url(url, f"partners {partners} is not a permutation of the ranks")
        self.partner = partners[self.rank]
        self.source = partners.index(self.rank)
        if self.partner // per_node == self.rank // per_node:
            # the partner's memory is this node's (one node, or a permutation that keeps a
            # rank on its node): lost with the node, so no survivor of a node loss, and
            # versions acknowledged there alone go to the ack ledger as memory-only ones
            self.capabilities = dataclasses.replace(
                COLLECTIVE_CAPABILITIES, survives=FailureDomain.PROCESS
            )
            log.warning(
                "%s: rank %d's partner, rank %d, is on its own node (%d ranks per node): "
                "its copies do not survive losing the node",
                url,
                self.rank,
                self.partner,
                per_node,
            )
        template = store or f"shm://{self.name}-from-{{src}}"
        options: dict[str, Any] = {"root": shm_root} if shm_root else {}
        self.budget = parse_budget(budget, url)
        if self.budget is not None:
            options["budget"] = self.budget
        # the store this rank keeps for its source (the rank replicating to it)
        self._held = open_tier(template.replace("{src}", str(self.source)), **options)
        self._local = self.partner == self.rank
        self._lock = threading.Lock()
        self._group: Any = None
        self._server: threading.Thread | None = None
        self._broken: str | None = None
        if distributed and self.world > 1:
            self._group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=timeout)
            )
        if not self._local and self._group is not None:
            self._server = threading.Thread(
                target=self._serve, name="tiercheck-collective-peer", daemon=True
            )
            self._server.start()

    # --- the server side: answer the source rank ------------------------------------

    def _serve(self) -> None:
        while True:
            try:
                header, data = _recv(self.source, _REQUEST, self._group)
            except Exception as exc:  # the source died or the group shut down
                log.debug("collective peer server for rank %d stops: %s", self.source, exc)
                return
            op = header.get("op")
            if op == "bye":
                return
            try:
                reply, payload = self._handle(op, header, data)
            except NotFound as exc:
                reply, payload = {"ok": False, "error": "NotFound", "message": str(exc)}, None
            except OverBudget as exc:
                reply = {
                    "ok": False,
                    "error": "OverBudget",
                    "message": str(exc),
                    "needed": exc.needed,
                    "held": exc.held,
                    "budget": exc.budget,
                }
                payload = None
            except TierFull as exc:
                reply, payload = {"ok": False, "error": "TierFull", "message": str(exc)}, None
            except ValueError as exc:
                reply, payload = {"ok": False, "error": "ValueError", "message": str(exc)}, None
            except Exception as exc:
                reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
                payload = None
            try:
                _send(self.source, _REPLY, reply, payload, self._group)
            except Exception as exc:
                log.debug("collective peer reply to rank %d failed: %s", self.source, exc)
                return

    def _handle(
        self, op: Any, header: dict[str, Any], data: bytes
    ) -> tuple[dict[str, Any], bytes | None]:
        held = self._held
        if op == "put":
            return {
                "ok": True,
                "written": held.put(header["id"], data, overwrite=header["ow"]),
            }, None
        if op == "get":
            return {"ok": True}, bytes(held.get(header["id"]))
        if op == "has":
            return {"ok": True, "ids": sorted(held.has(header["ids"]))}, None
        if op == "delete":
            return {"ok": True, "n": held.delete(header["ids"])}, None
        if op == "list":
            return {"ok": True, "ids": builtins.list(held.list())}, None
        if op == "append":
            held.append(data)
            return {"ok": True}, None
        if op == "read_log":
            return {"ok": True}, msgpack.packb(held.read_log(), use_bin_type=True)
        if op == "replace_log_prefix":
            held.replace_log_prefix(int(header["count"]), data)
            return {"ok": True}, None
        if op == "usage":
            return {"ok": True, "bytes": held.usage()}, None
        if op == "set_budget":
            held.set_budget(header["budget"])
            return {"ok": True}, None
        if op == "bind_store":
            _bind(held, str(header["root"]), str(header["host"]))
            return {"ok": True}, None
        raise TierError(f"unknown collective peer request {op!r}")

    # --- the client side: ask the partner ---------------------------------------------

    def _call(
        self, header: dict[str, Any], data: Buffer | None = None
    ) -> tuple[dict[str, Any], bytes]:
        if self._broken is not None:
            raise TierUnavailable(
                f"partner rank {self.partner} unreachable: {self._broken}", url=self.url
            )
        with self._lock:
            try:
                _send(self.partner, _REQUEST, header, data, self._group)
                reply, payload = _recv(self.partner, _REPLY, self._group)
            except Exception as exc:
                self._broken = str(exc)
                raise TierUnavailable(
                    f"partner rank {self.partner} unreachable: {exc}", url=self.url
                ) from None
        if not reply.get("ok"):
            error, message = reply.get("error"), str(reply.get("message"))
            key = header.get("id", "")
            if error == "NotFound":
                raise NotFound(message, url=self.url, key=key)
            if error == "OverBudget":
                budget = reply.get("budget")
                raise OverBudget(
                    f"partner rank {self.partner}: {message}",
                    url=self.url,
                    key=key,
                    needed=int(reply.get("needed") or 0),
                    held=int(reply.get("held") or 0),
                    budget=budget if isinstance(budget, int) else None,
                )
            if error == "TierFull":
                raise TierFull(f"partner rank {self.partner}: {message}", url=self.url, key=key)
            if error == "ValueError":
                raise ValueError(message)
            raise TierError(f"partner rank {self.partner}: {reply.get('message')}", url=self.url)
        return reply, payload

    def put(self, blob_id: str, data: Buffer, *, overwrite: bool = False) -> bool:
        check_blob_id(blob_id, self.url)
        self._check_writable("put")
        if self._local:
            return self._held.put(blob_id, data, overwrite=overwrite)
        reply, _ = self._call({"op": "put", "id": blob_id, "ow": overwrite}, data)
        return bool(reply["written"])

    def get(self, blob_id: str, out: memoryview | None = None) -> memoryview:
        check_blob_id(blob_id, self.url)
        if self._local:
            return self._held.get(blob_id, out)
        _, data = self._call({"op": "get", "id": blob_id})
        return self._copy_out(data, out, self.url, blob_id)

    def has(self, blob_ids: Iterable[str]) -> set[str]:
        ids = builtins.list(blob_ids)
        if self._local:
            return self._held.has(ids)
        reply, _ = self._call({"op": "has", "ids": ids})
        return set(reply["ids"])

    def delete(self, blob_ids: Iterable[str]) -> int:
        self._check_writable("delete")
        ids = builtins.list(blob_ids)
        if self._local:
            return self._held.delete(ids)
        reply, _ = self._call({"op": "delete", "ids": ids})
        return int(reply["n"])

    def list(self) -> Iterator[str]:
        if self._local:
            return self._held.list()
        reply, _ = self._call({"op": "list"})
        return iter(reply["ids"])

    def append(self, record: bytes, *, blobs: Iterable[tuple[str, Buffer]] = ()) -> None:
        self._check_writable("append")
        for blob_id, data in blobs:
            self.put(blob_id, data)
        if self._local:
            self._held.append(record)
            return
        self._call({"op": "append"}, record)

    def read_log(self) -> builtins.list[bytes]:
        if self._local:
            return self._held.read_log()
        _, data = self._call({"op": "read_log"})
        records = msgpack.unpackb(data, raw=False)
        return [bytes(r) for r in records]

    def replace_log_prefix(self, count: int, record: bytes) -> None:
        """Compacted in the store the partner holds (atomic there)."""
        self._check_writable("compact the log")
        if self._local:
            self._held.replace_log_prefix(count, record)
            return
        self._call({"op": "replace_log_prefix", "count": count}, record)

    def usage(self) -> int | None:
        """Bytes of blobs the partner holds for this rank."""
        if self._local:
            return self._held.usage()
        reply, _ = self._call({"op": "usage"})
        value = reply.get("bytes")
        return int(value) if isinstance(value, int) else None

    def free_memory(self) -> int | None:
        """Free memory behind the tier held on this node; None for the partner's memory,
        which is not visible from this node."""
        held: Tier | None = getattr(self, "_held", None)
        if getattr(self, "_local", False) and held is not None:
            return held.free_memory()
        return None

    def set_budget(self, nbytes: int | str | None) -> None:
        """The budget of what the partner holds for this rank (set on the partner)."""
        self.budget = parse_budget(nbytes, self.url)
        if self._local:
            self._held.set_budget(self.budget)
            return
        self._call({"op": "set_budget", "budget": self.budget})

    def bind_store(self, root: str) -> None:
        """The partner records this rank's store as the owner of what it holds."""
        if self.read_only:
            return
        if self._local:
            self._held.bind_store(root)
            return
        self._call({"op": "bind_store", "root": root, "host": socket.gethostname()})

    def close(self) -> None:
        if self._group is not None and not self._local and self._broken is None:
            try:
                with self._lock:
                    _send(self.partner, _REQUEST, {"op": "bye"}, None, self._group)
            except Exception as exc:  # the partner may be gone already
                log.debug("collective peer bye failed: %s", exc)
        if self._server is not None:
            self._server.join(timeout=10)
        self._held.close()
