"""A prompt longer than the file connector's capacity still hits L3, through the whole engine.

The engine backs a prompt's pages up in one call. A capped file connector that kept the last pages
of that call (it used to: 48 pages into a 32-page L3 left pages 16-47) holds no usable prefix,
so after L1 and L2 are flushed the prompt gets nothing from L3. It must keep the head.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from hicache_core.controller import ControllerConfig
from hicache_core.engine import CacheTiers, Engine, EngineConfig, Request
from hicache_core.model import ModelConfig
from hicache_core.prefetch import PrefetchConfig, StopPolicy

from pinned_cost import LOAD_AND_STORE_EVERY_PAGE

MODEL = ModelConfig(vocab_size=256, hidden=32, layers=2, q_heads=4, kv_heads=2, head_dim=8, ffn=64, seed=11)
PAGE_SIZE = 4
PROMPT_PAGES = 48
CAPACITY_PAGES = 32
NEW_TOKENS = 3


def engine_config(tiers: CacheTiers, storage_config: dict | None = None, layout: str = "page_first") -> EngineConfig:
    prefetch = PrefetchConfig(threshold_tokens=8, stop_policy=StopPolicy.WAIT_COMPLETE, timeout_base_s=60.0)
    return EngineConfig(
        model=MODEL,
        tiers=tiers,
        page_size=PAGE_SIZE,
        device_pages=2 * PROMPT_PAGES,
        host_pages=2 * PROMPT_PAGES,
        host_ratio=None,
        layout=layout,
        # The test counts the pages L3 holds and serves: each is written and read, whatever the speeds.
        controller=ControllerConfig(prefetch=prefetch, cost=LOAD_AND_STORE_EVERY_PAGE),
        storage_backend="file" if storage_config is not None else None,
        storage_config=storage_config,
        max_running=1,
    )


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_prompt_longer_than_l3_is_served_from_the_head_l3_kept(tmp_path: Path, layout: str) -> None:
    page_bytes = MODEL.geometry.token_bytes * PAGE_SIZE
    prompt = [random.Random(3).randrange(MODEL.vocab_size) for _ in range(PROMPT_PAGES * PAGE_SIZE)]
    with Engine(engine_config(CacheTiers.OFF)) as uncached:
        [expected] = uncached.serve([Request("uncached", prompt, NEW_TOKENS)])

    storage = {"root": str(tmp_path / "l3"), "capacity_bytes": CAPACITY_PAGES * page_bytes}
    with Engine(engine_config(CacheTiers.L1_L2_L3, storage, layout)) as engine:
        [first] = engine.serve([Request("first", prompt, NEW_TOKENS)])
        engine.drain()
        written = engine.metrics.snapshot()["storage_backup_pages"]
        engine.flush_cache()  # L1 and L2 empty: whatever is reused now comes from L3
        assert engine.tree.token_counts() == {"device": 0, "host": 0, "nodes": 0}
        [again] = engine.serve([Request("again", prompt, NEW_TOKENS)])
        stored = engine.controller.storage.stats()

    assert written == CAPACITY_PAGES, "the tail beyond the capacity is not written"
    assert again.cached_storage == CAPACITY_PAGES * PAGE_SIZE, "the head that fits in L3 is the hit"
    assert stored["stored_bytes"] <= CAPACITY_PAGES * page_bytes
    for result in (first, again):
        assert result.output_ids == expected.output_ids
        assert torch.equal(result.logits.view(torch.int32), expected.logits.view(torch.int32))
