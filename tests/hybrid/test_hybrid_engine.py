"""Hybrid models on the one engine are exact: every tier, write policy, stop policy and restore
path gives the outputs of no cache.

Two shapes of the reference hybrid model (FULL + SWA, and FULL + SWA + recurrent), each with a
draft model whose KV is a sidecar of the FULL pool, are served by :class:`hicache_core.engine.Engine`
(the engine FULL-only models use: its controller's write policies and backup thread, its
prefetcher's stop policies and thread, layer-wise loading). The model is deterministic whatever
the batching, so a restored pool that is wrong in one byte, or a boundary accepted without the
state it depends on, changes the logits or the draft's proposals. Every test also checks that
the cache was used (a hit count above zero), so none can pass by recomputing everything.
"""

from __future__ import annotations

import pytest
import torch

from hicache_core.controller import ControllerConfig, WritePolicy
from hicache_core.engine import CacheTiers, Engine, EngineCapacityError, EngineConfig, HybridPools, Request, RequestResult, make_conversations
from hicache_core.hybrid.model import HybridDecoder, HybridModelConfig
from hicache_core.model import TinyDecoder
from hicache_core.pools import HostPool
from hicache_core.prefetch import PrefetchConfig, StopPolicy
from hicache_storage import create_backend, kernels, stack_layers
from hicache_storage.cost import CostConfig
from hicache_storage.keys import page_hashes

from pinned_cost import LOAD_AND_STORE_EVERY_PAGE

PAGE = 8
RECURRENT = HybridModelConfig(window=12)  # full, swa, recurrent, swa, recurrent, full
SWA_ONLY = HybridModelConfig(window=12, layer_kinds=("full", "swa", "swa", "full"))
SHAPES = {"full+swa+recurrent": RECURRENT, "full+swa": SWA_ONLY}
MODEL = RECURRENT
CONVERSATIONS = make_conversations(3, 3, 32, MODEL.vocab_size, seed=7)
NEW_TOKENS = 4

pytestmark = pytest.mark.slow


def config(
    tiers: CacheTiers,
    root: str | None = None,
    *,
    model: HybridModelConfig = MODEL,
    write: WritePolicy = WritePolicy.WRITE_THROUGH,
    stop: StopPolicy = StopPolicy.WAIT_COMPLETE,
    swa_device_pages: int = 32,
    host_checkpoints: int = 24,
    capacity_pages: int | None = None,
    controller: dict[str, object] | None = None,
    cost: CostConfig = LOAD_AND_STORE_EVERY_PAGE,
    **overrides: object,
) -> EngineConfig:
    """``cost``: every page is written and read by default, whatever the speeds, as most tests
    here count the tokens L3 served; a test that checks only outputs passes ``CostConfig()``, the
    engine's default."""
    # A generous timeout: the "timeout" policy must not expire on a loaded CI machine.
    prefetch = PrefetchConfig(threshold_tokens=8, stop_policy=stop, timeout_base_s=60.0, capacity_pages=capacity_pages)
    settings: dict[str, object] = {
        "model": model,
        "tiers": tiers,
        "page_size": PAGE,
        "device_pages": 28,
        "host_pages": 96,
        "host_ratio": None,
        "hybrid": HybridPools(swa_device_pages=swa_device_pages, device_checkpoints=6, host_checkpoints=host_checkpoints),
        "controller": ControllerConfig(write_policy=write, prefetch=prefetch, cost=cost, **(controller or {})),  # type: ignore[arg-type]
        "max_running": 2,
    }
    if tiers is CacheTiers.L1_L2_L3 and root is not None:
        settings |= {"storage_backend": "file", "storage_config": {"root": root}}
    return EngineConfig(**(settings | overrides))  # type: ignore[arg-type]


def serve_rounds(engine: Engine, rounds: range, histories: list[list[int]], flush: bool = False) -> list[RequestResult]:
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


def allocators(engine: Engine) -> dict[str, object]:
    runner = engine.runner
    found = {"full device": engine.device_pool.allocator, "swa device": runner.swa.device_allocator}
    if engine.host_pool is not None:
        found |= {"full host": engine.host_pool.allocator, "swa host": runner.swa.host_allocator}
    if runner.checkpoints is not None:
        found |= {"checkpoint device": runner.states.device_allocator}
        if runner.states.host_allocator is not None:
            found |= {"checkpoint host": runner.states.host_allocator}
    return found


