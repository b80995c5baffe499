"""A store whose reads hang forever, through the engine, under every stop policy: outputs stay
those of no cache, host pages pinned by hung calls never exceed their cap, a best_effort request
never waits for the hung store, and once the store answers again L3 hits come back in the same
process, although the calls that hung never return (they are released only at teardown)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from hicache_core import CacheTiers, Engine, make_conversations
from hicache_core.prefetch import StopPolicy
from hicache_core.soak import MODEL, serve_rounds, tiny_engine_config
from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.health import BreakerConfig
from hicache_storage.layers import FaultInjectionLayer

CONVERSATIONS = make_conversations(clients=3, rounds=3, turn_tokens=24, vocab_size=MODEL.vocab_size, seed=5)
NEW_TOKENS = 3
#: best_effort runs with a storage timeout far above its bound, so a request that waited for a
#: hung call would show it; the other policies wait for calls by design, so theirs is short.
LONG_TIMEOUT_S = 5.0
SHORT_TIMEOUT_S = 0.2
#: A guard against a hang, never a timing assertion: polls of 10 ms before a wait gives up.
HANG_GUARD_POLLS = 6000
#: A few requests: the first after recovery may still find the breaker open (it starts the probe).
RECOVERY_ATTEMPTS = 6


def config(policy: StopPolicy, timeout_s: float, tiers: CacheTiers = CacheTiers.L1_L2_L3):
    cfg = tiny_engine_config(tiers, timeout_s)
    prefetch = dataclasses.replace(cfg.controller.prefetch, stop_policy=policy)
    breaker = BreakerConfig(probe_backoff_s=0.01, probe_backoff_max_s=0.05)
    cfg.controller = dataclasses.replace(cfg.controller, prefetch=prefetch, breaker=breaker)
    return cfg


@pytest.fixture(scope="module")
def expected():
    with Engine(config(StopPolicy.WAIT_COMPLETE, SHORT_TIMEOUT_S, CacheTiers.OFF)) as engine:
        return serve_rounds(engine, CONVERSATIONS, "off", NEW_TOKENS)


def same_outputs(want, have) -> bool:
    return len(want) == len(have) and all(
        a.output_ids == b.output_ids and torch.equal(a.logits.view(torch.int32), b.logits.view(torch.int32)) for a, b in zip(want, have)
    )


@pytest.mark.parametrize("policy", list(StopPolicy))
def test_reads_that_hang_forever_cost_bounded_pages_and_l3_comes_back(expected, policy):
    timeout_s = LONG_TIMEOUT_S if policy is StopPolicy.BEST_EFFORT else SHORT_TIMEOUT_S
    faults = FaultInjectionLayer(MemoryBackend(), {"enabled": False, "get": {"hang_rate": 1.0}})
    engine = Engine(config(policy, timeout_s), storage=faults)
    controller = engine.controller
    cap = controller.pin_cap
    assert cap is not None and cap.cap_pages == engine.host_pool.num_pages // 4
    allocator = engine.host_pool.allocator
    most_abandoned = 0

    def sample() -> None:
        nonlocal most_abandoned
        most_abandoned = max(most_abandoned, allocator.abandoned_pages)

    try:
        assert same_outputs(expected, serve_rounds(engine, CONVERSATIONS, "warm", NEW_TOKENS))
        engine.flush_cache()
        faults.resume()  # every read from now on hangs, and never returns on its own
        for attempt in range(2):
            engine.flush_cache()
            results = serve_rounds(engine, CONVERSATIONS, f"hung{attempt}", NEW_TOKENS, during=sample)
            assert same_outputs(expected, results), "a hung store changed the outputs"
            if policy is StopPolicy.BEST_EFFORT:
                slowest = max(r.latency_s for r in results)
                assert slowest < timeout_s, f"a best_effort request waited {slowest:.1f} s: as long as a hung call"
        counters = engine.metrics.snapshot()
        assert faults.hanging > 0 and counters["storage_timeouts"] > 0 or policy is StopPolicy.BEST_EFFORT
        assert most_abandoned <= cap.cap_pages and cap.peak_pages <= cap.cap_pages
        hung_before = faults.hanging

        faults.pause()  # the store answers again; the calls that hung stay hung
        for _ in range(HANG_GUARD_POLLS):  # a call in flight when it did waits out its timeout
            if engine.metrics.snapshot()["storage_timeouts"] >= faults.hanging:
                break
            time.sleep(0.01)
        hits = 0
        for attempt in range(RECOVERY_ATTEMPTS):
            engine.flush_cache()
            time.sleep(0.06)  # past the probe backoff: the next request starts a probe
            results = serve_rounds(engine, CONVERSATIONS[:1], f"back{attempt}", NEW_TOKENS, during=sample)
            assert same_outputs(expected[:1], results[:1])
            hits = sum(r.cached_storage for r in results)
            if hits:
                break
        assert hits > 0, f"no L3 hit within {RECOVERY_ATTEMPTS} requests after the store answered again"
        assert faults.hanging >= hung_before, "the hung calls were not released: hits came back without them"
        assert most_abandoned <= cap.cap_pages and cap.peak_pages <= cap.cap_pages
        assert engine.controller.threads_alive
    finally:
        faults.release_hangs()
        faults.pause()
        engine.close()
