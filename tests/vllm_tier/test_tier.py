"""HiCacheStorageTier against vLLM's SecondaryTierManager contract, without an engine: its config,
its namespace, and each call the TieringOffloadingManager makes (lookups that answer RETRY until
the lookup thread has asked the store, cascades from primary rows, promotions into them, a
promotion that partly fails, drain_jobs, shutdown). The engines in test_vllm_engine.py run it
inside vLLM."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob

from hicache_storage.errors import ConfigError
from hicache_storage.keys import Namespace
from hicache_storage.vllm.config import VllmConnectorConfig
from hicache_storage.vllm.identity import OFFLOAD_ROW, offload_rows
from hicache_storage.vllm.tier import HiCacheStorageTier

ROW = 4096
ROWS = 8


def _offloading_config(world: int = 1, blocks_per_chunk: int = 1) -> OffloadingConfig:
    parallel = OffloadingParallelConfig(
        rank=0, world_size=world, tp_size=world, pp_size=1, pcp_size=1, dcp_size=1,
        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=True,
    )
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=ROW // world // blocks_per_chunk,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="engine",
        model=OffloadingModelConfig(name="/models/tiny", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=blocks_per_chunk),
        parallel=parallel,
    )


def test_tier_config_errors_name_the_tier() -> None:
    with pytest.raises(ConfigError) as caught:
        VllmConnectorConfig.from_tier_config({"connector_config": {"root": "/tmp/kv"}})
    assert "HiCacheStorageTier needs 'connector' in its secondary_tiers entry" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        VllmConnectorConfig.from_tier_config({"connector": "file", "tennant": "a"})
    assert "'tennant'" in str(caught.value) and "tenant" in str(caught.value)


def test_rows_have_a_namespace_of_their_own() -> None:
    """A row's namespace never equals the KV connector's (whose geometry starts with the KV layout
    vLLM names), and it changes with what changes a row's bytes or their meaning."""
    config = VllmConnectorConfig.from_tier_config({"connector": "memory"})
    rows = offload_rows(_offloading_config(), config, ROW)
    assert rows.namespace.layout == "vllm_block" and rows.namespace.model == "/models/tiny"
    assert rows.namespace.geometry is not None and rows.namespace.geometry.startswith(f"kv_layout={OFFLOAD_ROW},")
    assert OFFLOAD_ROW not in {layout.name for layout in KVCacheLayout} | {str(layout.value) for layout in KVCacheLayout}
    kv_connector = Namespace(
        model="/models/tiny", kv_dtype="bfloat16", page_size=32, layout="vllm_block",
        geometry="kv_layout=LBHNC,device=cpu,layers=2,kv_heads=1,head_size=64,block_bytes=2048",
    )
    assert rows.namespace.fingerprint != kv_connector.fingerprint
    others = [
        offload_rows(_offloading_config(world=2), config, ROW),
        offload_rows(_offloading_config(blocks_per_chunk=2), config, ROW),
        offload_rows(_offloading_config(), config, ROW + 4096),
        offload_rows(_offloading_config(), VllmConnectorConfig.from_tier_config({"connector": "memory", "tenant": "b"}), ROW),
        offload_rows(_offloading_config(), VllmConnectorConfig.from_tier_config({"connector": "memory", "revision": "r2"}), ROW),
        offload_rows(_offloading_config(), VllmConnectorConfig.from_tier_config({"connector": "memory", "model": "tiny"}), ROW),
    ]
    fingerprints = {rows.namespace.fingerprint} | {other.namespace.fingerprint for other in others}
    assert len(fingerprints) == 1 + len(others)


def _key(n: int) -> Any:
    return make_offload_key(n.to_bytes(32, "big"), 0)


def _wait_lookup(tier: HiCacheStorageTier, key: Any, ctx: ReqContext) -> LookupResult:
    """Look ``key`` up as vLLM does, one step after another, until the lookup thread answered."""
    deadline = time.monotonic() + 10
    while True:
        result = tier.lookup(key, ctx)
        if result is not LookupResult.RETRY or time.monotonic() > deadline:
            return result
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        time.sleep(0.01)


def _finished(tier: HiCacheStorageTier, jobs: int) -> dict[int, Any]:
    tier.drain_jobs()
    results = {r.job_id: r for r in tier.get_finished_jobs()}
    assert len(results) == jobs
    return results


@pytest.fixture
def tier(tmp_path: Path) -> Any:
    primary = np.zeros((ROWS, ROW), dtype=np.int8)
    spec = SimpleNamespace(config=_offloading_config())
    made = HiCacheStorageTier(
        spec, memoryview(primary), "HiCacheStorageTier",
        connector="file", connector_config={"root": str(tmp_path / "kv")}, layers=[{"kind": "integrity"}],
    )
    yield made, primary, tmp_path / "kv"
    made.shutdown()


def test_tier_cascades_promotes_and_misses_what_failed(tier: Any) -> None:
    made, primary, root = tier
    ctx = ReqContext(req_id="r1")
    keys = [_key(n) for n in range(3)]
    made.on_new_request(ctx)
    assert _wait_lookup(made, keys[0], ctx) is LookupResult.MISS

    primary[:3] = np.arange(3, dtype=np.int8)[:, None] + 1
    made.submit_store(TransferJob(job_id=1, keys=keys, chunk_ids=np.array([0, 1, 2]), is_promotion=False, req_context=ctx))
    assert _finished(made, 1)[1].success
    assert made.counts["rows_stored"] == 3
    made.submit_store(TransferJob(job_id=2, keys=keys[:1], chunk_ids=np.array([0]), is_promotion=False, req_context=ctx))
    assert _finished(made, 1)[2].success and made.counts["rows_already_stored"] == 1

    # a later request (a new lookup) finds them; promotion into other rows brings the same bytes
    made.on_request_finished(ctx)
    ctx2 = ReqContext(req_id="r2")
    assert all(_wait_lookup(made, key, ctx2) is LookupResult.HIT for key in keys)
    made.submit_load(TransferJob(job_id=3, keys=keys, chunk_ids=np.array([5, 6, 7]), is_promotion=True, req_context=ctx2))
    assert _finished(made, 1)[3].success
    assert (primary[5:8] == primary[0:3]).all()

    # one page corrupted: the promotion keeps the others, and the lookup now says miss for it
    pages = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "namespace.json")
    assert len(pages) == 3
    data = bytearray(pages[0].read_bytes())
    data[100] ^= 0xFF
    pages[0].write_bytes(bytes(data))
    primary[5:8] = 0
    made.submit_load(TransferJob(job_id=4, keys=keys, chunk_ids=np.array([5, 6, 7]), is_promotion=True, req_context=ctx2))
    result = _finished(made, 1)[4]
    assert not result.success and result.successful_keys is not None and len(result.successful_keys) == 2
    failed = next(key for key in keys if key not in result.successful_keys)
    assert made.lookup(failed, ctx2) is LookupResult.MISS
    assert made.counts["rows_failed_to_load"] == 1

    # once recomputed and cascaded again, the bad row is rewritten though the store still has it
    row = keys.index(failed)
    made.submit_store(TransferJob(job_id=5, keys=[failed], chunk_ids=np.array([row]), is_promotion=False, req_context=ctx2))
    assert _finished(made, 1)[5].success and made.counts["rows_stored"] == 4
    made.submit_load(TransferJob(job_id=6, keys=[failed], chunk_ids=np.array([7]), is_promotion=True, req_context=ctx2))
    assert _finished(made, 1)[6].success and (primary[7] == primary[row]).all()
    made.on_request_finished(ctx2)
    assert not made.has_pending_work()
