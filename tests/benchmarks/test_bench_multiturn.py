"""`hicache-storage bench` runs end to end and reports every tier side by side (figures drift: not asserted)."""

import json
import subprocess
import sys

import pytest

from hicache_storage.benchmarks.multiturn.runner import BenchConfig, run_bench
from hicache_storage.benchmarks.multiturn.workload import Workload
from hicache_core.controller import StopPolicy
from hicache_storage.cost import LoadPolicy

TINY = ["--clients", "3", "--rounds", "3", "--request-length", "64", "--output-length", "2", "--max-running", "2",
        "--device-tokens", "256", "--page-size", "16", "--prefetch-threshold", "16", "--prefill-tokens-per-s", "1e6",
        "--decode-step-ms", "0.1", "--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--stop-policy", "wait_complete"]


def tiny_cli(*extra):
    return [sys.executable, "-m", "hicache_storage.cli", "bench", *TINY, *extra]


def test_modeled_bench_restores_from_l3_once_history_overflows_l1_and_l2():
    config = BenchConfig(
        workload=Workload(clients=6, rounds=3, request_length=64, output_length=2, max_running=2),
        prefill_tokens_per_s=1e6, decode_step_s=1e-4, layers=2, kv_heads=2, head_dim=16,
        page_size=16, device_tokens=256, host_ratio=1.0, prefetch_threshold=16,
        # compute this fast leaves best_effort prefetches no time to land: wait for them instead
        stop_policy=StopPolicy.WAIT_COMPLETE,
        # it counts the tokens and bytes L3 served: every stored page is read, whatever the speeds
        # (a bench takes the load policy only; tests/helpers/pinned_cost.py says why)
        load_policy=LoadPolicy.ALL,
    )
    result = run_bench(config)
    runs = {run["tiers"]: run for run in result["runs"]}
    assert list(runs) == ["L1", "L1+L2", "L1+L2+L3"]
    assert runs["L1"]["overall"]["host_tokens"] == runs["L1"]["overall"]["storage_tokens"] == 0
    assert runs["L1+L2"]["overall"]["storage_tokens"] == 0
    l3 = runs["L1+L2+L3"]
    assert l3["overall"]["storage_tokens"] > 0 and l3["storage_bytes_written"] > 0 and l3["storage_bytes_read"] > 0
    assert l3["overall"]["cache_hit_rate"] > runs["L1"]["overall"]["cache_hit_rate"]
    for run in runs.values():
        assert [r["round"] for r in run["rounds"]] == [0, 1, 2]
        assert sum(r["prompt_tokens"] for r in run["rounds"]) == run["overall"]["prompt_tokens"]
    legs = result["legs"]
    assert all(legs[name] > 0 for name in ("storage_write", "storage_read", "backup", "load")), legs
    l1_wall = runs["L1"]["overall"]["wall_s"]
    for run in runs.values():
        bound = run["bound"]
        times = {"compute": bound["compute_s"], "storage": bound["storage_s"], "copies": bound["copies_s"]}
        assert bound["bound_s"] == max(times.values()) and times[bound["limit"]] == bound["bound_s"]
        assert bound["efficiency"] == pytest.approx(bound["bound_s"] / run["overall"]["wall_s"])
        assert bound["bound_vs_l1"] == pytest.approx(l1_wall / bound["bound_s"])
    assert runs["L1"]["bound"]["storage_s"] == runs["L1"]["bound"]["copies_s"] == 0, "L1 moves nothing"
    assert runs["L1+L2+L3"]["bound"]["storage_s"] > 0 and runs["L1+L2+L3"]["bound"]["copies_s"] > 0


