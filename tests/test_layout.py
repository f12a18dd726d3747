"""The layout DESIGN.md section 2 fixes, checked on the source itself.

Every module of the package (src/tiercheck, backends/ and formats/ as they install) is
parsed with ``ast``; every import counts, at module level, inside a function or under
``if TYPE_CHECKING:``, since each of them ties one module to another for a reader as for
mypy. From that graph: no import cycle; nothing below the CLI imports it; the engine reaches
tiers only through their interface. And the facade stays a facade.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE_ROOTS = {
    "tiercheck": REPO / "src" / "tiercheck",
    "tiercheck.backends": REPO / "backends",
    "tiercheck.formats": REPO / "formats",
}


def _modules() -> dict[str, Path]:
    """Every module by its installed dotted name."""
    out: dict[str, Path] = {}
    for package, root in PACKAGE_ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module of the package that ``name`` (a module or a name in one) lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imported_names(module: str, path: Path) -> set[str]:
    """Every ``tiercheck...`` name ``module`` imports, anywhere in its source: a module,
    or ``module.name`` for ``from module import name``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            out |= {f"{source}.{a.name}" for a in node.names}
    return {n for n in out if n == "tiercheck" or n.startswith("tiercheck.")}


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (itself left out)."""
    return {m: set(targets) for m, targets in _graph().items()}


@functools.cache
def _graph() -> dict[str, frozenset[str]]:
    graph: dict[str, frozenset[str]] = {}
    for module, path in MODULES.items():
        targets = {_owner(n) for n in imported_names(module, path)}
        graph[module] = frozenset(t for t in targets if t is not None and t != module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(graph: dict[str, set[str]], component: Iterable[str]) -> str:
    members = set(component)
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & members))}" for m in sorted(members))


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import tiercheck.errors\n"
        "from tiercheck.store import catalog\n"
        "from . import chunking\n"
        "if TYPE_CHECKING:\n"
        "    from tiercheck.checkpointer import Checkpointer\n"
        "def later():\n"
        "    from tiercheck.history.versions import Version\n"
    )
    names = imported_names("tiercheck.core.probe", source)
    assert {_owner(n) for n in names} == {
        "tiercheck.errors",
        "tiercheck.store.catalog",
        "tiercheck.core.chunking",
        "tiercheck.checkpointer",
        "tiercheck.history.versions",
    }


def test_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(_describe(graph, c) for c in found)


def test_the_facade_only_delegates() -> None:
    lines = len((REPO / "src" / "tiercheck" / "checkpointer.py").read_text().splitlines())
    assert lines <= 400, f"checkpointer.py has {lines} lines; move logic behind a service"


def test_nothing_imports_the_cli() -> None:
    graph = import_graph()
    importers = sorted(
        m
        for m, targets in graph.items()
        if any(t == "tiercheck.cli" or t.startswith("tiercheck.cli.") for t in targets)
        and not (m == "tiercheck.cli" or m.startswith("tiercheck.cli."))
        and m != "tiercheck.__main__"
    )
    assert not importers, f"modules importing the CLI: {importers}"


ROOMS_REACHING_TIERS = (
    "tiercheck.store",
    "tiercheck.runtime",
    "tiercheck.engine",
    "tiercheck.upkeep",
)


@pytest.mark.parametrize(
    "module",
    sorted(
        m
        for m in MODULES
        if m.startswith(tuple(f"{r}." for r in ROOMS_REACHING_TIERS)) or m == "tiercheck.assembly"
    ),
)
def test_the_engine_reaches_tiers_through_their_interface(module: str) -> None:
    """Store, runtime, engine, upkeep and the assembly name no concrete backend: tiers are
    opened by URL through the registry and used through ``backends.base`` (the package's
    own public names, which lifecycle uses to list the shm segments of a deleted store,
    count as the interface) and the forwarding wrappers that sit beside the backends."""
    allowed = {
        "tiercheck.backends",
        "tiercheck.backends.base",
        "tiercheck.backends.registry",
        "tiercheck.backends.wrappers",
        "tiercheck.backends.resilience",
    }
    used = {
        t
        for t in (_owner(n) for n in imported_names(module, MODULES[module]))
        if t is not None and (t == "tiercheck.backends" or t.startswith("tiercheck.backends."))
    }
    assert used <= allowed, f"{module} imports {sorted(used - allowed)}"


# The rooms of issue 30, from the lowest to the highest: each may import the ones before it,
# never one after it. ``store`` opens and reads a store and starts no thread; ``runtime`` is
# the plumbing the threads run on; ``engine`` is the save pipeline and the commit protocol;
# ``upkeep`` is the work after the commit. ``engine`` sees upkeep only through the protocols
# of ``engine.ports``; the assembly (``tiercheck.assembly``) wires them.
ROOMS = {
    "tiercheck.store": {"tiercheck.runtime", "tiercheck.engine", "tiercheck.upkeep"},
    "tiercheck.runtime": {"tiercheck.store", "tiercheck.engine", "tiercheck.upkeep"},
    "tiercheck.engine": {"tiercheck.upkeep"},
    "tiercheck.upkeep": {"tiercheck.engine"},
}
# rooms above the assembly's parts: nothing below imports them
ABOVE = {"tiercheck.assembly", "tiercheck.checkpointer", "tiercheck.restore", "tiercheck.history"}
MAX_MODULE_LINES = 900
LONG_MODULES_ALLOWED = {"tiercheck.formats.manifest"}  # the format's reference schema
MAX_PACKAGE_MODULES = 15


def _room(module: str) -> str | None:
    for room in (*ROOMS, *ABOVE):
        if module == room or module.startswith(room + "."):
            return room
    return None


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_each_room_imports_only_the_rooms_below_it(room: str) -> None:
    graph = import_graph()
    forbidden = ROOMS[room] | ABOVE
    wrong = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if _room(m) == room
        for t in targets
        if _room(t) in forbidden
    )
    assert not wrong, f"{room} reaches up: {wrong}"


def test_no_module_is_over_900_lines() -> None:
    long = {
        m: n
        for m, path in MODULES.items()
        if m not in LONG_MODULES_ALLOWED
        and (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long}"


def test_no_package_holds_over_15_modules() -> None:
    counts: dict[str, int] = {}
    for path in MODULES.values():
        counts[str(path.parent)] = counts.get(str(path.parent), 0) + 1
    big = {p: n for p, n in counts.items() if n > MAX_PACKAGE_MODULES}
    assert not big, f"packages over {MAX_PACKAGE_MODULES} modules: {big}"


def test_no_module_is_a_compatibility_shim() -> None:
    """A module whose whole body is imports (re-exporting another module under an old
    name) is a shim; package ``__init__`` files that gather public names are not."""
    shims = []
    for m, path in MODULES.items():
        if path.name == "__init__.py":
            continue
        body = ast.parse(path.read_text()).body
        stmts = [
            s
            for s in body
            if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
            and not (
                isinstance(s, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in s.targets)
            )
        ]
        if stmts and all(isinstance(s, ast.Import | ast.ImportFrom) for s in stmts):
            shims.append(m)
    assert not shims, f"modules that only re-export: {shims}"
