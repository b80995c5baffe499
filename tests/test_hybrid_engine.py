"""The hybrid engine is exact: every tier, write policy and restore path gives the outputs of no cache.

The reference hybrid model (full, sliding-window and recurrent layers, plus a draft model whose
KV is a sidecar of the full pool) is deterministic whatever the batching, so a restored pool
that is wrong in one byte, or a boundary accepted without the state it depends on, changes the
logits or the draft's proposals. Every test also checks that the cache was used (a hit count
above zero), so none can pass by recomputing everything.
"""

from __future__ import annotations

import pytest
import torch

from hicache_core.controller import WritePolicy
from hicache_core.engine import CacheTiers, EngineCapacityError, Request, make_conversations
from hicache_core.hybrid.engine import HybridEngine, HybridEngineConfig, HybridResult
from hicache_core.hybrid.model import HybridDecoder, HybridModelConfig
from hicache_core.model import TinyDecoder
from hicache_core.pools import HostPool
from hicache_storage import create_backend, kernels, wrap
from hicache_storage.keys import page_hashes

PAGE = 8
MODEL = HybridModelConfig(window=12)
CONVERSATIONS = make_conversations(3, 3, 32, MODEL.vocab_size, seed=7)
NEW_TOKENS = 4

pytestmark = pytest.mark.slow


def config(tiers: CacheTiers, root: str | None = None, **overrides: object) -> HybridEngineConfig:
    settings: dict[str, object] = {
        "model": MODEL,
        "tiers": tiers,
        "page_size": PAGE,
        "device_pages": 28,
        "host_pages": 96,
        "swa_device_pages": 32,
        "device_checkpoints": 6,
        "host_checkpoints": 24,
    }
    if tiers is CacheTiers.L1_L2_L3:
        settings |= {"storage_backend": "file", "storage_config": {"root": root}}
    return HybridEngineConfig(**(settings | overrides))  # type: ignore[arg-type]


def serve_rounds(engine: HybridEngine, rounds: range, histories: list[list[int]], flush: bool = False) -> list[HybridResult]:
    """Multi-turn rounds: each conversation's prompt is its history plus its next turn."""
    results = []
    for r in rounds:
        requests = [Request(f"c{c}-r{r}", histories[c] + turns[r], NEW_TOKENS) for c, turns in enumerate(CONVERSATIONS)]
        for request, result in zip(requests, engine.serve(requests)):
            histories[int(request.rid[1 : request.rid.index("-")])] = request.tokens + result.output_ids
            results.append(result)
        engine.tree.check_invariants()
        if flush:
            engine.flush_cache()
            assert_nothing_held(engine)
    return results


def assert_nothing_held(engine: HybridEngine) -> None:
    """After a flush every slot of every pool is free again: no component state outlives its node."""
    allocators = {
        "full device": engine.full.device.allocator,
        "swa device": engine.swa.device.allocator,
        "checkpoint device": engine.states.device_allocator,
    }
    if engine.full.host is not None and engine.swa.host is not None and engine.states.host_allocator is not None:
        allocators |= {
            "full host": engine.full.host.allocator,
            "swa host": engine.swa.host.allocator,
            "checkpoint host": engine.states.host_allocator,
        }
    held = {name: a.num_pages - a.free_pages for name, a in allocators.items() if a.free_pages != a.num_pages}
    assert not held, f"slots still held after a flush: {held}"


def run(cfg: HybridEngineConfig, flush: bool = False) -> list[HybridResult]:
    with HybridEngine(cfg) as engine:
        return serve_rounds(engine, range(3), [[] for _ in CONVERSATIONS], flush)


@pytest.fixture(scope="module")
def uncached() -> list[HybridResult]:
    return run(config(CacheTiers.OFF))


def assert_same_outputs(expected: list[HybridResult], actual: list[HybridResult]) -> None:
    assert [r.rid for r in actual] == [r.rid for r in expected]
    for want, got in zip(expected, actual):
        assert got.output_ids == want.output_ids, got.rid
        assert got.draft_ids == want.draft_ids, f"{got.rid}: the draft KV sidecar came back wrong"
        assert got.logits is not None and want.logits is not None and torch.equal(got.logits, want.logits), got.rid


@pytest.mark.parametrize("policy", list(WritePolicy))
@pytest.mark.parametrize("tiers", [CacheTiers.L1, CacheTiers.L1_L2, CacheTiers.L1_L2_L3])
def test_every_tier_and_write_policy_gives_the_uncached_outputs(uncached, tiers, policy, tmp_path) -> None:
    results = run(config(tiers, str(tmp_path), write_policy=policy))
    assert_same_outputs(uncached, results)
    assert sum(r.cached_tokens for r in results) > 0
    if tiers is CacheTiers.L1_L2 and policy is not WritePolicy.WRITE_THROUGH_SELECTIVE:
        assert sum(r.cached_host for r in results) > 0, "the device pool is small: some prefix must come back from the host"