@pytest.mark.slow
def test_bench_cli_writes_table_json_and_plot(tmp_path):
    result = subprocess.run(tiny_cli("--out", str(tmp_path)), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| L1+L2+L3 |" in result.stdout
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [run["tiers"] for run in data["runs"]] == ["L1", "L1+L2", "L1+L2+L3"]
    assert data["config"]["backend_config"] is None  # a given config is written as "(given)": it may hold secrets
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (tmp_path / "bench.md").read_text()
    assert markdown.startswith("## hicache-storage bench")
    assert "Legs measured in this run: store write" in markdown and "| bound vs L1 | efficiency (limit) |" in markdown


@pytest.mark.slow
def test_bench_cli_reference_model_without_round_barrier(tmp_path):
    result = subprocess.run(tiny_cli("--model", "reference", "--no-round-barrier", "--tiers", "L1,L1+L2+L3", "--out", str(tmp_path)),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["config"]["workload"]["round_barrier"] is False and data["config"]["model"] == "reference"
    assert sum(run["overall"]["requests"] for run in data["runs"]) == 2 * 3 * 3


@pytest.mark.slow
def test_bench_cli_compares_stop_policies(tmp_path):
    result = subprocess.run(tiny_cli("--compare-stop-policies", "--out", str(tmp_path)), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "bench-stop-policies.json").read_text())["stop_policies"]
    assert {(r["recompute"], r["stop_policy"]) for r in rows} == {
        (cost, policy) for cost in ("expensive", "cheap") for policy in ("best_effort", "wait_complete", "timeout")
    }


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--clients", "-3"], "bench: Workload.clients must be at least 1, got -3"),
        (["bench-io", "memory", "--page-sizes", "12Q"], "bench-io --page-sizes: not a size: '12Q'"),
        (["bench", "--preset", "long-history", "--device-tokens", "100"], "device_tokens (100) must be a positive multiple of page_size (64)"),
        (["bench", "--host-ratio", "0"], "host_ratio must be positive, got 0.0"),
    ],
)
def test_bad_bench_arguments_are_one_line_and_exit_2(capsys, argv, message):
    from hicache_storage.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_the_cli_defaults_are_the_engine_defaults():
    """`hicache-storage bench` with no flags runs BenchConfig's defaults (the CLI once kept
    `best_effort` after the engine's default became `timeout`, and every CLI run measured the old policy)."""
    from hicache_storage.cli import build_parser

    args = build_parser().parse_args(["bench"])
    defaults = BenchConfig()
    assert StopPolicy(args.stop_policy) is defaults.stop_policy
    assert args.write_policy == defaults.write_policy.value
    for name in ("layout", "page_size", "host_ratio", "prefetch_threshold", "dtype", "model"):
        assert getattr(args, name) == getattr(defaults, name), name
    for name in ("prefill_tokens_per_s", "layers", "kv_heads", "head_dim"):
        assert getattr(args, name) is None, f"--{name} must default to BenchConfig's value (None), not its own"


def test_legs_measured_twice_keep_the_faster_of_each_speed():
    """The bound is the least time the legs allow: a slow measurement (the disk still writing back
    an earlier run) must not lower it, and a leg measured once only keeps that measurement."""
    from hicache_storage.benchmarks.multiturn.bound import Legs

    before = Legs(storage_write=0.2e9, storage_read=2.0e9, backup=3e9, load=1e9, prefill_tokens_per_s=1e4, decode_step_s=0.01)
    after = Legs(storage_write=0.6e9, storage_read=1.5e9, backup=2e9, load=2e9, prefill_tokens_per_s=1e4, decode_step_s=0.01)
    best = before.fastest(after)
    assert (best.storage_write, best.storage_read, best.backup, best.load) == (0.6e9, 2.0e9, 3e9, 2e9)
    no_store = Legs(storage_write=None, storage_read=None, backup=1e9, load=1e9, prefill_tokens_per_s=None, decode_step_s=None)
    assert no_store.fastest(after).storage_write == 0.6e9 and no_store.fastest(no_store).storage_read is None


def test_a_store_speed_a_run_reached_counts_as_measured():
    """A run's own backups and prefetches show speeds the store allows: a timing slower than them
    (one batch on a disk still writing back) must not hold the bound above what the run did."""
    from hicache_storage.benchmarks.multiturn.bound import Legs

    timed = Legs(storage_write=0.3e9, storage_read=4.0e9, backup=3e9, load=1e9, prefill_tokens_per_s=1e4, decode_step_s=0.01)
    run = {"storage_backup_bytes": 1.0e9, "storage_backup_seconds": 2.0, "prefetch_bytes": 3.0e9, "prefetch_seconds": 2.0}
    reached = timed.reached_by(run)
    assert (reached.storage_write, reached.storage_read) == (0.5e9, 4.0e9), "the faster of each: the run's write, the timed read"
    assert (reached.backup, reached.load, reached.prefill_tokens_per_s) == (3e9, 1e9, 1e4)
    l1_only = {"storage_backup_bytes": 0, "storage_backup_seconds": 0.0, "prefetch_bytes": 0, "prefetch_seconds": 0.0}
    assert timed.reached_by(l1_only) == timed
    no_store = Legs(storage_write=None, storage_read=None, backup=1e9, load=1e9, prefill_tokens_per_s=None, decode_step_s=None)
    assert no_store.reached_by(l1_only) == no_store


