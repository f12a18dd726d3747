"""Fingerprints: a short digest of a tensor, computed where the tensor lives.

A log version records a fingerprint of every tensor its replay must reproduce; after the
replay the same fingerprints are computed again and compared (SPEC.md section 12.4). Two
algorithms, picked by where the tensor is:

- ``blake3`` (CPU tensors): the first 16 bytes of BLAKE3 of the tensor's bytes, hashed in
  place (no copy). Cryptographic: any difference is caught with probability 1 - 2^-128.
- ``wsum64`` (tensors on an accelerator): the tensor's bytes read as little-endian 32-bit
  words ``w_i`` (the last word zero-padded), and two sums modulo 2^64,
  ``S0 = sum(w_i)`` and ``S1 = sum((2i + 1) * w_i)``, computed on the device with integer
  reductions in blocks of bounded size; only the 16-byte result crosses to the host.
  Exact integer arithmetic, so the result does not depend on the device or the reduction
  order. Any change to one or two words of a tensor under 16 GiB is detected with
  certainty (one word: ``S0`` moves by ``d``, with ``0 < |d| < 2^32``; two words ``i < j``
  with ``S0`` kept need ``2 (j - i) d == 0 mod 2^64``, impossible for ``j - i < 2^32``);
  a change to more words escapes only if it happens to keep both sums, which for the
  differences a different kernel, a manual edit or an EMA makes is a chance of the order
  of 2^-64 per tensor. It is not a defence against a deliberately crafted change.

Why not BLAKE3 everywhere: hashing accelerator memory means copying the whole state to
the host, which is the cost the update log exists to avoid. Why not ``wsum64`` on CPU:
the widening and products cost several passes over memory; BLAKE3 costs one.

Non-tensor values (a step counter kept as a Python number) get the ``value`` algorithm:
the digest is the value's msgpack encoding itself (SPEC.md section 8).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import blake3

from tiercheck.core.entries import encode_scalar
from tiercheck.core.sharded import local_tensor
from tiercheck.formats.manifest import Fingerprint

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALGORITHMS",
    "default_algorithm",
    "differing",
    "fingerprint",
    "fingerprints",
    "wsum64_reference",
]

ALGORITHMS = ("blake3", "wsum64", "value")

# words per block of the device reduction: int64 temporaries of 32 MiB
_BLOCK = 1 << 22
_MASK32 = 0xFFFFFFFF
_TREE_PARALLEL_MIN = 1 << 20
_U64 = 1 << 64


def default_algorithm(t: torch.Tensor) -> str:
    """``blake3`` for a CPU tensor, ``wsum64`` for a tensor on any other device."""
    return "blake3" if t.device.type == "cpu" else "wsum64"


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, row-major, as a flat uint8 tensor on its device."""
    import torch

    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    return flat.view(torch.uint8)


def _blake3(t: torch.Tensor) -> bytes:
    raw = _bytes_view(t)
    if raw.device.type != "cpu":
        raw = raw.cpu()
    view = raw.numpy().data
    # large tensors on every core (BLAKE3's tree parallelism), as chunk ids are hashed
    threads = blake3.blake3.AUTO if len(view) >= _TREE_PARALLEL_MIN else 1
    digest: bytes = blake3.blake3(view, max_threads=threads).digest(length=16)
    return digest


def _wsum64_sums(t: torch.Tensor) -> torch.Tensor:
    """``[S0, S1]`` as an int64 tensor on ``t``'s device (two's complement of the u64)."""
    import torch

    raw = _bytes_view(t)
    n = raw.numel()
    m = n // 4
    dev = raw.device
    acc = torch.zeros(2, dtype=torch.int64, device=dev)
    if m:
        body = raw[: 4 * m]
        try:
            words = body.view(torch.int32)
        except RuntimeError:  # a view whose start is not 4-byte aligned: copy it once
            words = body.clone().view(torch.int32)
        weights = torch.arange(1, 2 * min(m, _BLOCK), 2, dtype=torch.int64, device=dev)
        for start in range(0, m, _BLOCK):
            w = words[start : start + _BLOCK].to(torch.int64)
            w.bitwise_and_(_MASK32)
            s0 = w.sum()
            # sum of (2(start + j) + 1) * w_j = sum((2j + 1) w_j) + 2 start * sum(w_j)
            w.mul_(weights[: w.numel()])
            acc[0] += s0
            acc[1] += w.sum() + s0 * (2 * start)
    tail = raw[4 * m :]
    if tail.numel():
        scale = torch.tensor([1, 1 << 8, 1 << 16], dtype=torch.int64, device=dev)
        word = (tail.to(torch.int64) * scale[: tail.numel()]).sum()
        acc[0] += word
        acc[1] += word * (2 * m + 1)
    return acc


def _wsum64_digest(sums: Iterable[int]) -> bytes:
    return struct.pack("<QQ", *(int(s) % _U64 for s in sums))


def wsum64_reference(data: bytes) -> bytes:
    """``wsum64`` of ``data`` computed in plain Python, from SPEC.md section 12.4 alone."""
    padded = data + bytes(-len(data) % 4)
    s0 = s1 = 0
    for i in range(len(padded) // 4):
        w = int.from_bytes(padded[4 * i : 4 * i + 4], "little")
        s0 += w
        s1 += (2 * i + 1) * w
    return _wsum64_digest((s0, s1))


def fingerprint(value: Any, algo: str | None = None) -> Fingerprint:
    """The fingerprint of one tensor (or non-tensor value) with ``algo`` or the default."""
    return fingerprints({"": value}, {"": algo} if algo else None)[""]


def fingerprints(
    values: Mapping[str, Any], algos: Mapping[str, str] | None = None
) -> dict[str, Fingerprint]:
    """Fingerprint every value of ``values`` by name.

    ``algos`` may name the algorithm per name (a replay asks for the ones recorded at
    save); otherwise each tensor gets :func:`default_algorithm`. The device sums of every
    ``wsum64`` tensor are queued first and brought to the host in one transfer, so the
    call synchronises with each device once. A DTensor (FSDP2) is fingerprinted by its
    local piece: each rank checks its own shard, with no collective.
    """
    import torch

    out: dict[str, Fingerprint] = {}
    pending: list[tuple[str, torch.Tensor]] = []
    for name, value in values.items():
        if not isinstance(value, torch.Tensor):
            algo = algos.get(name, "value") if algos else "value"
            if algo != "value":
                raise ValueError(f"{name}: {algo} fingerprints tensors; this is a {type(value)}")
            _, packed = encode_scalar(value, name, allow_pickle=False)
            out[name] = Fingerprint("value", packed)
            continue
        value = local_tensor(value)
        algo = (algos.get(name) if algos else None) or default_algorithm(value)
        if algo == "blake3":
            out[name] = Fingerprint("blake3", _blake3(value))
        elif algo == "wsum64":
            pending.append((name, _wsum64_sums(value)))
        else:
            raise ValueError(f"{name}: unknown fingerprint algorithm {algo!r}")
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, sums in pending:
        by_device.setdefault(sums.device, []).append((name, sums))
    for group in by_device.values():
        host = torch.stack([s for _, s in group]).cpu().tolist()
        for (name, _), pair in zip(group, host):
            out[name] = Fingerprint("wsum64", _wsum64_digest(pair))
    return {name: out[name] for name in values}


def differing(expected: Mapping[str, Fingerprint], actual: Mapping[str, Fingerprint]) -> list[str]:
    """Names whose fingerprints differ, or that only one side has, sorted."""
    names = set(expected) | set(actual)
    return sorted(n for n in names if expected.get(n) != actual.get(n))
