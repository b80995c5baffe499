"""The bench on modeled hybrid models: every mode end to end, through the CLI and the Python API,
and the modeled runner moves the bytes its pools hold (figures drift: no timing is asserted)."""

import json
import random
import subprocess
import sys
from dataclasses import replace

import pytest

from hicache_storage.benchmarks.multiturn.experiments import branch_backup, prefilled_l3
from hicache_storage.benchmarks.multiturn.runner import BenchConfig, run_bench
from hicache_storage.benchmarks.multiturn.workload import Workload
from hicache_core.controller import ControllerConfig, PrefetchConfig, StopPolicy
from hicache_core.engine import CacheTiers, Engine, EngineConfig, Request
from hicache_core.hybrid.modeled import HYBRID_SHAPES
from hicache_core.requests import HybridPools

from hicache_storage.cost import LoadPolicy

from pinned_cost import LOAD_AND_STORE_EVERY_PAGE

FAST = {"prefill_tokens_per_s": 1e6, "decode_step_s": 1e-4, "stop_policy": StopPolicy.WAIT_COMPLETE}
#: For a bench whose test counts the tokens L3 served: every stored page is read, whatever the
#: speeds (a bench takes the load policy only; tests/helpers/pinned_cost.py says why).
LOAD_EVERY_PAGE = LoadPolicy.ALL
TINY_CLI = ["--clients", "3", "--rounds", "2", "--request-length", "192", "--output-length", "2", "--max-running", "2",
            "--device-tokens", "4096", "--prefetch-threshold", "64", "--prefill-tokens-per-s", "1e6", "--decode-step-ms", "0.1",
            "--stop-policy", "wait_complete"]


PAGE = 16


def small_recurrent_engine(tiers, **overrides):
    """The FULL + SWA + recurrent shape with a 40-token window and small checkpoints, modeled."""
    shape = HYBRID_SHAPES["hybrid-swa-recurrent"]
    return EngineConfig(
        model=replace(shape.config, window=40, state_dim=64), tiers=tiers, page_size=PAGE, device_pages=32, host_pages=64,
        host_ratio=None, hybrid=HybridPools(draft=False), compute=replace(shape.compute, prefill_tokens_per_s=1e6), **overrides,
    )