def _legs_config() -> BenchConfig:
    from hicache_core.engine import CacheTiers

    return BenchConfig(
        workload=Workload(clients=2, rounds=1, request_length=64, output_length=2, max_running=2), tiers=(CacheTiers.L1_L2_L3,),
        layers=2, kv_heads=2, head_dim=16, page_size=16, device_tokens=256,
    )


def test_timing_the_store_does_not_wait_for_its_pages_to_be_removed(monkeypatch):
    """A store with read leases refuses to remove a page until the lease a read took expires
    (Mooncake's own master holds one 10 s, longer than the store's call timeout). Timing the
    store's legs removed each timing's pages right after reading them, behind that timeout: every
    removal failed after 5 s, the bench waited for each, and a Mooncake node kept 1.2 GB per
    timing. Now the bench goes on at once; the pages go when the store allows (here: when the
    held removal is let through), and the store is closed after."""
    from hicache_storage.benchmarks.multiturn import bound
    from hicache_storage.benchmarks.multiturn.runner import measure_bench_legs
    from hicache_storage.connectors.memory import MemoryBackend
    from hicache_storage.layers import FaultInjectionLayer

    stores: list[tuple[MemoryBackend, FaultInjectionLayer]] = []

    def leasing(name, config):
        memory = MemoryBackend()
        stores.append((memory, FaultInjectionLayer(memory, {"clear": {"hang_rate": 1.0, "hang_seconds": 30}})))
        return stores[-1][1]

    monkeypatch.setattr(bound, "create_backend", leasing)
    legs = measure_bench_legs(_legs_config())  # returns while the removal is held
    assert legs.storage_write and legs.storage_read and legs.storage_write > 0 and legs.storage_read > 0
    assert len(stores) == 1
    memory, faults = stores[0]
    try:
        assert len(memory.page_table.pages) > 0 and not faults.closed, "the removal is still held: the pages are there"
    finally:
        faults.release_hangs()
        bound.wait_for_cleanups(30)
    assert not memory.page_table.pages and faults.closed, "removed once the store allowed it, then closed"
    assert [(event.operation, event.fault) for event in faults.events] == [("clear", "hang")], "one removal of the whole timing"


@pytest.fixture(scope="module")
def mooncake_master_own_lease():
    """A Mooncake master with its own read lease (10 s, as operators run it), not the tests' 300 ms."""
    pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine(-non-cuda)")
    from hicache_storage.testing.mooncake_master import MooncakeMaster

    master = MooncakeMaster(lease_ttl_ms=None)
    master.start()
    yield master
    master.stop()


@pytest.mark.services
def test_timing_a_mooncake_store_leaves_none_of_its_pages_there(mooncake_master_own_lease, monkeypatch, caplog):
    """Against a real Mooncake master with its own 10 s read lease, longer than the store's call
    timeout: every page the timing wrote is gone once its removal ends, and no removal was refused
    (before, each timing's delete failed at the timeout and its pages stayed)."""
    import logging
    from dataclasses import replace

    from hicache_storage import Store, create_backend
    from hicache_storage.benchmarks.multiturn import bound
    from hicache_storage.benchmarks.multiturn.runner import measure_bench_legs

    master = mooncake_master_own_lease
    written: list = []
    put_from = Store.put_from

    def recording(self, keys, sources):
        written.extend(keys)
        return put_from(self, keys, sources)

    monkeypatch.setattr(Store, "put_from", recording)
    config = replace(_legs_config(), backend="mooncake", backend_config=master.client_config())
    with caplog.at_level(logging.WARNING, logger=bound.__name__):
        measure_bench_legs(config)
        bound.wait_for_cleanups(60)
    monkeypatch.undo()
    assert written and all(key.scope.namespace.tenant.startswith("legs-") for key in written)
    with Store(create_backend("mooncake", master.client_config())) as store:
        assert not any(store.exists(written)), "every timing page removed"
    assert "timing pages failed" not in caplog.text and "did not answer" not in caplog.text


def test_a_store_that_refuses_to_remove_the_timing_pages_keeps_them_with_a_warning(monkeypatch, caplog):
    import logging

    from hicache_storage.benchmarks.multiturn import bound
    from hicache_storage.benchmarks.multiturn.runner import measure_bench_legs
    from hicache_storage.connectors.memory import MemoryBackend
    from hicache_storage.layers import FaultInjectionLayer

    stores: list[FaultInjectionLayer] = []

    def refusing(name, config):
        stores.append(FaultInjectionLayer(MemoryBackend(), {"clear": {"error_rate": 1.0, "errors": ["timeout"]}}))
        return stores[-1]

    monkeypatch.setattr(bound, "create_backend", refusing)
    with caplog.at_level(logging.WARNING, logger=bound.__name__):
        measure_bench_legs(_legs_config())
        bound.wait_for_cleanups(30)
    assert len(stores) == 1 and stores[0].closed
    assert "removing" in caplog.text and "timing pages failed" in caplog.text and "tenant 'legs-" in caplog.text


