"""One role of the vLLM tier (a writer, a reader...) in a process of its own: real vLLM engines, one after another.

    python engine_role.py PLAN.json RESULT.json

``PLAN.json``::

    {"model": DIR, "make_model": {TinyLlama fields} | null,
     "engines": [{"name": "write-file", "kv": EXTRA_CONFIG | null, "tp": 1,
                  "max_tokens": 40, "batches": [{"name": "set1", "prompts": [[token ids], ...]}],
                  "transfer": {other kv_transfer_config fields} | absent,
                  "offload": OFFLOADING_EXTRA_CONFIG | absent}]}

Each engine is vLLM's ``LLM`` with the tier's settings, our connector as its KV connector when
``kv`` is given (its ``kv_connector_extra_config``), vLLM's ``OffloadingConnector`` when
``offload`` is (its ``kv_connector_extra_config``: our secondary tier behind vLLM's CPU
offloading), none otherwise. Every batch is one ``generate`` call, greedy. ``RESULT.json`` is
rewritten after each engine: per engine and batch, every request's generated tokens, vLLM's
``num_cached_tokens`` and the connector's report (``kv_transfer_params``); the connector's
counters where the engine runs in this process (for an ``offload`` engine, each secondary
tier's); or the error that stopped the engine. An engine that fails does not stop the next one.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32


def engine_kwargs(
    model: str,
    kv: dict[str, Any] | None,
    tp: int,
    transfer: dict[str, Any] | None = None,
    offload: dict[str, Any] | None = None,
) -> dict[str, Any]:
    # float32: in bfloat16 the greedy outputs of this random model depend on how a prompt's
    # tokens were split into prefill chunks (loaded prefix + rest vs one prefill): they differ
    # from the no-L3 run now and then, as they differ with vLLM's own prefix cache, and the
    # machine's CPU decides which prompts. In float32 the runs are identical.
    kwargs: dict[str, Any] = {
        "model": model,
        "dtype": "float32",
        "skip_tokenizer_init": True,
        "enable_prefix_caching": True,
        "enforce_eager": True,
        "block_size": BLOCK_SIZE,
        "max_model_len": 4096,
        "kv_cache_memory_bytes": 64 << 20,
        "seed": 0,
    }
    if tp > 1:
        kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
    if kv is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "HiCacheStorageConnector",
            "kv_connector_module_path": "hicache_storage.vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": kv,
            **(transfer or {}),
        }
    elif offload is not None:
        kwargs["kv_transfer_config"] = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": offload}
    return kwargs


def counters(llm: Any) -> dict[str, dict[str, int]]:
    """The connector's counters on each side that runs in this process (the scheduler always does
    here; the worker too at TP 1)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    found: dict[str, dict[str, int]] = {}
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    connector = getattr(getattr(core, "scheduler", None), "connector", None)
    if connector is not None and connector.scheduler is not None:
        found["scheduler_store"] = dict(connector.scheduler.store.counts)
    if has_kv_transfer_group():
        worker = get_kv_transfer_group().worker
        # generate() returns a request's output before its blocks' save ends: read the counts
        # once every save handed out has ended (the mooncake writer read 53 of 54 blocks once)
        worker.wait_for_saves()
        found["worker"] = dict(worker.counts)
        found["worker_store"] = dict(worker.store.counts)
        found["worker_stats"] = worker.store.store.stats()
    return found


def tier_counters(llm: Any) -> list[dict[str, Any]]:
    """Each secondary tier's counters (``HiCacheStorageTier.counts``), its store's and the store's
    stats, once the transfers it was given have ended."""
    core = llm.llm_engine.engine_core.engine_core
    manager = core.scheduler.connector.connector_scheduler.manager
    for tier in manager.secondary_tiers:
        tier.drain_jobs()
    return [
        {"tier": dict(tier.counts), "store": dict(tier.store.counts), "stats": tier.store.store.stats()}
        for tier in manager.secondary_tiers
    ]


def run_engine(model: str, spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    result: dict[str, Any] = {"batches": {}}
    start = time.perf_counter()
    llm = LLM(**engine_kwargs(model, spec.get("kv"), spec.get("tp", 1), spec.get("transfer"), spec.get("offload")))
    result["start_s"] = round(time.perf_counter() - start, 2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 16), ignore_eos=True, detokenize=False)
        for batch in spec["batches"]:
            start = time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": p} for p in batch["prompts"]], params, use_tqdm=False)
            result["batches"][batch["name"]] = [
                {
                    "tokens": list(out.outputs[0].token_ids),
                    "num_cached_tokens": out.num_cached_tokens,
                    "report": (out.kv_transfer_params or {}).get("hicache_storage"),
                }
                for out in outputs
            ]
            result.setdefault("generate_s", {})[batch["name"]] = round(time.perf_counter() - start, 2)
        if spec.get("kv") is not None:
            result["counts"] = counters(llm)
        if spec.get("offload") is not None:
            result["tiers"] = tier_counters(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return result


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    if plan.get("make_model") is not None:
        from hicache_storage.vllm.tiny_model import TinyLlama, make_tiny_llama

        make_tiny_llama(plan["model"], TinyLlama(**plan["make_model"]))
    results: dict[str, Any] = {"engines": {}}
    for spec in plan["engines"]:
        try:
            results["engines"][spec["name"]] = run_engine(plan["model"], spec)
        except Exception:
            results["engines"][spec["name"]] = {"error": traceback.format_exc()}
        out.write_text(json.dumps(results))
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
