"""An outside package registers a connector by entry point and passes the suite (the documented path)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent / "outside_connector"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The package pip-installed into its own directory, put on PYTHONPATH for subprocesses."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(target), str(PACKAGE)],
        check=True,
        timeout=300,
    )
    return {**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.slow
def test_entry_point_backend_is_listed(installed):
    result = subprocess.run([sys.executable, "-m", "hicache_storage.cli", "list", "--json"], env=installed, capture_output=True, text=True, check=True)
    [acme] = [b for b in json.loads(result.stdout) if b["name"] == "acme-kv"]
    assert acme["available"] and acme["origin"] == "entry point (acme-kv-hicache)"
    assert acme["capabilities"]["persistent"] is True


@pytest.mark.slow
def test_entry_point_backend_passes_the_suite(installed, tmp_path):
    config = json.dumps({"root": str(tmp_path / "store")})
    result = subprocess.run(
        [sys.executable, "-m", "hicache_storage.cli", "conformance", "acme-kv", "--config", config, "--report-dir", str(tmp_path)],
        env=installed,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "acme-kv.json").read_text())
    assert report["ok"] and report["counts"]["failed"] == 0 and report["counts"]["passed"] > 50
    # persistence and cross-process visibility are declared, so they ran instead of being skipped
    outcomes = {r["clause"]: r["outcome"] for r in report["results"]}
    assert outcomes["test_persistence_across_instances"] == "passed"
    assert outcomes["test_visible_across_processes"] == "passed"
