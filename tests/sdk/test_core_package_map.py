"""Each package of the core and of the benchmarks: its docstring maps every one of its modules and subpackages."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

PACKAGES = (
    "hicache_core",
    "hicache_core.hybrid",
    "hicache_storage.benchmarks",
    "hicache_storage.benchmarks.multiturn",
    "hicache_storage.benchmarks.storage_io",
)


@pytest.mark.parametrize("name", PACKAGES)
def test_package_docstring_maps_every_module(name):
    package = importlib.import_module(name)
    folder = Path(package.__file__).parent
    members = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    members |= {p.parent.name for p in folder.glob("*/__init__.py")}
    mapped = set(re.findall(r":mod:`(?:~?" + re.escape(name) + r")?\.(\w+)`", package.__doc__ or ""))
    assert members - mapped == set(), f"{name}'s docstring does not map {sorted(members - mapped)}"
    assert mapped - members == set(), f"{name}'s docstring maps modules that do not exist: {sorted(mapped - members)}"
