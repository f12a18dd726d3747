"""Byte sizes written by people: ``"8GiB"``, ``"512MiB"``, ``"1G"``, ``"1GB"``, ``4096``;
and what a tree of files takes on disk (:func:`tree_bytes`).

One reading everywhere a size is given (tier ``budget`` options, ``tiercheck peer serve
--memory-limit``): a bare unit letter (``K``, ``M``, ``G``, ``T``, ``P``) and the ``KiB``
forms are powers of 1024; ``KB``, ``MB``, ``GB``, ``TB``, ``PB`` are powers of 1000; units
are case-insensitive and ``B`` or nothing means bytes. The arithmetic is bitmath's; this
module only maps the spellings people use onto bitmath's unit names (bitmath alone reads
``kb`` as kilobits and refuses ``KB``).
"""

from __future__ import annotations

import os
import re

import bitmath

__all__ = ["format_size", "parse_size", "tree_bytes"]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_PREFIXES = "KMGTP"
_SI_NAMES = {"K": "kB", "M": "MB", "G": "GB", "T": "TB", "P": "PB"}


def _unit_name(unit: str) -> str | None:
    """bitmath's name for a unit as people write it, or None if it is not one."""
    u = unit.upper()
    if u in ("", "B"):
        return "Byte"
    prefix, rest = u[0], u[1:]
    if prefix not in _PREFIXES:
        return None
    if rest in ("", "I", "IB"):
        return f"{prefix}iB"
    if rest == "B":
        return _SI_NAMES[prefix]
    return None


def parse_size(text: str | int) -> int:
    """Parse a byte size (see the module docstring); ``ValueError`` for anything else.

    An ``int`` is taken as bytes. Fractions are allowed (``"1.5G"``) and rounded down to a
    whole byte. Negative sizes are refused.
    """
    if isinstance(text, bool):
        raise ValueError(f"invalid size {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"invalid size {text!r}: negative")
        return text
    if not isinstance(text, str):
        raise ValueError(f"invalid size {text!r}: expected e.g. 4096, 512MiB, 8GiB, 1G")
    m = _SIZE_RE.match(text)
    name = _unit_name(m.group(2)) if m else None
    if m is None or name is None:
        raise ValueError(f"invalid size {text!r}: expected e.g. 4096, 512MiB, 8GiB, 1G")
    number = m.group(1)
    if name == "Byte":
        return int(float(number))
    return int(bitmath.parse_string(f"{number} {name}", strict=True).bytes)


def format_size(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units, one decimal)."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    best = bitmath.Byte(n).best_prefix(system=bitmath.NIST)
    return f"{best.value:.1f} {best.unit}"


def tree_bytes(root: str | os.PathLike[str], *, apparent: bool = False) -> int:
    """What the files under ``root`` take: allocated blocks (what a disk or tmpfs charges),
    or their sizes (``apparent``; a sparse file counts whole). A file deleted meanwhile
    counts nothing."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            total += st.st_size if apparent else st.st_blocks * 512
    return total
