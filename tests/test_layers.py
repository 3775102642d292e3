"""docs/ARCHITECTURE.md's "Dependency direction", checked: every import between the package's
files (read with ``ast``, imports inside functions and under ``TYPE_CHECKING`` included) points
down the layers below, and no files import each other in a circle.

A file's area is the first name under ``thunderproxy`` (``http`` for ``http/edges.py``,
``gateway`` for ``gateway.py``). An area may import its own files and the areas of any later
layer; areas that share a layer do not import each other. The few deliberate exceptions are
``EXCEPTIONS``, each justified in ARCHITECTURE.md next to the rule.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "thunderproxy"

#: Top to bottom, as drawn in ARCHITECTURE.md.
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(layer.split())
    for layer in (
        "__main__",
        "cli",
        "bench",
        "council_demo",
        "scaleout",
        "runtime",
        "council worker explore",
        "http",
        "core",
        "admission",
        "gateway",
        "protocols statistics",
        "scheduling snapshot",
        "backends programs",
        "config",
        "audit",
        "sim",
        "traces",
        "descriptors",
        "steps supervision where urls causes",
        "errors clock __init__",
    )
)

#: (importing module or folder, imported module): the deliberate exceptions, documented in
#: ARCHITECTURE.md.
#: None today: a module that needs something above it gets it moved down or passed in.
EXCEPTIONS: frozenset[tuple[str, str]] = frozenset()


def modules(package: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, whether it is a package's ``__init__``)."""
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


def _resolve(name: str, known: Mapping[str, object]) -> str | None:
    """The package's file that ``import name`` reads: the longest known prefix."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str, path: Path, is_package: bool, known: Mapping[str, object]) -> set[str]:
    """The package's modules ``name`` imports anywhere in its file, relative imports resolved."""
    here = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            # ``from pkg import sub`` imports the module pkg.sub when there is one.
            targets = [f"{source}.{alias.name}" for alias in node.names]
        for target in targets:
            if target.split(".")[0] != PACKAGE.name:
                continue
            resolved = _resolve(target, known)
            if resolved is not None and resolved != name:
                out.add(resolved)
    return out


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    known = modules(package)
    return {name: imports(name, path, pkg, known) for name, (path, pkg) in known.items()}


def area(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def rank(name: str) -> int:
    for index, layer in enumerate(LAYERS):
        if area(name) in layer:
            return index
    raise AssertionError(
        f"{name}: its area {area(name)!r} is in no layer; add it to LAYERS here and to "
        "docs/ARCHITECTURE.md's Dependency direction"
    )


def excepted(source: str, target: str) -> bool:
    return any(
        (source == folder or source.startswith(folder + ".")) and target == imported
        for folder, imported in EXCEPTIONS
    )


def upward(edges: Mapping[str, set[str]]) -> list[str]:
    """Each import that does not point to a lower layer, as ``importer -> imported``."""
    found = []
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            if area(source) == area(target) or excepted(source, target):
                continue
            if rank(source) >= rank(target):
                found.append(f"{source} -> {target}")
    return found


def cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected set of files, as one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the package is a few hundred files deep
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return [_one_cycle(component, edges) for component in components]


def _one_cycle(component: list[str], edges: Mapping[str, set[str]]) -> list[str]:
    """A path from the component's first file back to it, for the failure message."""
    members = set(component)
    start = component[0]
    paths: dict[str, list[str]] = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(edges[node] & members):
                if target == start:
                    return [*paths[node], start]
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    following.append(target)
        frontier = following
    return component


def _described(items: Iterator[str] | list[str]) -> str:
    return "\n  ".join(items)


def test_imports_point_down_the_layers() -> None:
    found = upward(graph())
    assert not found, (
        "imports against docs/ARCHITECTURE.md's Dependency direction (move the shared thing "
        "down, or pass a callable in):\n  " + _described(found)
    )


def test_no_import_circles() -> None:
    found = cycles(graph())
    assert not found, "import circles between files:\n  " + _described(
        " -> ".join(cycle) for cycle in found
    )


def test_every_exception_is_still_needed() -> None:
    edges = graph()
    used = {
        (a, b)
        for a, b in EXCEPTIONS
        if any(b in targets and excepted(source, b) for source, targets in edges.items())
    }
    stale = sorted(f"{a} -> {b}" for a, b in EXCEPTIONS - used)
    assert not stale, "exceptions no import needs any more; remove them:\n  " + _described(stale)


def test_the_exceptions_import_nothing_above_their_importer() -> None:
    """What justifies an exception: the module imported upward reaches, through its own imports,
    only layers below its importer, so no circle can close through it."""
    edges = graph()
    for source, target in sorted(EXCEPTIONS):
        seen, todo = set(), [target]
        while todo:
            node = todo.pop()
            for following in edges[node] - seen:
                seen.add(following)
                todo.append(following)
        above = sorted(n for n in seen if area(n) != area(target) and rank(n) <= rank(source))
        assert not above, f"{target}, imported by {source} as an exception, reaches {above}"


def test_the_reader_sees_relative_and_function_imports(tmp_path: Path) -> None:
    package = tmp_path / "thunderproxy"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "top.py").write_text("def f():\n    from .sub import low\n")
    (package / "sub" / "__init__.py").write_text("from .. import top\n")
    (package / "sub" / "low.py").write_text("from ..top import f\n")
    edges = graph(package)
    assert edges["thunderproxy.top"] == {"thunderproxy.sub.low"}
    assert edges["thunderproxy.sub.low"] == {"thunderproxy.top"}
    assert edges["thunderproxy.sub"] == {"thunderproxy.top"}
    assert cycles(edges) == [["thunderproxy.sub.low", "thunderproxy.top", "thunderproxy.sub.low"]]


#: bench/'s rooms (and its top-level files), top to bottom, as its ``__init__`` lists them: bench/
#: is one layer above, and inside it each room imports only the rooms below it.
BENCH_ROOMS = (
    "cli",
    "studies",
    "relay",
    "runs",
    "engine",
    "config",
    "report",
    "agents",
    "workloads",
)


def bench_room(name: str) -> str:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def test_bench_rooms_import_down() -> None:
    found = []
    for source, targets in sorted(graph().items()):
        if area(source) != "bench" or bench_room(source) == "__init__":
            continue
        for target in sorted(targets):
            if area(target) != "bench" or bench_room(target) == bench_room(source):
                continue
            room, imported = bench_room(source), bench_room(target)
            if imported == "__init__" or BENCH_ROOMS.index(room) >= BENCH_ROOMS.index(imported):
                found.append(f"{source} -> {target}")
    assert not found, (
        "imports between bench/'s rooms against the order in bench/__init__.py (move the "
        "shared thing down):\n  " + _described(found)
    )