@pytest.mark.parametrize("policy", [WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_BACK])
def test_storage_restores_after_flushing_device_and_host(uncached, policy, tmp_path) -> None:
    results = run(config(CacheTiers.L1_L2_L3, str(tmp_path), write_policy=policy), flush=True)
    assert_same_outputs(uncached, results)
    later = [r for r in results if not r.rid.endswith("-r0")]
    assert all(r.cached_storage > 0 and r.cached_device == r.cached_host == 0 for r in later), [
        (r.rid, r.cached_device, r.cached_host, r.cached_storage) for r in later
    ]


def test_selective_write_through_stores_what_was_hit_twice(uncached, tmp_path) -> None:
    histories: list[list[int]] = [[] for _ in CONVERSATIONS]
    with HybridEngine(config(CacheTiers.L1_L2_L3, str(tmp_path), write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE)) as engine:
        serve_rounds(engine, range(1), histories)
        after_first_round = [list(h) for h in histories]
        serve_rounds(engine, range(1, 3), histories)  # the first round's prefixes get their second hit
        engine.flush_cache()
        results = serve_rounds(engine, range(1, 3), after_first_round)
    assert_same_outputs(uncached[len(CONVERSATIONS) :], results)
    assert sum(r.cached_storage for r in results) > 0


BACKED_UP = [WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_BACK]  # write-back stores on eviction (here: a flush)


@pytest.mark.parametrize("policy", BACKED_UP)
def test_two_instances_share_storage(uncached, policy, tmp_path) -> None:
    histories: list[list[int]] = [[] for _ in CONVERSATIONS]
    with HybridEngine(config(CacheTiers.L1_L2_L3, str(tmp_path), write_policy=policy)) as first:
        results = serve_rounds(first, range(2), histories)
        first.flush_cache()
        with HybridEngine(config(CacheTiers.L1_L2_L3, str(tmp_path), write_policy=policy)) as second:
            results += serve_rounds(second, range(2, 3), histories)
    assert_same_outputs(uncached, results)
    assert all(r.cached_storage > 0 for r in results[-len(CONVERSATIONS) :])


@pytest.mark.parametrize("policy", BACKED_UP)
def test_restart_restores_from_storage(uncached, policy, tmp_path) -> None:
    run(config(CacheTiers.L1_L2_L3, str(tmp_path), write_policy=policy), flush=policy is WritePolicy.WRITE_BACK)
    results = run(config(CacheTiers.L1_L2_L3, str(tmp_path), write_policy=policy))
    assert_same_outputs(uncached, results)
    first_round = results[: len(CONVERSATIONS)]
    assert all(r.cached_storage == 24 for r in first_round), "each prompt's last whole page (24 of 31 tokens) is in L3"


# --- every cached state is what recomputing its prefix gives ----------------------------------


