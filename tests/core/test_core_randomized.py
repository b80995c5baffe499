"""Randomized configurations (page size, pool sizes, concurrency, tiers, policies, layouts,
buffer-only mode, a flaky store) on a workload with a shared system prompt (so the tree splits):
outputs stay bit-identical to recomputation, the tree keeps its invariants, no page leaks."""

from __future__ import annotations

import random
import uuid

import pytest
import torch

from hicache_core.controller import ControllerConfig, WritePolicy
from hicache_core.prefetch import PrefetchConfig, StopPolicy
from hicache_core.engine import CacheTiers, Engine, EngineConfig, serve_conversations
from hicache_core.model import ModelConfig
from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.layers.faults import FaultInjectionLayer

MODEL = ModelConfig(vocab_size=128, hidden=32, layers=2, q_heads=2, kv_heads=1, head_dim=8, ffn=32, seed=7)
NEW_TOKENS = 2


def workload(seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    system = [rng.randrange(128) for _ in range(rng.randint(5, 30))]
    conversations = []
    for _ in range(rng.randint(2, 4)):
        turns = [[rng.randrange(128) for _ in range(rng.randint(3, 20))] for _ in range(rng.randint(1, 3))]
        turns[0] = system + turns[0]
        conversations.append(turns)
    return conversations


@pytest.mark.parametrize("seed", range(12))
def test_random_configuration_matches_recompute(seed):
    rng = random.Random(1000 + seed)
    conversations = workload(seed)
    with Engine(EngineConfig(model=MODEL, tiers=CacheTiers.OFF, page_size=1, device_pages=512)) as engine:
        expected = serve_conversations(engine, conversations, NEW_TOKENS)
    longest = max(r.prompt_tokens for rnd in expected for r in rnd) + NEW_TOKENS
    page_size = rng.choice([1, 2, 4, 8])
    tiers = rng.choice([CacheTiers.L1, CacheTiers.L1_L2, CacheTiers.L1_L2_L3])
    max_running = rng.randint(1, 3)
    device_pages = (longest * max_running) // page_size + rng.randint(2, 12)
    buffer_only = tiers is CacheTiers.L1_L2_L3 and rng.random() < 0.3
    controller = ControllerConfig(
        buffer_only=buffer_only,
        write_policy=rng.choice(list(WritePolicy)),
        prefetch=PrefetchConfig(threshold_tokens=rng.choice([1, 4, 16]), stop_policy=rng.choice(list(StopPolicy)),
                                capacity_pages=rng.choice([None, 4, 16])),
    )
    config = EngineConfig(
        model=MODEL, tiers=tiers, page_size=page_size, device_pages=device_pages,
        host_pages=rng.randint(longest // page_size + 2, 3 * device_pages), host_ratio=None,
        layout=rng.choice(["page_first", "layer_first", "page_first_direct"]), controller=controller,
        max_running=max_running,
    )
    storage = MemoryBackend({"store": f"random-{uuid.uuid4().hex}"})
    if rng.random() < 0.3:  # a flaky store: some calls raise, some pages fail
        flaky = {"error_rate": 0.2, "errors": ["unavailable", "runtime"]}
        storage = FaultInjectionLayer(storage, {"seed": seed, "exists": flaky, "get": flaky, "put": flaky})
    with Engine(config, storage=storage if tiers.storage else None) as engine:
        rounds = serve_conversations(engine, conversations, NEW_TOKENS)
        for want_round, have_round in zip(expected, rounds):
            for want, have in zip(want_round, have_round):
                assert have.output_ids == want.output_ids, f"{config}: {have.rid}"
                assert torch.equal(have.logits.view(torch.int32), want.logits.view(torch.int32)), f"{config}: {have.rid}"
        engine.tree.check_invariants()
        engine.flush_cache()
        assert engine.device_pool.allocator.free_pages == engine.device_pool.num_pages
        if engine.host_pool is not None:
            assert engine.host_pool.allocator.free_pages == engine.host_pool.num_pages
