"""The type check covers every package (read from pyproject.toml, never by running mypy again:
scripts/test.sh runs it once), and the bugs it found stay fixed."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MYPY = PYPROJECT["tool"]["mypy"]


def _typecheck_script():
    spec = importlib.util.spec_from_file_location("typecheck", ROOT / "scripts" / "typecheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checked(package: str) -> bool:
    return any(package == root or package.startswith(root + ".") for root in MYPY["packages"])


def test_mypy_checks_every_installed_package():
    listed = PYPROJECT["tool"]["setuptools"]["packages"]
    unchecked = [package for package in listed if not _checked(package)]
    assert not unchecked, f"[tool.mypy] packages leaves out {unchecked}"


def test_the_checked_tree_holds_every_package_where_it_installs(tmp_path):
    # mypy reads the packages from the link tree scripts/typecheck.py lays out: every package of
    # the wheel must be there under its installed name, or `-p` never reaches it.
    script = _typecheck_script()
    script.build_tree(script.package_dirs(), tmp_path)
    missing = [
        package
        for package in PYPROJECT["tool"]["setuptools"]["packages"]
        if not tmp_path.joinpath(*package.split("."), "__init__.py").is_file()
    ]
    assert not missing, f"the type-check tree lacks {missing}"
    assert tmp_path.joinpath("hicache_storage", "py.typed").is_file()


def test_missing_imports_are_ignored_module_by_module():
    assert "ignore_missing_imports" not in MYPY, "ignore missing imports per module (an override), never globally"
    for override in MYPY.get("overrides", []):
        if override.get("ignore_missing_imports"):
            modules = override["module"] if isinstance(override["module"], list) else [override["module"]]
            assert not [m for m in modules if _checked(m)], "a package of ours must never be ignored"
    assert {"check_untyped_defs", "warn_unused_ignores", "warn_redundant_casts", "no_implicit_optional"} <= {
        key for key, value in MYPY.items() if value is True
    }


def test_the_dev_extra_pins_the_mypy_that_is_installed():
    pins = [re.fullmatch(r"mypy==(\S+)", dependency) for dependency in PYPROJECT["project"]["optional-dependencies"]["dev"]]
    pinned = [pin.group(1) for pin in pins if pin]
    assert len(pinned) == 1, "the dev extra pins mypy to one version"
    try:
        installed = importlib.metadata.version("mypy")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("mypy is not installed here (the dev extra installs it)")
    assert installed == pinned[0]


def test_ci_runs_the_type_check():
    assert "scripts/typecheck.py" in (ROOT / "scripts" / "test.sh").read_text()


def test_every_type_ignore_names_its_code():
    # enable_error_code = ignore-without-code makes mypy say so too; this also covers files mypy
    # is not run on here.
    bare = []
    for folder in ("hicache_storage", "connectors", "conformance", "kernels", "hicache_core"):
        for source in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(source.read_text().splitlines(), 1):
                if re.search(r"#\s*type:\s*ignore(?!\[)", line):
                    bare.append(f"{source.relative_to(ROOT)}:{number}")
    assert not bare, f"type: ignore without an error code at {bare}"


# --- bugs the type checker found --------------------------------------------------------------


def test_the_conformance_report_describes_the_connector():
    # It opened the connector in a `with` block, which a Connector (not a Store) does not support:
    # every report's config read {"error": "TypeError: ... context manager protocol"}.
    from hicache_storage.conformance.report import _describe_backend

    config, capabilities = _describe_backend("memory", '{"capacity_bytes": 65536}')
    assert config.get("capacity_bytes") == 65536 and "error" not in config
    assert capabilities is not None and capabilities["capacity_bytes"] == 65536


def test_bench_io_times_dd_in_the_file_stores_root(tmp_path, monkeypatch):
    # It read the root from the Store (which has no config): bench-io on the file store raised
    # AttributeError after its first page size.
    from hicache_storage import open_store
    from hicache_storage.benchmarks.storage_io import measure as io

    seen = []

    def dd(page_size: int, pages: int, directory: str) -> dict[str, float]:
        seen.append(directory)
        return {"write": 1.0, "read": 1.0}

    monkeypatch.setattr(io, "dd_direct", dd)
    with open_store({"backend": "file", "config": {"root": str(tmp_path / "l3")}}) as store:
        result = io.run_bench_io(store, page_sizes=[4096], batch_sizes=[4], bytes_per_case=4 * 4096, repeats=1)
    assert seen == [str(tmp_path / "l3")]
    assert {m["path"] for m in result["measurements"]} >= {"dd O_DIRECT", "sdk zero-copy"}
