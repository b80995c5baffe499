"""Every Python package in the source tree is listed in pyproject.toml, under its installed name; the
SDK's folders import nothing from the HiCache core built on them."""

import ast
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_installed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    mapping = setuptools["package-dir"]
    found = set()
    for source_name, directory in mapping.items():
        for init in (ROOT / directory).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / directory)
            found.add(".".join([source_name, *relative.parts]))
    assert found == listed, f"missing from pyproject: {sorted(found - listed)}; listed but absent: {sorted(listed - found)}"


def test_the_sdk_imports_nothing_from_the_core():
    # The core reaches the SDK's CLI by entry point (hicache_storage.commands), never the reverse.
    offenders = []
    for folder in ("hicache_storage", "connectors", "conformance", "kernels"):
        for source in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(source.read_text(), str(source))):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                if any(name == "hicache_core" or name.startswith("hicache_core.") for name in names):
                    offenders.append(f"{source.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"the SDK imports the core at {offenders}"


def _module_level_imports(tree: ast.Module):
    """The import statements a module runs when it is imported: not those inside a function."""
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        pending.extend(ast.iter_child_nodes(node))


def test_the_packages_import_the_benchmarks_only_inside_a_command():
    # The benchmarks sit above the SDK and the core: the CLI imports the storage bench inside its
    # bench-io command, and finds the multi-turn bench (which runs the core) by entry point.
    offenders = []
    for folder in ("hicache_storage", "connectors", "conformance", "kernels", "hicache_core"):
        for source in sorted((ROOT / folder).rglob("*.py")):
            for node in _module_level_imports(ast.parse(source.read_text(), str(source))):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if any(name == "hicache_storage.benchmarks" or name.startswith("hicache_storage.benchmarks.") for name in names):
                    offenders.append(f"{source.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"module-level imports of the benchmarks at {offenders}"


def test_bench_is_a_command_the_benchmarks_register():
    import argparse

    from hicache_storage.cli import build_parser

    commands = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    assert {"list", "conformance", "bench-io", "bench"} <= set(commands.choices)
    assert commands.choices["bench"].get_default("run").__module__ == "hicache_storage.benchmarks.multiturn.command"
