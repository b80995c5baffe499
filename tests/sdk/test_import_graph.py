"""No import cycle among the modules of any of our packages (``PACKAGES``).

The graph is read from the source: nothing is imported, so a package that fails to import is
still checked. Every ``import`` statement counts, wherever it is: at module level, inside a
function (a lazy import that works around a cycle) and under ``if TYPE_CHECKING:`` (two modules
that name each other's types are one unit even if the interpreter never sees the loop). An edge
goes to the module named: ``from pkg import name`` to ``pkg.name`` when that is a module, else to
``pkg``. Importing ``a.b`` also runs ``a/__init__.py``; that implicit edge is not counted, or
every package whose ``__init__`` re-exports its modules would be one cycle.

The graph spans all of ``PACKAGES`` at once, so a cycle through two packages is found and reported
under each. Run this file as a script for the report of every package.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

#: Every package whose import graph is read, as installed (connectors/, kernels/, conformance/ and
#: benchmarks/ live at the top of the repository but install under ``hicache_storage``).
PACKAGES = (
    "hicache_storage",
    "hicache_storage.connectors",
    "hicache_storage.kernels",
    "hicache_storage.conformance",
    "hicache_storage.benchmarks",
    "hicache_core",
)

#: The packages that must have no import cycle: all of them (the last cycles went in issue 25).
#: ``python tests/sdk/test_import_graph.py`` prints each package's cycles.
CYCLE_FREE_PACKAGES = PACKAGES


def package_folders(package: str) -> list[str]:
    """Where ``package`` is installed, found without running any of its code (nor its parents':
    ``importlib.util.find_spec`` of a dotted name imports the parent package first)."""
    parent, _, _ = package.rpartition(".")
    path = package_folders(parent) if parent else None
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        spec = find_spec(package, path) if find_spec is not None else None
        if spec is not None and spec.submodule_search_locations:
            return list(spec.submodule_search_locations)
    raise AssertionError(f"{package} is not an installed package")


def package_modules(package: str) -> dict[str, Path]:
    """Module name -> source file for ``package`` and its subpackages found in its own folder."""
    modules: dict[str, Path] = {}
    for location in package_folders(package):
        root = Path(location)
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if not all((root.joinpath(*parts[:depth]) / "__init__.py").exists() for depth in range(1, len(parts))):
                continue  # a folder of scripts or data inside the package, not a subpackage
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def imported_modules(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """The modules of ``known`` that the module ``name`` (source at ``path``) imports."""
    known = set(known)
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in known else base)
    return {target for target in targets if target in known}


def import_graph(packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules it imports, over every module of ``packages``."""
    files: dict[str, Path] = {}
    for package in packages:
        files.update(package_modules(package))
    return {name: imported_modules(name, path, files) for name, path in files.items()}


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components with a cycle (two or more modules, or one importing
    itself), each sorted, in sorted order (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph.get(node, ()):
                        found.append(sorted(component))
    return sorted(found)


def owner(module: str, packages: Iterable[str] = PACKAGES) -> str:
    """The package of ``packages`` a module belongs to (the longest that contains it)."""
    return max((p for p in packages if module == p or module.startswith(p + ".")), key=len)


def cycles_by_package(packages: Iterable[str] = PACKAGES) -> dict[str, list[list[str]]]:
    """Each package's import cycles: those through at least one of its modules."""
    packages = tuple(packages)
    report: dict[str, list[list[str]]] = {package: [] for package in packages}
    for cycle in cycles(import_graph(packages)):
        for package in sorted({owner(module, packages) for module in cycle}):
            report[package].append(cycle)
    return report


@pytest.fixture(scope="module")
def report() -> dict[str, list[list[str]]]:
    return cycles_by_package()


def _describe(found: list[list[str]]) -> str:
    return "; ".join(" <-> ".join(cycle) for cycle in found) or "none"


@pytest.mark.parametrize("package", CYCLE_FREE_PACKAGES)
def test_no_import_cycle(package, report):
    assert not report[package], f"import cycles through {package}: {_describe(report[package])}"


def test_graph_reads_the_packages():
    """The parser sees real edges (a vacuous graph would have no cycle either)."""
    graph = import_graph()
    for package in PACKAGES:
        assert package in graph, f"{package}'s __init__ was not found"
    assert "hicache_core.controller" in graph["hicache_core.engine"]
    assert "hicache_core.radix_tree" in graph["hicache_core.controller"]
    assert any(target.startswith("hicache_storage.") for target in graph["hicache_core.controller"])


def test_finds_lazy_type_only_and_relative_cycles(tmp_path, monkeypatch):
    """Cycles closed by an import under TYPE_CHECKING, inside a function or relative are caught,
    and one through a package's re-exporting ``__init__`` is not counted."""
    package = tmp_path / "cyclic"
    (package / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "from cyclic.a import A\n",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cyclic.b import B\nclass A: ...\n",
        "b.py": "import cyclic.a\nclass B: ...\n",
        "c.py": "def late():\n    from cyclic import d\n",
        "d.py": "from . import c\n",
        "e.py": "from cyclic.sub import f\n",
        "sub/__init__.py": "",
        "sub/f.py": "from ..e import x\n",
        "clean.py": "import cyclic.a\n",
    }
    for name, text in sources.items():
        (package / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    found = cycles(import_graph(["cyclic"]))
    assert found == [["cyclic.a", "cyclic.b"], ["cyclic.c", "cyclic.d"], ["cyclic.e", "cyclic.sub.f"]]


if __name__ == "__main__":
    for name, found in cycles_by_package().items():
        held = " (held to none)" if name in CYCLE_FREE_PACKAGES else ""
        print(f"{name}{held}: {len(found)} cycle(s)")
        for cycle in found:
            print("   ", " <-> ".join(cycle))
    sys.exit(0)
