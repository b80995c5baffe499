"""The suite must fail loudly against connectors that break the contract."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def run_suite(target: str, tmp_path: Path, *extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(
        [sys.executable, "-m", "hicache_storage.cli", "conformance", target, "--report-dir", str(tmp_path), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    report = json.loads((tmp_path / target.replace(":", "-")).with_suffix(".json").read_text())
    assert result.returncode != 0, "the suite passed a broken backend"
    assert not report["ok"]
    return {r["clause"]: r["outcome"] for r in report["results"]}


@pytest.mark.parametrize(
    "broken, must_fail",
    [
        ("LyingExists", ["test_misses_are_per_key", "test_prefix_exists[hole-at-head]", "test_isolation[tenant]"]),
        ("IgnoresTenant", ["test_isolation[tenant]"]),
        ("WrongResultCount", ["test_batch_order", "test_roundtrip[random-4096]"]),
        ("ClearsEverything", ["test_clear_is_scoped_to_its_namespace"]),
        ("ShortRead", ["test_length_mismatch_is_a_miss[1]", "test_overwrite_with_other_length"]),
        ("PersistsNothing", ["test_persistence_across_instances"]),
    ],
)
def test_suite_fails_broken_backend(tmp_path, broken, must_fail):
    outcomes = run_suite(f"broken_backends:{broken}", tmp_path, "--quick")
    for clause in must_fail:
        assert outcomes[clause] == "failed", f"{clause} did not fail for {broken}: {outcomes[clause]}"


@pytest.mark.slow
def test_suite_catches_a_torn_write(tmp_path):
    outcomes = run_suite("broken_backends:TornWrite", tmp_path, "-k", "torn")
    assert outcomes["test_concurrent_writers_and_readers_never_see_a_torn_page"] == "failed"


def test_a_run_that_executes_nothing_fails(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "hicache_storage.cli", "conformance", "memory", "--report-dir", str(tmp_path), "-k", "no_such_clause"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    report = json.loads((tmp_path / "memory.json").read_text())
    assert report["ok"] is False and report["counts"]["passed"] == 0
    assert "NO CLAUSE EXECUTED" in (tmp_path / "memory.md").read_text()