def assert_nothing_held(engine: Engine) -> None:
    """After a flush every slot of every pool is free again: no component state outlives its node."""
    held = {name: a.num_pages - a.free_pages for name, a in allocators(engine).items() if a.free_pages != a.num_pages}  # type: ignore[attr-defined]
    assert not held, f"slots still held after a flush: {held}"


def run(cfg: EngineConfig, flush: bool = False) -> list[RequestResult]:
    with Engine(cfg) as engine:
        return serve_rounds(engine, range(3), [[] for _ in CONVERSATIONS], flush)


_uncached: dict[str, list[RequestResult]] = {}


def uncached_for(shape: str) -> list[RequestResult]:
    if shape not in _uncached:
        _uncached[shape] = run(config(CacheTiers.OFF, model=SHAPES[shape]))
    return _uncached[shape]


@pytest.fixture(scope="module")
def uncached() -> list[RequestResult]:
    return uncached_for("full+swa+recurrent")


def assert_same_outputs(expected: list[RequestResult], actual: list[RequestResult]) -> None:
    assert [r.rid for r in actual] == [r.rid for r in expected]
    for want, got in zip(expected, actual):
        assert got.output_ids == want.output_ids, got.rid
        assert got.draft_ids == want.draft_ids and len(got.draft_ids) == NEW_TOKENS, f"{got.rid}: the draft KV sidecar came back wrong"
        assert got.logits is not None and want.logits is not None
        assert torch.equal(got.logits.view(torch.int32), want.logits.view(torch.int32)), got.rid


def test_no_cache_gives_what_the_model_computes_alone() -> None:
    """The oracle: serving with the cache off equals running the reference model by hand (each
    token from a fresh prefill of everything before it)."""
    with Engine(config(CacheTiers.OFF)) as engine:
        (result,) = engine.serve([Request("r", CONVERSATIONS[0][0], NEW_TOKENS)])
    model, tokens = HybridDecoder(MODEL), list(CONVERSATIONS[0][0])
    for _ in range(NEW_TOKENS):
        n = len(tokens)
        full = torch.zeros((2, MODEL.full_layers, n, MODEL.kv_heads, MODEL.head_dim))
        swa = torch.zeros((2, MODEL.swa_layers, n, MODEL.kv_heads, MODEL.head_dim))
        logits, _ = model.forward(torch.tensor(tokens), 0, full, torch.arange(n), swa, torch.arange(n), model.new_state())
        tokens.append(int(logits[-1].argmax()))
    assert result.output_ids == tokens[-NEW_TOKENS:]


