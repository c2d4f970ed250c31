"""The package's import graph, read from the source with `ast` (nothing is imported): no
import cycles between modules, and `experts/` imports nothing above it.

Every import statement counts, wherever it is: module level, inside a function, or under
`if TYPE_CHECKING:` (a circle that only type checkers see is still a circle in the design).
`import a.b.c` is an edge to module a.b.c; `from a.b import c` is an edge to a.b.c when
that is a module, else to a.b; relative imports are resolved against the importing module's
package. A name that is no module resolves to its longest prefix that is one. Importing a
module also runs its parent packages' `__init__`, but those implicit edges are not counted:
an edge is what a statement names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "moestream"

# Layers above experts/ (DESIGN.md: experts/ sits below the engine, the layers, the models and the server).
ABOVE_EXPERTS = ("moestream.engine", "moestream.layers", "moestream.models", "moestream.server")


def _modules(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file under `package_dir` (a package
    `a/b/__init__.py` is module a.b)."""
    root = package_dir.parent
    out: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """`name`, or its longest dotted prefix that is a module; None when none is."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (itself excluded)."""
    package_dir = Path(package_dir)
    modules = _modules(package_dir)
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        is_package = path.name == "__init__.py"
        package = mod if is_package else mod.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(filter(None, (_resolve(alias.name, modules) for alias in node.names)))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")
                    if node.level > 1:
                        base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    target = sub if sub in modules else _resolve(base, modules)
                    if target is not None:
                        targets.add(target)
        targets.discard(mod)
        graph[mod] = targets
    return graph


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
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
                    out.append(sorted(component))
    return out


def _shortest_cycle(graph: dict[str, set[str]], start: str, members: set[str]) -> list[str]:
    """A shortest cycle start -> ... -> start inside `members` (breadth first), without the
    repeated start."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1]
                if child not in prev:
                    prev[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{start} is on no cycle inside {sorted(members)}")


def find_cycles(package_dir: Path | str) -> list[list[str]]:
    """Import cycles between the modules under `package_dir`: for each set of modules that
    import each other (a strongly connected component of more than one module), one shortest
    cycle through its alphabetically first module, as [m0, m1, ..., mk] meaning
    m0 -> m1 -> ... -> mk -> m0. Sorted; [] when the graph is acyclic."""
    graph = import_graph(Path(package_dir))
    cycles = [_shortest_cycle(graph, comp[0], set(comp)) for comp in _strongly_connected(graph) if len(comp) > 1]
    return sorted(cycles)


def _describe(package_dir: Path, cycles: list[list[str]]) -> str:
    graph = import_graph(package_dir)
    lines = []
    for comp in _strongly_connected(graph):
        if len(comp) > 1:
            cycle = _shortest_cycle(graph, comp[0], set(comp))
            lines.append(f"{' -> '.join(cycle + cycle[:1])}   (component of {len(comp)}: {', '.join(comp)})")
    return "import cycles:\n  " + "\n  ".join(sorted(lines))


def test_find_cycles_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The checker itself: absolute, relative, from-package and function-level imports all
    count, and an acyclic package has no cycles."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")  # from a package import a module: edge to pkg.sub.b
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import X\n")  # relative, inside a function
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n")
    (pkg / "d.py").write_text("from .sub.b import f\nfrom pkg.sub import nothing_here\n")  # d -> b, d -> pkg.sub
    assert import_graph(pkg)["pkg.d"] == {"pkg.sub.b", "pkg.sub"}
    assert find_cycles(pkg) == [["pkg.a", "pkg.sub.b", "pkg.c"]]
    (pkg / "c.py").write_text("X = 1\n")
    assert find_cycles(pkg) == []


def test_no_import_cycles() -> None:
    cycles = find_cycles(PACKAGE_DIR)
    assert cycles == [], _describe(PACKAGE_DIR, cycles)


def _upward(package: str, above: tuple[str, ...]) -> list[tuple[str, str]]:
    """(module, target) pairs where a module of `package` imports one of `above`."""
    graph = import_graph(PACKAGE_DIR)
    return sorted(
        (mod, target)
        for mod, targets in graph.items()
        if mod == package or mod.startswith(package + ".")
        for target in targets
        if any(target == a or target.startswith(a + ".") for a in above)
    )


@pytest.mark.parametrize("package, above", [
    ("moestream.experts", ABOVE_EXPERTS),
    ("moestream.config", ("moestream.models", "moestream.layers", "moestream.experts", "moestream.engine",
                          "moestream.server", "moestream.spec_decode")),
])
def test_package_imports_nothing_above(package: str, above: tuple[str, ...]) -> None:
    upward = _upward(package, above)
    assert upward == [], f"{package} imports from above it: " + ", ".join(f"{m} -> {t}" for m, t in upward)


def test_structure_doc_names_every_module() -> None:
    """docs/structure.md has a line for every module of the package."""
    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "structure.md").read_text()
    missing = [str(p.relative_to(root)) for p in sorted((root / "moestream").rglob("*.py"))
               if p.name != "__init__.py" and f"`{p.relative_to(root)}`" not in doc]
    assert missing == []


def test_engine_only_steps() -> None:
    """The engine file stays the step and its facade: its parts are made in `engine/builder.py`
    and speculative decoding lives in `spec_decode/` (the restructure's bound: under 250 lines)."""
    text = (PACKAGE_DIR / "engine" / "llm_engine.py").read_text()
    assert len(text.splitlines()) < 250
    assert "def _propose" not in text and "PagedExpertStore(" not in text
