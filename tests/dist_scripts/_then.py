"""Several runs in one torchrun launch: a worker's command line holds theirs one after
another, separated by ``then``, so that the ranks start (and import torch) once for all."""

from __future__ import annotations


def command_lines(argv: list[str]) -> list[list[str]]:
    """``argv`` cut at each ``then``: ``a b then c`` gives ``[["a", "b"], ["c"]]``."""
    lines: list[list[str]] = [[]]
    for arg in argv:
        if arg == "then":
            lines.append([])
        else:
            lines[-1].append(arg)
    return lines
