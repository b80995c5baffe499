"""Every Python package in the source tree is listed in pyproject.toml, under its installed name; the
SDK's folders import nothing from the HiCache core built on them."""

import ast
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


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


def test_bench_is_a_command_the_core_registers():
    import argparse

    from hicache_storage.cli import build_parser

    commands = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    assert {"list", "conformance", "bench-io", "bench"} <= set(commands.choices)
    assert commands.choices["bench"].get_default("run").__module__ == "hicache_core.bench.command"
