"""Type-check the packages as installed: ``python scripts/typecheck.py [mypy arguments]``.

connectors/, conformance/ and kernels/ live at the top of the repository but install under
``hicache_storage`` (pyproject.toml's ``[tool.setuptools] package-dir``), and the editable install
reaches them through an import hook that mypy cannot follow. So this builds, under
build/typecheck/, a tree of symbolic links laid out as the wheel installs the packages (read from
package-dir, so it cannot drift from it), and runs mypy with the ``[tool.mypy]`` configuration of
pyproject.toml, whose ``mypy_path`` is that tree and whose ``packages`` names every package under
its installed name. Paths in mypy's report are given back as the source paths. Exits with mypy's
status.

Once the tree is built, ``python -m mypy`` from the repository root checks the same thing (the
tree is rebuilt on each run of this script: a new module at the top of a mapped folder needs it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"


def package_dirs() -> dict[str, Path]:
    """Each package of ``package-dir``, by installed name, and its source folder."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in setuptools["package-dir"].items()}


def build_tree(mapping: dict[str, Path], tree: Path = TREE) -> dict[Path, Path]:
    """Lay ``mapping`` out under ``tree`` as installed; returns each tree folder's source folder.

    A package none of whose subpackages is mapped elsewhere is one link to its folder; one that has
    such a subpackage is a real folder holding a link to each entry of its source folder, beside
    the link (or folder) of that subpackage.
    """
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    sources: dict[Path, Path] = {}
    for name in sorted(mapping, key=lambda dotted: dotted.count(".")):
        target = tree.joinpath(*name.split("."))
        if not target.parent.is_dir():
            raise SystemExit(f"package-dir maps {name} but not its parent package")
        nested = {child.split(".")[len(name.split("."))] for child in mapping if child.startswith(name + ".")}
        sources[target] = mapping[name]
        if not nested:
            target.symlink_to(mapping[name], target_is_directory=True)
            continue
        target.mkdir()
        for entry in sorted(mapping[name].iterdir()):
            if entry.name not in nested and entry.name != "__pycache__":
                (target / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    return sources


def main(argv: list[str]) -> int:
    sources = build_tree(package_dirs())
    # Longest tree path first, so a mapped subpackage's files are named by its own folder.
    prefixes = sorted(
        ((os.path.relpath(target, ROOT) + os.sep, os.path.relpath(source, ROOT) + os.sep) for target, source in sources.items()),
        key=lambda pair: -len(pair[0]),
    )
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    for stream, text in ((sys.stdout, result.stdout), (sys.stderr, result.stderr)):
        for line in text.splitlines(keepends=True):
            for in_tree, in_source in prefixes:
                if line.startswith(in_tree):
                    line = in_source + line[len(in_tree) :]
                    break
            stream.write(line)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
