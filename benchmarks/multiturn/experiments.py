"""The HiCache blog's two other experiments, as bench modes: branch backup and a pre-filled L3.

* :func:`branch_backup` (hybrid models): a shared prefix and its branches. Two requests share the
  prefix and diverge; the second leaves the state a later request needs at the branch point (a
  recurrent checkpoint, the SWA window before it) on a prefix whose KV is already backed up. Then
  L1 and L2 are emptied before each of ``branches`` more requests for the prefix with new
  suffixes. With checkpoint backfill (``ControllerConfig.backfill``) that state is backed up on
  its own and every request restores the whole prefix from L3; without, the request resumes at
  the deepest boundary every component's stored state allows. Both in one run, same requests.
* :func:`prefilled_l3`: the workload served with L1+L2+L3 on an empty store, and again on a
  fresh engine (empty L1 and L2) whose store already holds the workload's KV, as when another
  instance served it earlier: input throughput and mean TTFT side by side.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from hicache_storage.benchmarks.multiturn.runner import BenchConfig, describe, summarize
from hicache_storage.benchmarks.multiturn.workload import Served, run_workload
from hicache_core.engine import CacheTiers, Engine, EngineConfig, Request


def branch_backup(config: BenchConfig, shared: int = 6400, new: int = 3600, branches: int = 10) -> dict[str, Any]:
    """Full restores of the shared prefix and token hit rate, with backfill on and off (same requests)."""
    if not config.hybrid:
        raise ValueError(f"branch backup needs a hybrid model (hybrid-swa or hybrid-swa-recurrent), got {config.model!r}")
    for name, value in (("shared", shared), ("new", new), ("branches", branches)):
        if value < 1:
            raise ValueError(f"branch backup: {name} must be at least 1, got {value}")
    vocab = config.model_and_compute()[0].vocab_size
    rng = random.Random(config.workload.seed)
    prefix = [rng.randrange(vocab) for _ in range(shared)]
    suffixes = [[rng.randrange(vocab) for _ in range(new)] for _ in range(branches + 2)]
    restorable = shared // config.page_size * config.page_size
    rows = []
    for backfill in (True, False):
        scratch = tempfile.mkdtemp(prefix="hicache-branch-")
        try:
            engine_config = _with_backfill(config.engine_config(CacheTiers.L1_L2_L3, f"{scratch}/l3"), backfill)
            output = config.workload.output_length
            with Engine(engine_config) as engine:
                engine.serve([Request("first", prefix + suffixes[0], output)])
                # The branch comes once the prefix is backed up: a backup still in flight when the
                # branch inserts its state would carry that state along, and backfill would have
                # nothing to do.
                engine.drain()
                engine.serve([Request("branch", prefix + suffixes[1], output)])
                results = []
                for i, suffix in enumerate(suffixes[2:]):
                    engine.flush_cache()  # evicted from the device (and the host): L3 only
                    results += engine.serve([Request(f"again-{i}", prefix + suffix, output)])
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        prompt = sum(r.prompt_tokens for r in results)
        cached = sum(r.cached_tokens for r in results)
        rows.append(
            {
                "backfill": backfill,
                "requests": len(results),
                "full_restores": sum(r.cached_storage >= restorable for r in results),
                "token_hit_rate": cached / prompt,
                "cached_from_l3": [r.cached_storage for r in results],
                "ttft_mean_ms": sum(r.ttft_s for r in results) / len(results) * 1e3,
            }
        )
    return {
        "config": describe(config),
        "experiment": "branch-backup",
        "shape": {"shared": shared, "new": new, "branches": branches, "restorable": restorable},
        "branch_backup": rows,
    }


def _with_backfill(engine_config: EngineConfig, backfill: bool) -> EngineConfig:
    return replace(engine_config, controller=replace(engine_config.controller, backfill=backfill))


def prefilled_l3(config: BenchConfig, progress: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """L1+L2+L3 on an empty store, then on a store holding the workload's KV (fresh L1 and L2)."""
    rows = []
    for label, prefill in (("plain L3", False), ("pre-filled L3", True)):
        scratch = tempfile.mkdtemp(prefix="hicache-prefilled-")
        try:
            engine_config = config.engine_config(CacheTiers.L1_L2_L3, f"{scratch}/l3")  # one tenant: the fill is found
            questions = config.workload.questions(engine_config.model.vocab_size)
            fill_s = None
            if prefill:
                started = time.perf_counter()
                with Engine(engine_config) as filler:
                    run_workload(filler, config.workload, questions)
                    filler.drain()
                fill_s = time.perf_counter() - started
            on_round = (lambda r, l=label: progress(l, r)) if progress else None
            with Engine(engine_config) as engine:
                started = time.perf_counter()
                served: list[Served] = run_workload(engine, config.workload, questions, on_round)
                wall = time.perf_counter() - started
                metrics = engine.metrics.snapshot()
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        overall = summarize("all", served, wall)
        rows.append({"run": label, "fill_s": fill_s, "overall": asdict(overall), "metrics": metrics})
    return {"config": describe(config), "experiment": "prefilled-l3", "prefilled_l3": rows}
