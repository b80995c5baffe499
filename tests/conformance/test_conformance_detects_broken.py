"""The suite's measured power: it fails every seeded bug in tests/helpers/broken_backends.py.

Each mutant runs through ``hicache-storage conformance`` with ``-x`` (the run stops at the first
failing clause): a cheap single-operation bug with ``--quick`` (whose clauses the full suite runs
too, so the full suite fails it as well), every other bug with the full suite.
scripts/mutation_study.py runs the same study without ``-x`` and publishes, per bug, every clause
that catches it (docs/reports/conformance/mutation-study.md).

The runs of one kind share a process or two (tests/helpers/conformance_runs.py calls the CLI's ``main``
once per run): the CLI's start costs seconds, more than most runs. Every run is still its own
conformance session with its own report; each test checks one run's exit status and report.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from broken_backends import MUTANTS

HELPERS = Path(__file__).resolve().parents[1] / "helpers"  # broken_backends and conformance_runs
QUICK = [name for name, mutant in MUTANTS.items() if mutant.quick]
FULL = [name for name, mutant in MUTANTS.items() if not mutant.quick]
NAMED = [
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
    ("SlotsFromFirstPut", ["test_only_storage_errors_escape"]),
    ("KeyErrorOnMiss", ["test_only_storage_errors_escape", "test_misses_are_per_key"]),
]


def run_suites(runs: dict[str, list[str]], tmp_path: Path, processes: int = 1) -> dict[str, dict]:
    """Run ``hicache-storage conformance broken_backends:<mutant> <extra>`` for each entry of
    ``runs`` (name: [mutant, *extra]), the runs dealt out to ``processes`` processes; per name: its
    exit status, the tail of its output and its report (``None`` where its process stopped before
    that run ended)."""
    # CI set as in a vendor's CI, where pytest truncates no failure explanation (a clause that
    # left pytest to explain a failed == of MiB pages ran for minutes there, never here)
    env = {**os.environ, "CI": "true", "PYTHONPATH": f"{HELPERS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    argvs = {}
    for name, (mutant, *extra) in runs.items():
        (tmp_path / name).mkdir()
        argvs[name] = ["conformance", f"broken_backends:{mutant}", "--report-dir", str(tmp_path / name), *extra]
    names = list(argvs)
    started = []
    for i in range(processes):
        share = {name: argvs[name] for name in names[i::processes]}
        runs_file = tmp_path / f"runs-{i}.json"
        runs_file.write_text(json.dumps(share))
        command = [sys.executable, str(HELPERS / "conformance_runs.py"), str(tmp_path), str(runs_file)]
        started.append((subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env), share))
    ended, stderr, status = {}, {}, {}
    for process, share in started:
        try:
            out, err = process.communicate(timeout=300 * len(share))
        except subprocess.TimeoutExpired:  # a backstop: a run past 300 s ends its process itself
            process.kill()
            out, err = process.communicate()
        ended |= {line["name"]: line["exit"] for line in map(json.loads, out.splitlines())}
        stderr |= dict.fromkeys(share, err)
        code = process.returncode
        status |= dict.fromkeys(share, f"killed by signal {-code}" if code < 0 else f"exit status {code}")
    results = {}
    for name, (mutant, *_) in runs.items():
        log = tmp_path / f"{name}.log"
        output = log.read_text() if log.exists() else ""
        if name not in ended:
            output += f"\n[the process running this suite stopped before it ended: {status[name]}]\n{stderr[name][-3000:]}"
        report_file = tmp_path / name / f"broken_backends-{mutant}.json"
        report = json.loads(report_file.read_text()) if name in ended and report_file.exists() else None
        results[name] = {"exit": ended.get(name), "output": output, "report": report}
    return results


def outcomes_of(run: dict) -> dict[str, str]:
    assert run["report"] is not None, f"no report was written:\n{run['output'][-3000:]}"
    assert run["exit"] != 0, f"the suite passed a broken backend:\n{run['output'][-2000:]}"
    assert not run["report"]["ok"]
    return {r["clause"]: r["outcome"] for r in run["report"]["results"]}


def assert_caught(outcomes: dict[str, str], name: str) -> None:
    failed = [clause for clause, outcome in outcomes.items() if outcome == "failed"]
    errors = [clause for clause, outcome in outcomes.items() if outcome == "error"]
    assert failed, f"{name}: no clause failed (errors in {errors[:3]}); a mutant must fail a clause, not crash the run"


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory) -> dict[str, dict]:
    """Single-operation bugs: deterministic, so two processes share the runs."""
    return run_suites({name: [name, "--quick", "-x"] for name in QUICK}, tmp_path_factory.mktemp("quick"), processes=2)


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory) -> dict[str, dict]:
    """Races among them, one run at a time. Their clauses do not count on a quiet machine: each
    runs until it has observed a stated number of overlapping calls (conformance/clauses_concurrency.py),
    and scripts/mutation_study.py measures the detection rate with every core busy."""
    return run_suites({name: [name, "-x"] for name in FULL}, tmp_path_factory.mktemp("full"))


@pytest.fixture(scope="module")
def named_runs(tmp_path_factory) -> dict[str, dict]:
    """Every clause named for a bug runs (no -x), and only those (-k); single-operation bugs, so
    two processes share the runs."""
    return run_suites(
        {broken: [broken, "--quick", "-k", " or ".join(c.split("[")[0] for c in must_fail)] for broken, must_fail in NAMED},
        tmp_path_factory.mktemp("named"),
        processes=2,
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", FULL)
def test_full_suite_catches(full_runs, name):
    assert_caught(outcomes_of(full_runs[name]), name)


@pytest.mark.parametrize("name", QUICK)
def test_quick_suite_catches(quick_runs, name):
    """A cheap bug fails --quick; the full suite runs every quick clause too, so it fails as well."""
    assert_caught(outcomes_of(quick_runs[name]), name)


@pytest.mark.parametrize("broken, must_fail", NAMED)
def test_named_clauses_catch_their_bug(named_runs, broken, must_fail):
    """The clause written for a bug is among those that catch it (every clause runs here, no -x)."""
    outcomes = outcomes_of(named_runs[broken])
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


def test_the_report_names_an_untyped_error_as_such(named_runs):
    """A clause failed by a bare exception says so in the report; one failed by an assertion does not."""
    details = {r["clause"]: r["detail"] for r in named_runs["KeyErrorOnMiss"]["report"]["results"]}
    assert details["test_misses_are_per_key"].startswith("untyped error: the store raised KeyError, not a StorageError: KeyError")
    assert "untyped errors escaped the connector, not StorageErrors" in details["test_only_storage_errors_escape"]
    assert "a miss read into a page: KeyError" in details["test_only_storage_errors_escape"]
    first_put = {r["clause"]: r["detail"] for r in named_runs["SlotsFromFirstPut"]["report"]["results"]}
    assert "a zero-byte page as the first page put: ZeroDivisionError" in first_put["test_only_storage_errors_escape"]
    lying = {r["clause"]: r["detail"] for r in named_runs["LyingExists"]["report"]["results"]}
    assert not lying["test_misses_are_per_key"].startswith("untyped error")


# --- connectors with a server, wrong both ways: only the backdoor catches them -----------------

#: Each broken connector of tests/helpers/broken_backends.py that is wrong both ways, with its parent's
#: configuration in hicache_storage.testing.connector_configs.
BOTH_WAYS = {
    "RekeyedRedis": "redis",
    "ScrambledS3": "s3",
    "RekeyedMooncake": "mooncake",
    "RekeyedHF3FS": "hf3fs",
    "ScrambledFsspec": "fsspec-memory",
}
#: The clauses that read or write through the backdoor (the realistic sizes read it too).
BACKDOOR_CLAUSES = {
    "test_backdoor_sees_what_put_stored",
    "test_get_and_exists_serve_what_the_backdoor_stored",
    "test_delete_removes_what_the_backdoor_sees",
    "test_roundtrip_realistic_page_size[3MiB+7]",
    "test_roundtrip_realistic_page_size[20MiB]",
}
ROUND_TRIPS_AND_BACKDOOR = "backdoor or realistic or roundtrip_segments or buffer_roundtrip or (test_roundtrip and random)"


@pytest.fixture(scope="module")
def both_ways_runs(request, tmp_path_factory) -> dict[str, dict]:
    """The backdoor clauses and a round trip of every kind (-k: test_roundtrip's random pages only,
    as its other patterns move the same bytes), on each connector's real server; two processes."""
    from hicache_storage.testing.connector_configs import CONFIGS

    scratch = tmp_path_factory.mktemp("both-ways-data")
    runs = {}
    for broken, label in BOTH_WAYS.items():
        entry = CONFIGS[label]
        servers = {name: request.getfixturevalue(name) for name in entry.servers}
        config = entry.config(servers, scratch, f"both-ways-{broken.lower()}")
        runs[broken] = [broken, "--config", json.dumps(config), "-k", ROUND_TRIPS_AND_BACKDOOR]
    return run_suites(runs, tmp_path_factory.mktemp("both-ways"), processes=2)


@pytest.mark.services
@pytest.mark.parametrize("broken", BOTH_WAYS)
def test_backdoor_catches_a_connector_wrong_both_ways(both_ways_runs, broken):
    """Re-keyed or scrambled on write and undone on read: every round trip passes, and every backdoor
    clause its store can run fails (the realistic sizes are unsupported above 3FS's 1 MiB slots)."""
    outcomes = outcomes_of(both_ways_runs[broken])
    ran = {clause for clause, outcome in outcomes.items() if outcome != "unsupported"}
    assert "test_backdoor_sees_what_put_stored" in ran
    assert {clause for clause in ran if outcomes[clause] == "failed"} == ran & BACKDOOR_CLAUSES
    assert all(outcomes[clause] == "passed" for clause in ran - BACKDOOR_CLAUSES), outcomes
