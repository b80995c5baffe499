"""The suite's measured power: it fails every seeded bug in tests/broken_backends.py.

Each mutant runs through ``hicache-storage conformance`` with ``-x`` (the run stops at the first
failing clause): a cheap single-operation bug with ``--quick`` (whose clauses the full suite runs
too, so the full suite fails it as well), every other bug with the full suite.
scripts/mutation_study.py runs the same study without ``-x`` and publishes, per bug, every clause
that catches it (docs/conformance/mutation-study.md).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from broken_backends import MUTANTS

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
    assert result.returncode != 0, f"the suite passed a broken backend:\n{result.stdout[-2000:]}"
    assert not report["ok"]
    return {r["clause"]: r["outcome"] for r in report["results"]}


def assert_caught(outcomes: dict[str, str], name: str) -> None:
    failed = [clause for clause, outcome in outcomes.items() if outcome == "failed"]
    errors = [clause for clause, outcome in outcomes.items() if outcome == "error"]
    assert failed, f"{name}: no clause failed (errors in {errors[:3]}); a mutant must fail a clause, not crash the run"


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, mutant in MUTANTS.items() if not mutant.quick])
def test_full_suite_catches(tmp_path, name):
    assert_caught(run_suite(f"broken_backends:{name}", tmp_path, "-x"), name)


@pytest.mark.parametrize("name", [name for name, mutant in MUTANTS.items() if mutant.quick])
def test_quick_suite_catches(tmp_path, name):
    """A cheap bug fails --quick; the full suite runs every quick clause too, so it fails as well."""
    assert_caught(run_suite(f"broken_backends:{name}", tmp_path, "--quick", "-x"), name)


@pytest.mark.parametrize(
    "broken, must_fail",
    [
        ("LyingExists", ["test_misses_are_per_key", "test_prefix_exists[hole-at-head]", "test_isolation[tenant]"]),
        ("IgnoresTenant", ["test_isolation[tenant]", "test_near_identities_are_distinct[tenant-case-get]"]),
        ("CaseFoldedKeys", ["test_near_identities_are_distinct[tenant-case-exists]", "test_backdoor_sees_what_put_stored"]),
        ("TruncatedHashKeys", ["test_keys_that_prefix_each_other_are_distinct[get]", "test_backdoor_sees_what_put_stored"]),
        ("ExistsByPrefix", ["test_keys_that_prefix_each_other_are_distinct[exists]"]),
        ("FirstWriteWins", ["test_duplicate_keys_last_write_wins"]),
        ("DropsLargeValues", ["test_roundtrip_realistic_page_size[20MiB]"]),
        ("CapacityEvictsHead", ["test_capacity_is_kept_and_a_prefix_keeps_its_head"]),
        ("ExistsKeyByKey", ["test_native_batch_exists_is_one_call_per_batch"]),
        ("StagedZeroCopyRead", ["test_zero_copy_read_fills_the_target_itself"]),
    ],
)
def test_named_clauses_catch_their_bug(tmp_path, broken, must_fail):
    """The clause written for a bug is among those that catch it (every clause runs here, no -x)."""
    outcomes = run_suite(f"broken_backends:{broken}", tmp_path, "--quick", "-k", " or ".join(c.split("[")[0] for c in must_fail))
    for clause in must_fail:
        assert outcomes[clause] == "failed", f"{clause} did not fail for {broken}: {outcomes[clause]}"


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