def alternating_shapes(grid: list[tuple[object, ...]], width: int) -> list[tuple[object, ...]]:
    """Give each row of a row-major ``width``-wide grid a shape, the two alternating like a
    checkerboard: every row and every column of the grid then meets both shapes."""
    names = list(SHAPES)
    return [(*row, names[(i // width + i % width) % 2]) for i, row in enumerate(grid)]


W, S = WritePolicy, StopPolicy
#: Tier x write x stop x shape, covered pairwise instead of all 26 combinations: the stop policy
#: acts only with L3 and the write policy only from L2, so those rows carry them. L1 runs both
#: shapes; L1+L2 every write policy, write-through and write-back (whose runs must restore from
#: the host) on different shapes; L1+L2+L3 every write x stop pair, the shapes alternating so
#: that every (write, shape), (stop, shape) and (tier, shape) pair is there too.
POLICY_MATRIX = (
    [(CacheTiers.L1, W.WRITE_THROUGH, S.WAIT_COMPLETE, shape) for shape in SHAPES]
    + alternating_shapes([(CacheTiers.L1_L2, write, S.WAIT_COMPLETE) for write in (W.WRITE_THROUGH, W.WRITE_BACK, W.WRITE_THROUGH_SELECTIVE)], 3)
    + alternating_shapes([(CacheTiers.L1_L2_L3, write, stop) for write in WritePolicy for stop in StopPolicy], 3)
)


@pytest.mark.parametrize("tiers, write, stop, shape", POLICY_MATRIX, ids=lambda v: getattr(v, "value", v))
def test_every_tier_write_and_stop_policy_gives_the_uncached_outputs(shape, tiers, write, stop, tmp_path) -> None:
    # Outputs only (any hit counts): the engine's default load policy.
    results = run(config(tiers, str(tmp_path), model=SHAPES[shape], write=write, stop=stop, cost=CostConfig()))
    assert_same_outputs(uncached_for(shape), results)
    assert sum(r.cached_tokens for r in results) > 0
    if tiers is CacheTiers.L1_L2 and write is not WritePolicy.WRITE_THROUGH_SELECTIVE:
        assert sum(r.cached_host for r in results) > 0, "the device pool is small: some prefix must come back from the host"


#: Write x stop (write-through and write-back: those back up before the flush) with the shapes
#: alternating, so every (write, stop), (write, shape) and (stop, shape) pair is there: 6 of 12.
FLUSH_MATRIX = alternating_shapes([(write, stop) for write in (W.WRITE_THROUGH, W.WRITE_BACK) for stop in StopPolicy], 3)


@pytest.mark.parametrize("write, stop, shape", FLUSH_MATRIX, ids=lambda v: getattr(v, "value", v))
def test_storage_restores_after_flushing_device_and_host(shape, write, stop, tmp_path) -> None:
    results = run(config(CacheTiers.L1_L2_L3, str(tmp_path), model=SHAPES[shape], write=write, stop=stop), flush=True)
    assert_same_outputs(uncached_for(shape), results)
    later = [r for r in results if not r.rid.endswith("-r0")]
    assert all(r.cached_storage > 0 and r.cached_device == r.cached_host == 0 for r in later), [
        (r.rid, r.cached_device, r.cached_host, r.cached_storage) for r in later
    ]


def test_buffer_only_mode_stages_every_pool_through_the_host(uncached, tmp_path) -> None:
    cfg = config(CacheTiers.L1_L2_L3, str(tmp_path), controller={"buffer_only": True})
    with Engine(cfg) as engine:
        results = serve_rounds(engine, range(3), [[] for _ in CONVERSATIONS], flush=True)
    assert_same_outputs(uncached, results)
    assert all(r.cached_storage > 0 for r in results[len(CONVERSATIONS) :])


def test_selective_write_through_stores_what_was_hit_twice(uncached, tmp_path) -> None:
    histories: list[list[int]] = [[] for _ in CONVERSATIONS]
    with Engine(config(CacheTiers.L1_L2_L3, str(tmp_path), write=WritePolicy.WRITE_THROUGH_SELECTIVE)) as engine:
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
    with Engine(config(CacheTiers.L1_L2_L3, str(tmp_path), write=policy)) as first:
        results = serve_rounds(first, range(2), histories)
        first.flush_cache()
        with Engine(config(CacheTiers.L1_L2_L3, str(tmp_path), write=policy)) as second:
            results += serve_rounds(second, range(2, 3), histories)
    assert_same_outputs(uncached, results)
    assert all(r.cached_storage > 0 for r in results[-len(CONVERSATIONS) :])


@pytest.mark.parametrize("policy", BACKED_UP)
def test_restart_restores_from_storage(uncached, policy, tmp_path) -> None:
    run(config(CacheTiers.L1_L2_L3, str(tmp_path), write=policy), flush=policy is WritePolicy.WRITE_BACK)
    results = run(config(CacheTiers.L1_L2_L3, str(tmp_path), write=policy))
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


def audit(engine: Engine) -> int:
    """Compare every node's FULL (with the draft layer) and SWA KV and checkpoint, on both tiers,
    with a fresh prefill of the node's whole prefix; returns how many copies were checked."""
    runner = engine.runner
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
        expected = {"full": torch.cat([full, draft], dim=1)[:, :, begin:], "swa": swa[:, :, begin:]}
        copies = {
            "full": (node.device_value, node.host_value, engine.device_pool.kv, engine.host_pool),
            "swa": (runner.window.slots(node, True), runner.window.slots(node, False), runner.swa.device.kv, runner.swa.host),
        }
        for name, (device, host, device_kv, host_pool) in copies.items():
            if device is not None:
                assert torch.equal(device_kv[:, :, device], expected[name]), f"{node}: device {name} KV"
                checked += 1
            if host is not None:
                assert torch.equal(read_host(host_pool, device_kv, host), expected[name]), f"{node}: host {name} KV"
                checked += 1
        for on_device, states in ((True, runner.states.device), (False, runner.states.host)):
            slot = runner.checkpoints.slots(node, on_device)
            if slot is not None:
                assert torch.equal(states[int(slot)], state), f"{node}: {'device' if on_device else 'host'} checkpoint"
                checked += 1
    return checked


@pytest.mark.parametrize("policy", list(WritePolicy))
def test_every_cached_state_equals_a_recomputation(policy, tmp_path) -> None:
    """After a workload under memory pressure (evictions, tombstones, restores from L3), every copy
    the tree holds is bit-identical to recomputing it: nothing stale, nothing mixed up."""
    # The copies only, wherever they came from: the engine's default load policy.
    with Engine(config(CacheTiers.L1_L2_L3, str(tmp_path), write=policy, swa_device_pages=16, cost=CostConfig())) as engine:
        histories: list[list[int]] = [[] for _ in CONVERSATIONS]
        serve_rounds(engine, range(2), histories)
        engine.flush_cache()
        serve_rounds(engine, range(2, 3), histories)
        engine.drain()
        assert audit(engine) >= 10
        tombstones = [
            n for n in engine.tree.nodes() if n.device_value is not None and not engine.runner.window.present(n, device=True)
        ]
        assert tombstones, "the SWA device pool is smaller than the FULL one: some nodes must have lost their window KV"


# --- the branch-backup scenario --------------------------------------------------------------

SHARED = make_conversations(1, 1, 96, MODEL.vocab_size, seed=11)[0][0]
SUFFIXES = make_conversations(12, 1, 12, MODEL.vocab_size, seed=12)


def branch_scenario(backfill: bool, root: str, **settings: object) -> tuple[list[RequestResult], tuple[int, ...]]:
    """Two requests share a prefix and diverge (the second leaves a new checkpoint at the branch
    point, on a prefix whose KV is already backed up); then L1 and L2 are emptied before each of
    ten more requests for the same prefix with new suffixes. ``settings``: more of ``config``'s.

    Returns their results, and the cuts (in pages) of the first of them the store could restore
    before it was served."""
    with Engine(config(CacheTiers.L1_L2_L3, root, controller={"backfill": backfill}, **settings)) as engine:  # type: ignore[arg-type]
        engine.serve([Request("first", SHARED + SUFFIXES[0][0], NEW_TOKENS)])
        engine.drain()  # backed up before the branch: a backup in flight would carry the branch's state along
        engine.serve([Request("branch", SHARED + SUFFIXES[1][0], NEW_TOKENS)])
        store = engine.controller.store
        assert store is not None
        cuts: tuple[int, ...] = ()
        results = []
        for i, suffix in enumerate(SUFFIXES[2:]):
            engine.flush_cache()
            prompt = SHARED + suffix[0]
            if i == 0:
                cuts = store.lookup(page_hashes(prompt[: (len(prompt) - 1) // PAGE * PAGE], PAGE)).cuts
            results += engine.serve([Request(f"again-{i}", prompt, NEW_TOKENS)])
    return results, cuts


def test_backfill_restores_the_whole_shared_prefix_and_its_absence_shows_the_gap(tmp_path) -> None:
    with_backfill, _ = branch_scenario(True, str(tmp_path / "on"))
    without, _ = branch_scenario(False, str(tmp_path / "off"))
    assert [r.output_ids for r in with_backfill] == [r.output_ids for r in without]
    assert [r.cached_storage for r in with_backfill] == [len(SHARED)] * 10
    assert sum(r.cached_storage == len(SHARED) for r in without) == 0, [r.cached_storage for r in without]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_prefetch_whose_only_stored_boundary_lies_past_its_capacity_restores_up_to_it(shape, tmp_path) -> None:
    """A prefetch capacity of 8 pages, short of the branch point (12 pages), the only boundary
    whose state every pool holds in L3: the op, longer than the capacity, runs alone and reads
    up to that boundary. Capped at the capacity it would find no restorable cut in what it read
    and restore nothing. With backfill, every request restores the whole shared prefix, outputs
    bit-identical to no cache."""
    model, capacity = SHAPES[shape], 8
    results, cuts = branch_scenario(True, str(tmp_path), model=model, capacity_pages=capacity)
    assert cuts == (len(SHARED) // PAGE,) and cuts[0] > capacity, cuts
    assert [r.cached_storage for r in results] == [len(SHARED)] * 10
    with Engine(config(CacheTiers.OFF, model=model)) as plain:
        expected = plain.serve([Request(r.rid, SHARED + suffix[0], NEW_TOKENS) for r, suffix in zip(results, SUFFIXES[2:])])
    for want, got in zip(expected, results):
        assert got.output_ids == want.output_ids and got.draft_ids == want.draft_ids, got.rid
        assert got.logits is not None and want.logits is not None
        assert torch.equal(got.logits.view(torch.int32), want.logits.view(torch.int32)), got.rid


TOGETHER = make_conversations(3, 1, 64, MODEL.vocab_size, seed=19)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefetches_short_of_component_host_slots_wait_for_them_instead_of_reading_pages_no_request_resumes_at(shape, tmp_path) -> None:
    """Three prompts stored in L3 by another instance, restored at once by an engine whose SWA
    host pool holds one window (2 pages): their prefetches take turns for it. A prefetch issued
    without its components' state would read FULL pages its request cannot resume at (no window
    before the cut) and recompute them; here every page read is used, and every request restores
    its whole-page prefix, outputs bit-identical to no cache."""
    model = SHAPES[shape]
    requests = [Request(f"p{i}", turns[0], NEW_TOKENS) for i, turns in enumerate(TOGETHER)]
    with Engine(config(CacheTiers.OFF, model=model)) as plain:
        expected = plain.serve(requests)
    with Engine(config(CacheTiers.L1_L2_L3, str(tmp_path), model=model)) as filler:
        filler.serve(requests)
        filler.drain()
    window = -(-(model.window - 1) // PAGE)
    tight = HybridPools(swa_device_pages=32, swa_host_pages=window, device_checkpoints=6, host_checkpoints=24)
    with Engine(config(CacheTiers.L1_L2_L3, str(tmp_path), model=model, hybrid=tight)) as engine:
        got = engine.serve(requests)
        read = engine.metrics.snapshot()["prefetch_pages"]
    whole = (len(TOGETHER[0][0]) - 1) // PAGE * PAGE
    assert [r.cached_storage for r in got] == [whole] * len(requests)
    assert read * PAGE == whole * len(requests), "every page read from L3 was restored"
    assert_same_outputs(expected, got)


def test_a_waiting_request_that_loses_what_it_fetched_fetches_it_back(tmp_path) -> None:
    """A waiting request takes its finished prefetch into the tree (pinned). When the head of
    the queue cannot start and nothing runs, ``unpin_waiting`` takes the pin, and the pages may
    be evicted before the request starts: it then fetches them back once, as a request whose
    matched prefix was evicted does. (Before, only the prefix matched when it was planned counted
    as lost: it recomputed what it had read.)"""
    request = Request("p", TOGETHER[0][0], NEW_TOKENS)
    with Engine(config(CacheTiers.OFF)) as plain:
        (expected,) = plain.serve([request])
    with Engine(config(CacheTiers.L1_L2_L3, str(tmp_path))) as filler:
        filler.serve([request])
        filler.drain()
    with Engine(config(CacheTiers.L1_L2_L3, str(tmp_path))) as engine:
        engine.submit(request)
        (live,) = engine.admission.waiting
        while live.prefetch is not None:  # taken once read; then its start fails: no memory
            engine.admission.admit(lambda _: False, lambda _: None)
        fetched = live.storage_tokens
        assert fetched > 0 and live.pinned is None, "the failed head released its own pin"
        engine.tree.evict_host(engine.host_pool.num_pages * PAGE)  # type: ignore[union-attr]
        assert engine.tree.match_prefix(engine.admission.matchable(live)).matched_length == 0
        while engine.has_work():
            engine.step()
        (got,) = engine.take_results()
    assert got.cached_storage == fetched == (len(request.tokens) - 1) // PAGE * PAGE
    assert got.output_ids == expected.output_ids and torch.equal(got.logits, expected.logits)


# --- every pool votes ------------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["kv", "swa", "mamba"])
def test_a_missing_page_of_any_pool_shortens_the_restored_prefix(pool, tmp_path) -> None:
    prompt = SHARED + SUFFIXES[0][0]
    with Engine(config(CacheTiers.OFF)) as plain:
        (expected,) = plain.serve([Request("r", prompt, NEW_TOKENS)])
    with Engine(config(CacheTiers.L1_L2_L3, str(tmp_path))) as engine:
        engine.serve([Request("w", prompt, NEW_TOKENS)])
        engine.flush_cache()
        hashes = page_hashes(prompt[: (len(prompt) - 1) // PAGE * PAGE], PAGE)
        store = engine.controller.store
        assert store is not None
        cut = store.usable_pages(hashes)
        assert cut == len(hashes), "the whole prompt was backed up"
        missing = hashes[cut - 1]  # inside every pool's trailing window of the full cut
        name = engine.key_scope.part if pool == "kv" else pool
        assert store.store.delete(store.keys(name, [missing])) == [True]
        assert store.usable_pages(hashes) < cut
        (result,) = engine.serve([Request("r", prompt, NEW_TOKENS)])
    assert result.cached_storage < cut * PAGE
    assert result.output_ids == expected.output_ids and torch.equal(result.logits, expected.logits)
    assert result.draft_ids == expected.draft_ids


def test_sessions_reference_what_their_requests_cached() -> None:
    with Engine(config(CacheTiers.L1_L2)) as engine:
        engine.serve([Request("a", SHARED + SUFFIXES[0][0], NEW_TOKENS, session_id="s")])
        (node,) = engine.sessions.referenced_nodes("s")
        assert node.session_refs == 1 and node.end == (len(SHARED) + 12 + NEW_TOKENS - 1) // PAGE * PAGE
        engine.close_session("s")
        assert node.session_refs == 0 and engine.tree.in_tree(node), "closing drops the reference, not the data"


def test_a_failing_and_hanging_store_degrades_to_recomputation(uncached, tmp_path) -> None:
    """Errors on every operation and calls that hang past the timeout: outputs stay exact, the
    engine never raises, the failures are counted, and hits resume once the store recovers."""
    faults = {"error_rate": 0.2, "errors": ["unavailable", "runtime", "timeout"], "hang_rate": 0.05, "hang_seconds": 2.0}
    storage = stack_layers(
        create_backend("file", {"root": str(tmp_path)}),
        [{"kind": "faults", "seed": 3, "exists": faults, "get": faults, "put": faults}],
    )
    with Engine(config(CacheTiers.L1_L2_L3, controller={"storage_timeout_s": 0.2}), storage) as engine:
        failing = serve_rounds(engine, range(3), [[] for _ in CONVERSATIONS], flush=True)
        counters = engine.metrics.snapshot()
        storage.pause()  # type: ignore[attr-defined]
        recovered = serve_rounds(engine, range(3), [[] for _ in CONVERSATIONS], flush=True)
    assert_same_outputs(uncached, failing)
    assert_same_outputs(uncached, recovered)
    assert counters["storage_errors"] > 0 and counters["storage_timeouts"] > 0
    assert all(r.cached_storage > 0 for r in recovered[len(CONVERSATIONS) :]), "hits resume once the store recovers"


def test_a_store_failing_permanently_is_given_up_and_outputs_stay_exact(uncached, tmp_path) -> None:
    """StorageHealth holds for hybrid models: the first permanent error stops every pool's I/O."""
    faults = {"error_rate": 1.0, "errors": ["permission"]}
    storage = stack_layers(create_backend("file", {"root": str(tmp_path)}), [{"kind": "faults", "seed": 1, "put": faults}])
    with Engine(config(CacheTiers.L1_L2_L3, cost=CostConfig()), storage) as engine:  # nothing read: the default policy
        results = serve_rounds(engine, range(3), [[] for _ in CONVERSATIONS], flush=True)
        counters = engine.metrics.snapshot()
    assert_same_outputs(uncached, results)
    assert counters["storage_disabled"] == 1 and counters["storage_backup_pages"] == 0


def test_an_swa_pool_smaller_than_one_requests_windows_is_refused_naming_the_field() -> None:
    with Engine(config(CacheTiers.L1_L2, device_pages=64, swa_device_pages=5)) as engine:
        free = engine.device_pool.allocator.free_pages
        with pytest.raises(EngineCapacityError, match="swa_device_pages"):
            engine.serve([Request("small", SHARED[:16], NEW_TOKENS)])
        assert engine.device_pool.allocator.free_pages == free


# --- SWA memory as SWA saves it ---------------------------------------------------------------

WINDOW_PAGES = -(-(4 * MODEL.window + PAGE) // PAGE)  # 4 x window + a page, per running request
LONG = make_conversations(2, 2, 240, MODEL.vocab_size, seed=17)
#: Shape -> the uncached outputs of the long workload, computed once per shape for both tiers.
_uncached_long: dict[str, list[RequestResult]] = {}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tiers", [CacheTiers.L1, CacheTiers.L1_L2_L3])
def test_an_swa_pool_of_a_few_windows_per_request_serves_prompts_as_long_as_the_full_pool_allows(shape, tiers, tmp_path) -> None:
    """A running request holds SWA KV only for the window its next chunk reads (and the windows
    the cache keeps), so an SWA device pool of 4 x window + a page per running request serves
    prompts of 484 tokens with a FULL pool of 512, outputs bit-identical to no cache."""

    def serve(engine: Engine) -> list[RequestResult]:
        histories: list[list[int]] = [[] for _ in LONG]
        results = []
        for r in range(2):
            for c, turns in enumerate(LONG):
                (result,) = engine.serve([Request(f"c{c}-r{r}", histories[c] + turns[r], NEW_TOKENS)])
                histories[c] = histories[c] + turns[r] + result.output_ids
                results.append(result)
            if tiers.storage:
                engine.flush_cache()
        return results

    model = SHAPES[shape]
    if shape not in _uncached_long:
        with Engine(config(CacheTiers.OFF, model=model, device_pages=64, swa_device_pages=64)) as plain:
            _uncached_long[shape] = serve(plain)
    expected = _uncached_long[shape]
    cfg = config(tiers, str(tmp_path), model=model, device_pages=64, host_pages=128, swa_device_pages=WINDOW_PAGES, max_running=1)
    with Engine(cfg) as engine:
        got = serve(engine)
    assert max(r.prompt_tokens for r in got) == 2 * 240 + NEW_TOKENS
    assert_same_outputs(expected, got)
    later = [r.cached_tokens for r in got[len(LONG) :]]
    # L1 alone holds one long conversation at a time; L3 restores both after each flush.
    assert (min(later) if tiers.storage else max(later)) >= 240, [r.cached_tokens for r in got]


def test_sessions_keep_their_prefixes_cached_under_pressure_better_than_lru() -> None:
    """Three conversations interleaved with one-off prompts that push the pools: with session
    ids the conversations' next rounds hit more than under plain LRU, with identical outputs."""
    noise = make_conversations(9, 1, 48, MODEL.vocab_size, seed=13)

    def workload(sessions: bool) -> list[RequestResult]:
        cfg = config(CacheTiers.L1_L2, device_pages=24, host_pages=32, swa_device_pages=24, host_checkpoints=12)
        histories: list[list[int]] = [[] for _ in CONVERSATIONS]
        kept = []
        with Engine(cfg) as engine:
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


@pytest.mark.parametrize("field", ["swa_device_pages", "swa_host_pages", "device_checkpoints", "host_checkpoints"])
def test_a_pool_sized_zero_is_refused_naming_the_field(field) -> None:
    with pytest.raises(ValueError, match=f"HybridPools.{field} must be a positive int"):
        Engine(config(CacheTiers.L1_L2, hybrid=HybridPools(**{field: 0})))