def bench_cli(tmp_path, *extra):
    return subprocess.run([sys.executable, "-m", "hicache_storage.cli", "bench", *TINY_CLI, *extra, "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)


def test_the_shapes_keep_their_public_configs_pool_sizes():
    swa, recurrent = HYBRID_SHAPES["hybrid-swa"], HYBRID_SHAPES["hybrid-swa-recurrent"]
    assert swa.pool_bytes() == {"full_per_token": 3584, "swa_per_token": 43 * 512, "checkpoint": 0}
    assert swa.config.window == 128 and swa.config.recurrent_layers == 0
    assert recurrent.pool_bytes() == {"full_per_token": 3 * 1280, "swa_per_token": 14 * 1280, "checkpoint": 32 * 64_000 * 2}
    assert recurrent.config.window == 1024
    assert BenchConfig(model="hybrid-swa").prefill_tokens_per_s == swa.compute.prefill_tokens_per_s
    assert BenchConfig(model="hybrid-swa", prefill_tokens_per_s=5.0).prefill_tokens_per_s == 5.0


def test_hybrid_multi_turn_restores_every_pool_from_l3_and_its_bound_counts_them():
    config = BenchConfig(
        model="hybrid-swa",
        workload=Workload(clients=4, rounds=3, request_length=256, output_length=2, max_running=2),
        page_size=64, device_tokens=1024, host_ratio=1.0, prefetch_threshold=64, load_policy=LOAD_EVERY_PAGE, **FAST,
    )
    result = run_bench(config)
    runs = {run["tiers"]: run for run in result["runs"]}
    assert list(runs) == ["L1", "L1+L2", "L1+L2+L3"]
    assert result["config"]["hybrid"]["model"] == "DeepSeek-V4-Flash"
    l3 = runs["L1+L2+L3"]
    assert l3["overall"]["storage_tokens"] > 0
    side = l3["side_pool_bytes"]
    assert side["storage_read"] > 0 and side["backup"] > 0 and side["load"] > 0, side
    assert l3["storage_bytes_read"] == l3["metrics"]["prefetch_bytes"] + side["storage_read"]
    assert runs["L1"]["side_pool_bytes"] == {"load": 0, "backup": 0, "storage_read": 0, "load_seconds": 0.0, "backup_seconds": 0.0}
    for run in runs.values():
        bound = run["bound"]
        assert bound["bound_s"] == max(bound["compute_s"], bound["storage_s"], bound["copies_s"])


def test_the_modeled_runner_moves_what_the_pools_hold(tmp_path):
    """A prompt served, L1 and L2 emptied, the prompt again: the whole-page prefix comes back from
    L3 with exactly its SWA window and its checkpoint (the bytes the pools hold for that boundary)."""
    config = small_recurrent_engine(
        CacheTiers.L1_L2_L3, storage_backend="file", storage_config={"root": str(tmp_path)},
        controller=ControllerConfig(
            prefetch=PrefetchConfig(threshold_tokens=PAGE, stop_policy=StopPolicy.WAIT_COMPLETE), cost=LOAD_AND_STORE_EVERY_PAGE
        ),
    )
    model, page = config.model, PAGE
    prompt = [random.Random(1).randrange(model.vocab_size) for _ in range(200)]
    with Engine(config) as engine:
        engine.serve([Request("a", prompt, 2)])
        engine.flush_cache()
        before = dict(engine.runner.moved.bytes)
        (again,) = engine.serve([Request("b", prompt + [7, 7], 2)])
        moved = {k: v - before[k] for k, v in engine.runner.moved.bytes.items()}
    cut = (len(prompt) - 1) // page * page
    assert again.cached_storage == cut and again.cached_device == again.cached_host == 0
    window_pages = -(-(model.window - 1) // page)
    checkpoint = model.recurrent_layers * model.state_dim * 2
    assert moved["storage_read"] == window_pages * page * model.swa_geometry.token_bytes + checkpoint
    assert moved["load"] == moved["storage_read"], "what was read from L3 went to the device"


def test_branch_backup_restores_every_branch_with_backfill_only():
    config = BenchConfig(model="hybrid-swa-recurrent", workload=Workload(output_length=2), device_tokens=8192,
                         load_policy=LOAD_EVERY_PAGE, **FAST)
    result = branch_backup(config, shared=1280, new=128, branches=3)
    on, off = result["branch_backup"]
    assert on["backfill"] and not off["backfill"]
    assert on["full_restores"] == 3 and on["cached_from_l3"] == [1280] * 3
    assert off["full_restores"] < 3 and off["token_hit_rate"] < on["token_hit_rate"]


def test_a_prefilled_store_serves_round_zero_from_l3():
    config = BenchConfig(model="hybrid-swa", workload=Workload(clients=2, rounds=2, request_length=256, output_length=2, max_running=2),
                         device_tokens=2048, prefetch_threshold=64, load_policy=LOAD_EVERY_PAGE, **FAST)
    plain, filled = prefilled_l3(config)["prefilled_l3"]
    assert plain["run"] == "plain L3" and filled["fill_s"] is not None
    assert plain["overall"]["storage_tokens"] == 0 and filled["overall"]["storage_tokens"] > 0


@pytest.mark.parametrize(
    "extra, stem, heading",
    [
        (["--model", "hybrid-swa-recurrent"], "bench", "## hicache-storage bench"),
        (["--model", "hybrid-swa", "--experiment", "branch-backup", "--shared-tokens", "640", "--branch-tokens", "64", "--branches", "2"],
         "bench-branch-backup", "## Branch backup"),
        (["--model", "hybrid-swa", "--experiment", "prefilled-l3", "--rounds", "1"], "bench-prefilled-l3", "## Pre-filled L3"),
    ],
)
def test_every_hybrid_mode_runs_through_the_cli(tmp_path, extra, stem, heading):
    result = bench_cli(tmp_path, *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    assert heading in result.stdout
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert data["config"]["hybrid"]["name"] == extra[1]
    assert (tmp_path / f"{stem}.md").read_text().startswith(heading)
    assert (tmp_path / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--experiment", "branch-backup"], "--experiment branch-backup needs a hybrid --model"),
        (["bench", "--model", "hybrid-swa", "--layers", "4"], "a hybrid --model has its own shape"),
        (["bench", "--model", "hybrid-swa", "--experiment", "prefilled-l3", "--compare-stop-policies"], "--compare-stop-policies is a multi-turn mode"),
    ],
)
def test_bad_hybrid_bench_arguments_are_one_line_and_exit_2(capsys, argv, message):
    from hicache_storage.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_an_unknown_model_is_refused_by_the_python_api():
    with pytest.raises(ValueError, match="model must be one of reference, modeled, hybrid-swa, hybrid-swa-recurrent"):
        BenchConfig(model="hybrid-mamba")


def test_a_load_short_of_device_memory_resumes_where_every_component_accepts(tmp_path):
    """The controller's fallback when a host prefix cannot be loaded (device memory short) must be
    a boundary every component accepts: the long-history bench on FULL + SWA + recurrent once
    started a request on the device part's end, a node without a checkpoint."""
    config = small_recurrent_engine(CacheTiers.L1_L2)
    model = config.model
    prompt = [random.Random(2).randrange(model.vocab_size) for _ in range(200)]
    with Engine(config) as engine:
        engine.serve([Request("a", prompt, 2)])
        engine.drain()
        tree = engine.tree
        match = tree.match_prefix(prompt)
        leaf = match.device_node
        assert leaf.end == 192 and engine.runner.checkpoints.present(leaf, device=True)
        tree.evict_device(len(leaf.key), None)  # the leaf leaves the device; its parent has no checkpoint
        match = tree.match_prefix(prompt)
        assert match.device_node is leaf.parent and not engine.runner.checkpoints.present(match.device_node, device=True)
        resume = tree.resume_point(match.host_node, on_device=False)
        assert resume is leaf
        engine.controller.alloc_device = lambda tokens: None  # type: ignore[method-assign]
        node, load = engine.controller.load_back(match, resume)
        assert load is None and node is not match.device_node
        assert node is tree.root or all(c.accepts(node, True) for c in tree.components)
        tree.unlock(node)