def read_host(pool: HostPool, device_like: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The KV of host ``slots`` as a layer-first ``(halves, layers, n, heads, dim)`` tensor."""
    scratch = torch.zeros((*device_like.shape[:2], slots.numel(), *device_like.shape[3:]), dtype=device_like.dtype)
    for layer in range(device_like.shape[1]):
        kernels.load_layer(
            scratch, pool.kv, layer=layer, device_indices=torch.arange(slots.numel()), host_indices=slots,
            layout=pool.layout, page_size=pool.page_size,
        )
    return scratch


def audit(engine: HybridEngine) -> int:
    """Compare every node's FULL, draft and SWA KV and checkpoint, on both tiers, with a fresh
    prefill of the node's whole prefix; returns how many copies were checked."""
    model, draft_model = HybridDecoder(MODEL), TinyDecoder(MODEL.draft_config())
    checked = 0
    for node in engine.tree.nodes():
        tokens = torch.tensor([t for n in engine.tree.path(node) for t in n.key])
        n, begin = node.end, node.end - len(node.key)
        slots = torch.arange(n)
        full = torch.zeros((2, MODEL.full_layers, n, MODEL.kv_heads, MODEL.head_dim))
        swa = torch.zeros((2, MODEL.swa_layers, n, MODEL.kv_heads, MODEL.head_dim))
        draft = torch.zeros((2, 1, n, MODEL.kv_heads, MODEL.head_dim))
        state = model.new_state()
        model.forward(tokens, 0, full, slots, swa, slots, state)
        draft_model.forward(tokens, draft, slots, slots)
        expected = {"full": full[:, :, begin:], "draft": draft[:, :, begin:], "swa": swa[:, :, begin:]}
        copies = {
            "full": (node.device_value, node.host_value, engine.full),
            "draft": (node.device_value, node.host_value, engine.draft),
            "swa": (engine.window.slots(node, True), engine.window.slots(node, False), engine.swa),
        }
        for name, (device, host, tiers) in copies.items():
            if device is not None:
                assert torch.equal(tiers.device.kv[:, :, device], expected[name]), f"{node}: device {name} KV"
                checked += 1
            if host is not None:
                assert torch.equal(read_host(tiers.host, tiers.device.kv, host), expected[name]), f"{node}: host {name} KV"
                checked += 1
        for on_device, states in ((True, engine.states.device), (False, engine.states.host)):
            slot = engine.checkpoints.slots(node, on_device)
            if slot is not None:
                assert torch.equal(states[int(slot)], state), f"{node}: {'device' if on_device else 'host'} checkpoint"
                checked += 1
    return checked


@pytest.mark.parametrize("policy", list(WritePolicy))
def test_every_cached_state_equals_a_recomputation(policy, tmp_path) -> None:
    """After a workload under memory pressure (evictions, tombstones, restores from L3), every copy
    the tree holds is bit-identical to recomputing it: nothing stale, nothing mixed up."""
    with HybridEngine(config(CacheTiers.L1_L2_L3, str(tmp_path), write_policy=policy, swa_device_pages=16)) as engine:
        histories: list[list[int]] = [[] for _ in CONVERSATIONS]
        serve_rounds(engine, range(2), histories)
        engine.flush_cache()
        serve_rounds(engine, range(2, 3), histories)
        assert audit(engine) > 10
        tombstones = [
            n for n in engine.tree.nodes() if n.device_value is not None and not engine.window.present(n, device=True)
        ]
        assert tombstones, "the SWA device pool is smaller than the FULL one: some nodes must have lost their window KV"


# --- the branch-backup scenario --------------------------------------------------------------

SHARED = make_conversations(1, 1, 96, MODEL.vocab_size, seed=11)[0][0]
SUFFIXES = make_conversations(12, 1, 12, MODEL.vocab_size, seed=12)


def branch_scenario(backfill: bool, root: str) -> list[HybridResult]:
    """Two requests share a prefix and diverge (the second leaves a new checkpoint at the branch
    point, on a prefix whose KV is already backed up); then L1 and L2 are emptied before each of
    ten more requests for the same prefix with new suffixes."""
    with HybridEngine(config(CacheTiers.L1_L2_L3, root, backfill=backfill)) as engine:
        engine.serve([Request("first", SHARED + SUFFIXES[0][0], NEW_TOKENS)])
        engine.serve([Request("branch", SHARED + SUFFIXES[1][0], NEW_TOKENS)])
        results = []
        for i, suffix in enumerate(SUFFIXES[2:]):
            engine.flush_cache()
            results += engine.serve([Request(f"again-{i}", SHARED + suffix[0], NEW_TOKENS)])
    return results


def test_backfill_restores_the_whole_shared_prefix_and_its_absence_shows_the_gap(tmp_path) -> None:
    with_backfill = branch_scenario(True, str(tmp_path / "on"))
    without = branch_scenario(False, str(tmp_path / "off"))
    assert [r.output_ids for r in with_backfill] == [r.output_ids for r in without]
    assert [r.cached_storage for r in with_backfill] == [len(SHARED)] * 10
    assert sum(r.cached_storage == len(SHARED) for r in without) == 0, [r.cached_storage for r in without]


# --- every pool votes ------------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["kv", "swa", "mamba"])
def test_a_missing_page_of_any_pool_shortens_the_restored_prefix(uncached, pool, tmp_path) -> None:
    prompt = SHARED + SUFFIXES[0][0]
    with HybridEngine(config(CacheTiers.OFF)) as plain:
        expected = plain.serve([Request("r", prompt, NEW_TOKENS)])[0]
    with HybridEngine(config(CacheTiers.L1_L2_L3, str(tmp_path))) as engine:
        engine.serve([Request("w", prompt, NEW_TOKENS)])
        engine.flush_cache()
        hashes = page_hashes(prompt[: (len(prompt) - 1) // PAGE * PAGE], PAGE)
        store = engine.store
        assert store is not None
        cut = store.usable_pages(hashes)
        assert cut == len(hashes), "the whole prompt was backed up"
        missing = hashes[cut - 1]  # inside every pool's trailing window of the full cut
        name = engine.kv_pool if pool == "kv" else pool
        assert store.backend.delete(store.keys(name, [missing])) == [True]
        assert store.usable_pages(hashes) < cut
        result = engine.serve([Request("r", prompt, NEW_TOKENS)])[0]
    assert result.cached_storage < cut * PAGE
    assert result.output_ids == expected.output_ids and torch.equal(result.logits, expected.logits)
    assert result.draft_ids == expected.draft_ids


def test_sessions_reference_what_their_requests_cached() -> None:
    with HybridEngine(config(CacheTiers.L1_L2)) as engine:
        engine.serve([Request("a", SHARED + SUFFIXES[0][0], NEW_TOKENS, session_id="s")])
        (node,) = engine.sessions.referenced_nodes("s")
        assert node.session_refs == 1 and node.end == (len(SHARED) + 12 + NEW_TOKENS - 1) // PAGE * PAGE
        engine.close_session("s")
        assert node.session_refs == 0 and engine.tree.in_tree(node), "closing drops the reference, not the data"


def test_a_failing_and_hanging_store_degrades_to_recomputation(uncached, tmp_path) -> None:
    """Errors on every operation and calls that hang past the timeout: outputs stay exact, the
    engine never raises, the failures are counted, and hits resume once the store recovers."""
    faults = {"error_rate": 0.2, "errors": ["unavailable", "runtime", "timeout"], "hang_rate": 0.05, "hang_seconds": 2.0}
    storage = wrap(
        create_backend("file", {"root": str(tmp_path)}),
        [{"kind": "faults", "seed": 3, "exists": faults, "get": faults, "put": faults}],
    )
    with HybridEngine(config(CacheTiers.L1_L2_L3, storage_timeout_s=0.2), storage) as engine:
        failing = serve_rounds(engine, range(3), [[] for _ in CONVERSATIONS], flush=True)
        counters = engine.metrics.snapshot()
        storage.pause()  # type: ignore[attr-defined]
        recovered = serve_rounds(engine, range(3), [[] for _ in CONVERSATIONS], flush=True)
    assert_same_outputs(uncached, failing)
    assert_same_outputs(uncached, recovered)
    assert counters["storage_errors"] > 0 and counters["storage_timeouts"] > 0
    assert all(r.cached_storage > 0 for r in recovered[len(CONVERSATIONS) :]), "hits resume once the store works"


def test_a_request_larger_than_the_device_pools_is_refused_without_leaking() -> None:
    with HybridEngine(config(CacheTiers.L1_L2, device_pages=64, swa_device_pages=4)) as engine:
        free = engine.full.device.allocator.free_pages
        with pytest.raises(EngineCapacityError, match="swa_device_pages"):
            engine.serve([Request("big", SHARED, NEW_TOKENS)])
        assert engine.full.device.allocator.free_pages == free
        engine.serve([Request("small", SHARED[:16], NEW_TOKENS)])  # the engine still serves


def test_sessions_keep_their_prefixes_cached_under_pressure_better_than_lru() -> None:
    """Three conversations interleaved with one-off prompts that push the pools: with session
    ids the conversations' next rounds hit more than under plain LRU, with identical outputs."""
    noise = make_conversations(9, 1, 48, MODEL.vocab_size, seed=13)

    def workload(sessions: bool) -> list[HybridResult]:
        cfg = config(CacheTiers.L1_L2, device_pages=24, host_pages=32, swa_device_pages=24, host_checkpoints=12)
        histories: list[list[int]] = [[] for _ in CONVERSATIONS]
        kept = []
        with HybridEngine(cfg) as engine:
            for r in range(3):
                for c, turns in enumerate(CONVERSATIONS):
                    request = Request(f"c{c}-r{r}", histories[c] + turns[r], NEW_TOKENS, session_id=f"s{c}" if sessions else None)
                    (result,) = engine.serve([request])
                    histories[c] = request.tokens + result.output_ids
                    kept.append(result)
                    engine.serve([Request(f"noise-{r}-{c}", noise[3 * r + c][0], NEW_TOKENS)])
        return kept

    lru, with_sessions = workload(False), workload(True)
    assert [r.output_ids for r in lru] == [r.output_ids for r in with_sessions]
    assert sum(r.cached_tokens for r in with_sessions) > sum(r.cached_tokens for r in lru), (
        [r.cached_tokens for r in lru],
        [r.cached_tokens for r in with_sessions],
    )


@pytest.mark.parametrize("field", ["device_pages", "host_pages", "swa_device_pages", "swa_host_pages", "device_checkpoints", "host_checkpoints"])
def test_a_pool_sized_zero_is_refused_naming_the_field(field) -> None:
    with pytest.raises(ValueError, match=f"HybridEngineConfig.{field} must be a positive int"):
        HybridEngine(config(CacheTiers.L1_L2, **{field: 0}))