@pytest.mark.parametrize("model, tiers", [("modeled", ("L1", "L1+L2+L3")), ("modeled", ("L1+L2+L3",)), ("reference", ("L1+L2+L3",))])
def test_each_run_records_its_rounds_work_and_a_reachable_bound_under_modeled_compute(model, tiers):
    """The reachable bound's input, request by request, adds up with what the run served; no
    figure is asserted (the cost model's loads and the times drift), only the structure."""
    from hicache_core.engine import CacheTiers

    workload = Workload(clients=3, rounds=3, request_length=64, output_length=2, max_running=2)
    config = BenchConfig(
        model=model, workload=workload, tiers=tuple(CacheTiers(t) for t in tiers),
        prefill_tokens_per_s=1e6, decode_step_s=1e-4, layers=2, kv_heads=2, head_dim=16,
        page_size=16, device_tokens=256, prefetch_threshold=16, stop_policy=StopPolicy.WAIT_COMPLETE,
    )
    given_l1_wall_s = 1.0  # an earlier L1 run's, for a bench without L1
    result = json.loads(json.dumps(run_bench(config, l1_wall_s=given_l1_wall_s)))  # as the bench writes it
    assert [run["tiers"] for run in result["runs"]] == list(tiers)
    for run in result["runs"]:
        assert len(run["round_work"]) == len(run["rounds"]) == workload.rounds
        for stats, work in zip(run["rounds"], run["round_work"]):
            requests = work["requests"]
            assert len(requests) == stats["requests"] == workload.clients
            # every prompt token came from one place: L1, L2, L3 or computed
            assert stats["device_tokens"] + stats["host_tokens"] + stats["storage_tokens"] + stats["computed_tokens"] == stats["prompt_tokens"]
            assert sum(r["from_device"] for r in requests) == stats["device_tokens"]
            assert sum(r["from_host"] for r in requests) == stats["host_tokens"]
            assert sum(r["from_storage"] for r in requests) == stats["storage_tokens"]
            assert sum(r["computed"] for r in requests) == stats["computed_tokens"]
            # the context a request holds is its prompt and its output
            assert sum(r["context"] for r in requests) == stats["prompt_tokens"] + len(requests) * workload.output_length
            for r in requests:
                assert 0 <= r["stored_recomputed"] <= r["computed"], r
                assert r["from_host"] + r["from_storage"] + r["computed"] <= r["context"] - workload.output_length, r
            assert work["storage_written"] >= 0 and work["backed_up"] >= 0
            assert work["shared_pages"] is False, "the workload's conversations share no page"
        if not run["tiers"].endswith("L3"):
            assert all(r["from_storage"] == r["stored_recomputed"] == 0 for w in run["round_work"] for r in w["requests"])
        reachable = run["reachable"]
        if model == "reference":
            assert reachable is None and run["bound"] is None, "the reference model has no modeled compute to bound"
            continue
        assert len(reachable["rounds_s"]) == workload.rounds and all(seconds > 0 for seconds in reachable["rounds_s"])
        assert reachable["bound_s"] == pytest.approx(sum(reachable["rounds_s"]))
        assert reachable["wall_s"] == run["overall"]["wall_s"]
        assert reachable["efficiency"] == pytest.approx(reachable["bound_s"] / reachable["wall_s"])
        # L1's own wall when the bench ran L1, else the one given
        l1_wall = next((r["overall"]["wall_s"] for r in result["runs"] if r["tiers"] == "L1"), given_l1_wall_s)
        assert reachable["bound_vs_l1"] == pytest.approx(l1_wall / reachable["bound_s"])
        stored = sum(r["from_storage"] + r["stored_recomputed"] for w in run["round_work"] for r in w["requests"])
        # each total is rounded from the program's loads on its own: together they may miss by one
        assert abs(reachable["best_loaded_tokens"] + reachable["best_recomputed_tokens"] - stored) <= 1


def test_a_round_shares_pages_exactly_when_two_prompts_begin_with_the_same_page():
    from hicache_storage.benchmarks.multiturn.runner import _share_pages

    assert not _share_pages([(1, 2), (1, 3), (2, 2)])
    assert _share_pages([(1, 2), (4, 4), (1, 2)])
    assert not _share_pages([])
