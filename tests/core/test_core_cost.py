"""Load or recompute through the engine: the cost model's choices (``hicache_storage.cost``), with
speeds given in ``CostConfig`` so that every plan is the same on any machine, and computed by hand.

* A store too slow to beat compute is not read: the engine recomputes the stored prefix.
* A store faster than compute serves every stored page; what the engine wrote to a store that
  keeps its pages it reads without a lookup, and a page deleted behind its back ends the read.
* With compute queued ahead of a request, a slow store serves the head of its stored prefix
  that arrives before the engine reaches it; the rest is recomputed.
* A hybrid model's head is cut back to a boundary every pool can resume at.
* While the store is the slow leg, write-through backs up only what was hit again, and the
  backup thread rests between puts, but never while an allocation waits for pages it pins.
* A prefetch that cannot get host slots is waited for no longer than computing its pages takes.
* Lookups of pages only another engine could have written stop being waited for once they find
  nothing; the pages a backup is still writing are not among those.

Outputs stay bit-identical to no cache throughout: a page recomputed has the KV a page loaded has.
The speeds: pages of 4 tokens and 1 KiB (the model below), compute 1,024 tokens/s (a page in
1/256 s); the copies to the device and the writes at 1 GiB/s.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid

import torch

from hicache_core.backup import BackupOp, StorageBackup
from hicache_core.controller import ControllerConfig
from hicache_core.engine import CacheTiers, Engine, EngineConfig, HybridPools, Request, RequestResult
from hicache_core.hybrid.model import HybridModelConfig
from hicache_core.metrics import CacheMetrics
from hicache_core.model import ModelConfig
from hicache_core.page_sets import PageSet
from hicache_core.pin_cap import PinCap
from hicache_core.pools import PageAllocator
from hicache_core.prefetch import PrefetchConfig, PrefetchOp, StopPolicy
from hicache_core.side_pools import PoolPages
from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.cost import CostConfig, CostModel, LoadPolicy
from hicache_storage.keys import page_hashes
from hicache_storage.layers import FaultInjectionLayer

MODEL = ModelConfig(vocab_size=256, hidden=32, layers=2, q_heads=4, kv_heads=2, head_dim=8, ffn=64, seed=31)
PAGE = 4
PAGE_BYTES = 1024  # 2 (K and V) x 2 layers x 2 heads x 8 dims x 4 bytes x 4 tokens
COMPUTE_TOKENS_PER_S = 1024.0
GIB_PER_S = float(2**30)
#: A store that reads a page in 1/1024 s, four times faster than computing it.
FAST_READ = 1024.0 * PAGE_BYTES
#: A store that reads a page in 1/64 s, four times slower than computing it.
SLOW_READ = 64.0 * PAGE_BYTES
#: A store that reads a page in a second: no compute queued ahead makes it worth waiting for.
CRAWLING_READ = 1.0 * PAGE_BYTES
NEW_TOKENS = 3
#: A guard against a hang, never a timing assertion.
DEADLINE_S = 60.0


def speeds(read_bytes_per_s: float) -> CostConfig:
    """Every speed given: the store reads at ``read_bytes_per_s``, the rest as the module says."""
    return CostConfig(
        read_bytes_per_s=read_bytes_per_s, write_bytes_per_s=GIB_PER_S, copy_bytes_per_s=GIB_PER_S, compute_tokens_per_s=COMPUTE_TOKENS_PER_S
    )


def engine_config(tiers: CacheTiers, store: str, read_bytes_per_s: float = FAST_READ, **controller: object) -> EngineConfig:
    # wait_complete: a request waits for the pages planned (the timeout policy's own stop by cost
    # is timed on the read's pace, not given).
    prefetch = PrefetchConfig(threshold_tokens=8, stop_policy=StopPolicy.WAIT_COMPLETE)
    return EngineConfig(
        model=MODEL, tiers=tiers, page_size=PAGE, device_pages=64, host_pages=128, host_ratio=None,
        controller=ControllerConfig(prefetch=prefetch, cost=speeds(read_bytes_per_s), **controller),  # type: ignore[arg-type]
        storage_backend="memory" if tiers.storage else None, storage_config={"store": store} if tiers.storage else None,
        max_running=2,
    )


def prompt(seed: int, tokens: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (tokens,), generator=generator).tolist()


def uncached(requests: list[Request]) -> list[RequestResult]:
    with Engine(engine_config(CacheTiers.OFF, "")) as engine:
        return engine.serve(requests)


def assert_identical(expected: list[RequestResult], got: list[RequestResult]) -> None:
    for want, have in zip(expected, got, strict=True):
        assert have.output_ids == want.output_ids, have.rid
        assert have.logits is not None and want.logits is not None
        assert torch.equal(have.logits.view(torch.int32), want.logits.view(torch.int32)), have.rid


def stored_pages(engine: Engine, tokens: list[int]) -> int:
    """How many whole pages of ``tokens`` the engine's store holds, from the first."""
    store = engine.controller.store
    assert store is not None
    hashes = page_hashes(tokens[: len(tokens) // PAGE * PAGE], PAGE)
    return store.store.prefix_exists(store.keys(engine.key_scope.part, hashes))


#: Three prompts of 41 tokens: 40 to match (10 pages), the last always computed.
PROMPTS = [prompt(seed, 41) for seed in (1, 2, 3)]
WHOLE = 40


def filled_store() -> str:
    """A memory store holding every page of ``PROMPTS`` (written by an engine with a fast store)."""
    store = f"cost-{uuid.uuid4().hex}"
    with Engine(engine_config(CacheTiers.L1_L2_L3, store)) as filler:
        filler.serve([Request(f"fill-{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)])
        filler.drain()
        assert all(stored_pages(filler, p) == WHOLE // PAGE for p in PROMPTS)
        assert filler.metrics.snapshot()["storage_backup_deferred"] == 0, "a store faster than compute: write-through writes all"
    return store


def test_a_store_too_slow_to_beat_compute_is_not_read_and_the_engine_recomputes():
    """A page reads in a second and computes in 1/256 s: on an engine with no compute ahead worth
    a page of reading, no stored page is worth loading, so each prefetch is declined whole before
    the store is even asked. What the engine did not write it does not know is stored."""
    requests = [Request(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)]
    expected = uncached(requests)
    store = filled_store()
    with Engine(engine_config(CacheTiers.L1_L2_L3, store, CRAWLING_READ)) as engine:
        assert engine.host_pool is not None and engine.host_pool.page_bytes == PAGE_BYTES
        got = engine.serve(requests)
        counters = engine.metrics.snapshot()
        calls = engine.controller.storage.stats()  # type: ignore[union-attr]
    assert_identical(expected, got)
    assert [r.cached_storage for r in got] == [0, 0, 0] and [r.computed for r in got] == [len(p) for p in PROMPTS]
    assert counters["prefetch_lookups_skipped"] == counters["prefetch_declined_by_cost"] == 3
    assert counters["prefetch_declined_pages"] == 0 and [r.stored_recomputed for r in got] == [0] * 3, "another engine's pages"
    assert counters["prefetch_pages"] == counters["prefetch_bytes"] == 0
    assert calls["get_calls"] == calls["bytes_read"] == 0, "the store was not read"


def test_pages_an_engine_stored_itself_count_as_recomputed_when_it_declines_them():
    """The engine wrote the pages while its store was fast; then the store slows to a page a
    second (its read speed given anew, as a fit of new timings would). Declined without a lookup,
    the pages are still known stored, and reported as stored tokens the requests recomputed."""
    requests = [Request(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)]
    expected = uncached(requests)
    with Engine(engine_config(CacheTiers.L1_L2_L3, f"cost-{uuid.uuid4().hex}", FAST_READ)) as engine:
        assert_identical(expected, engine.serve(requests))
        engine.drain()
        assert all(stored_pages(engine, p) == WHOLE // PAGE for p in PROMPTS)
        engine.flush_cache()
        engine.controller.cost.reads.given = CRAWLING_READ
        got = engine.serve([Request(f"again-{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)])
        counters = engine.metrics.snapshot()
    assert_identical(expected, got)
    assert [r.cached_storage for r in got] == [0, 0, 0] and [r.stored_recomputed for r in got] == [WHOLE] * 3
    assert counters["prefetch_lookups_skipped"] == 3 and counters["prefetch_declined_pages"] == 3 * WHOLE // PAGE
    assert counters["prefetch_pages"] == 0


def test_a_store_faster_than_compute_serves_every_stored_page_after_a_flush():
    requests = [Request(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)]
    expected = uncached(requests)
    with Engine(engine_config(CacheTiers.L1_L2_L3, f"cost-{uuid.uuid4().hex}", FAST_READ)) as engine:
        assert_identical(expected, engine.serve(requests))
        engine.drain()
        engine.flush_cache()
        again = engine.serve([Request(f"again-{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)])
        counters = engine.metrics.snapshot()
    assert_identical(expected, again)
    assert [r.cached_storage for r in again] == [WHOLE] * 3 and [r.stored_recomputed for r in again] == [0] * 3
    assert counters["prefetch_declined_pages"] == 0 and counters["prefetch_pages"] == 3 * WHOLE // PAGE


def test_pages_an_engine_wrote_to_a_store_that_keeps_them_are_read_without_a_lookup():
    """The memory store drops nothing on its own (no capacity: no ``evicts``), so the pages the
    engine wrote are there without asking: after a flush each prefetch reads them with no
    ``exists`` call. Another engine's pages it has never seen are still looked up."""
    requests = [Request(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)]
    expected = uncached(requests)
    with Engine(engine_config(CacheTiers.L1_L2_L3, f"cost-{uuid.uuid4().hex}", FAST_READ)) as engine:
        storage = engine.controller.storage
        assert storage is not None and not storage.capabilities.evicts
        assert_identical(expected, engine.serve(requests))
        engine.drain()
        engine.flush_cache()
        before = storage.stats()
        again = engine.serve([Request(f"again-{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)])
        after = storage.stats()
        counters = engine.metrics.snapshot()
    assert_identical(expected, again)
    assert [r.cached_storage for r in again] == [WHOLE] * 3
    assert counters["prefetch_lookups_known"] == 3
    assert after["exists_keys"] == before["exists_keys"], "no page was looked up"
    assert after["get_keys"] - before["get_keys"] == 3 * WHOLE // PAGE

    store = filled_store()  # written by another engine: this one asks
    with Engine(engine_config(CacheTiers.L1_L2_L3, store, FAST_READ)) as engine:
        got = engine.serve(requests)
        counters = engine.metrics.snapshot()
        calls = engine.controller.storage.stats()  # type: ignore[union-attr]
    assert_identical(expected, got)
    assert [r.cached_storage for r in got] == [WHOLE] * 3
    assert counters["prefetch_lookups_known"] == 0 and calls["exists_keys"] >= 3 * WHOLE // PAGE


def test_a_lookup_asks_only_for_the_pages_past_those_the_engine_knows_stored():
    """The engine wrote the first 6 pages of each prompt; another engine then wrote all 10. After
    a flush, each prefetch asks the store about the last 4 only, and reads all 10."""
    known = 6
    store = f"cost-{uuid.uuid4().hex}"
    requests = [Request(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)]
    expected = uncached(requests)
    with Engine(engine_config(CacheTiers.L1_L2_L3, store, FAST_READ)) as engine:
        engine.serve([Request(f"head-{i}", p[: known * PAGE + 1], NEW_TOKENS) for i, p in enumerate(PROMPTS)])
        engine.drain()
        assert all(stored_pages(engine, p) == known for p in PROMPTS)
        with Engine(engine_config(CacheTiers.L1_L2_L3, store, FAST_READ)) as other:
            other.serve([Request(f"other-{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)])
            other.drain()
        assert all(stored_pages(engine, p) == WHOLE // PAGE for p in PROMPTS)
        engine.flush_cache()
        storage = engine.controller.storage
        assert storage is not None
        before = storage.stats()
        again = engine.serve(requests)
        asked = storage.stats()["exists_keys"] - before["exists_keys"]
        counters = engine.metrics.snapshot()
    assert_identical(expected, again)
    assert [r.cached_storage for r in again] == [WHOLE] * 3
    assert asked == 3 * (WHOLE // PAGE - known), "only the pages this engine did not write are looked up"
    assert counters["prefetch_lookups_known"] == 0


def test_a_page_deleted_behind_the_engines_back_ends_the_read_there_and_is_written_again():
    """A page the engine wrote is deleted by someone else. Not looked up (the engine knows it
    wrote it), it is found missing by the read: the request loads the pages before it, computes
    the rest with outputs unchanged, and the backup writes the page again (a suspect: see
    ``Prefetcher.suspects``)."""
    requests = [Request(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)]
    expected = uncached(requests)
    gone = 5
    with Engine(engine_config(CacheTiers.L1_L2_L3, f"cost-{uuid.uuid4().hex}", FAST_READ)) as engine:
        assert_identical(expected, engine.serve(requests))
        engine.drain()
        engine.flush_cache()
        store = engine.controller.store
        assert store is not None
        hashes = page_hashes(PROMPTS[0][:WHOLE], PAGE)
        assert store.store.delete(store.keys(engine.key_scope.part, hashes[gone : gone + 1])) == [True]
        again = engine.serve([Request(f"again-{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)])
        counters = engine.metrics.snapshot()
        engine.drain()
        rewritten = stored_pages(engine, PROMPTS[0])
    assert_identical(expected, again)
    assert [r.cached_storage for r in again] == [gone * PAGE, WHOLE, WHOLE]
    assert again[0].computed == len(PROMPTS[0]) - gone * PAGE
    assert counters["prefetch_lookups_known"] == 3 and counters["prefetch_failed_batches"] == 1
    assert rewritten == WHOLE // PAGE, "the backup wrote the missing page again"


def serve_submitted_together(engine: Engine, requests: list[Request]) -> dict[str, RequestResult]:
    """Submit ``requests`` at once, wait until the last one's prefetch is answered (nothing starts
    meanwhile: the engine is not stepped, so every request is still queued for compute when
    that prefetch is planned), then serve them all."""
    for request in requests:
        engine.submit(request)
    op = engine.admission.waiting[-1].prefetch
    assert op is not None, "the last request plans a prefetch"
    assert op.done.wait(DEADLINE_S), "its prefetch never finished"
    while engine.has_work():
        engine.step()
    return {r.rid: r for r in engine.take_results()}


def test_compute_queued_ahead_lets_a_slow_store_serve_the_head_that_arrives_in_time():
    """``first`` computes 134 new tokens, queued ahead of ``second``: 134/1024 = 0.1309 s. At 1/64 s
    a page (and 1/2^20 s to copy it), 8.37 pages' worth of reading fit in that time, so 8 pages of
    ``second``'s stored prefix (20) are ready by then; the ninth is ready 0.0098 s after the engine
    could start on ``second``, more than computing a page takes (1/256 s). So ``second`` loads 8
    pages and recomputes the other 12."""
    history = prompt(10, 81)  # 80 tokens to match: 20 pages stored
    requests = [Request("first", prompt(11, 134), NEW_TOKENS), Request("second", history, NEW_TOKENS)]
    expected = uncached(requests)
    store = f"cost-{uuid.uuid4().hex}"
    with Engine(engine_config(CacheTiers.L1_L2_L3, store)) as filler:
        filler.serve([Request("fill", history, NEW_TOKENS)])
        filler.drain()
        assert stored_pages(filler, history) == 20
    with Engine(engine_config(CacheTiers.L1_L2_L3, store, SLOW_READ)) as engine:
        got = serve_submitted_together(engine, requests)
        counters = engine.metrics.snapshot()
    assert_identical(expected, [got["first"], got["second"]])
    second = got["second"]
    # It asked the store about the pages it could load (those ready in time, and the one after):
    # what the store holds past them, another engine wrote, it does not know (no stored_recomputed).
    assert second.cached_storage == 8 * PAGE and second.stored_recomputed == 0
    assert second.computed == len(history) - 8 * PAGE
    assert counters["prefetch_pages"] == 8 and counters["prefetch_bytes"] == 8 * PAGE_BYTES, "only the head was read"
    assert got["first"].cached_storage == 0


# --- a hybrid model -----------------------------------------------------------------------------

#: A small FULL + SWA + recurrent model (each kind of state a cut must have), without a draft.
HYBRID = HybridModelConfig(hidden=32, head_dim=8, ffn=64, layer_kinds=("full", "swa", "recurrent", "full"), window=12, state_dim=16)
HYBRID_PAGE = 8


def hybrid_config(tiers: CacheTiers, store: str, read_bytes_per_s: float) -> EngineConfig:
    prefetch = PrefetchConfig(threshold_tokens=HYBRID_PAGE, stop_policy=StopPolicy.WAIT_COMPLETE)
    return EngineConfig(
        model=HYBRID, tiers=tiers, page_size=HYBRID_PAGE, device_pages=48, host_pages=96, host_ratio=None,
        hybrid=HybridPools(swa_device_pages=32, device_checkpoints=6, host_checkpoints=24, draft=False),
        controller=ControllerConfig(prefetch=prefetch, cost=speeds(read_bytes_per_s)),
        storage_backend="memory" if tiers.storage else None, storage_config={"store": store} if tiers.storage else None,
        max_running=2,
    )


def test_a_hybrid_models_head_is_cut_back_to_a_boundary_every_pool_resumes_at():
    """The store holds the hybrid state of a 65-token history at two boundaries (4 pages, where a
    first turn ended, and 8, its end). With compute queued ahead, the plan's head (6 pages) lies
    between them: the plan chooses among the boundaries (loading to 8 would finish later), so
    the request restores 4 pages and recomputes the rest, outputs bit-identical to no cache."""
    history = prompt(20, 8 * HYBRID_PAGE + 1)
    store = f"cost-hybrid-{uuid.uuid4().hex}"
    with Engine(hybrid_config(CacheTiers.L1_L2_L3, store, FAST_READ)) as filler:
        filler.serve([Request("turn-1", history[: 4 * HYBRID_PAGE + 1], 2)])
        filler.serve([Request("turn-2", history, 2)])
        filler.drain()
        multipool = filler.controller.store
        assert multipool is not None
        cuts = multipool.lookup(page_hashes(history[: 8 * HYBRID_PAGE], HYBRID_PAGE)).cuts
        assert filler.host_pool is not None
        page_bytes = filler.host_pool.page_bytes
    assert set(cuts) >= {4, 8} and not any(4 < cut < 8 for cut in cuts), cuts
    # ``first`` queues 160 tokens of compute (0.156 s) ahead of ``second``; the store is given the
    # speed that reads 6.5 pages in that time (a page in 0.024 s, three times as long as computing
    # one, 8/1024 s): the plan's head is 6 pages (the seventh is ready half a page of reading,
    # 0.012 s, after the engine could start on ``second``: more than computing it takes).
    ahead_s = 160 / COMPUTE_TOKENS_PER_S
    read = 6.5 * page_bytes / ahead_s
    model = CostModel(speeds(read))
    model.enqueue("first", 160)
    assert model.pages_to_load("second", 8, page_bytes=page_bytes, page_tokens=HYBRID_PAGE).pages == 6
    requests = [Request("first", prompt(21, 160), 2), Request("second", history, 2)]
    with Engine(hybrid_config(CacheTiers.OFF, "", FAST_READ)) as plain:
        expected = plain.serve(requests)
    with Engine(hybrid_config(CacheTiers.L1_L2_L3, store, read)) as engine:
        got = serve_submitted_together(engine, requests)
        counters = engine.metrics.snapshot()
    assert_identical(expected, [got["first"], got["second"]])
    assert got["second"].cached_storage == 4 * HYBRID_PAGE, "of the cuts at 4 and 8, the one nearer the 6 pages worth loading"
    # a hybrid model asks the store about every page (where a load may stop is known only from
    # its answer): it knows the 4 pages past the cut are stored, and recomputes them
    assert got["second"].stored_recomputed == 4 * HYBRID_PAGE
    assert counters["prefetch_pages"] == 4, "only the pages up to the cut were read"


# --- write-through while the store is the slow leg ----------------------------------------------


def test_write_through_degrades_to_what_loads_would_take_while_the_store_is_the_slow_leg():
    """Loading a page (1/64 s) costs four times computing it (1/256 s), and this engine is never
    busy when a request comes: every plan loads none of what the request wants from L3 (no compute
    ahead hides a read), so loads would take none of what is stored (``CostModel.load_share``) and
    write-through writes nothing, however often the node is hit; each offer is a deferral. From a
    store faster than compute, nothing waits."""
    history = prompt(30, 41)
    store = f"cost-{uuid.uuid4().hex}"
    with Engine(engine_config(CacheTiers.L1_L2_L3, store, SLOW_READ, selective_hits=1)) as engine:
        stored_after = []
        for serve in range(3):
            engine.serve([Request(f"serve-{serve}", history, NEW_TOKENS)])
            engine.drain()
            stored_after.append(stored_pages(engine, history))
        counters = engine.metrics.snapshot()
    assert stored_after == [0, 0, 0], "a store no load would read from is not written"
    assert counters["storage_backup_deferred"] == 3 and counters["storage_backup_pages"] == 0
    elsewhere = prompt(31, 41)
    with Engine(engine_config(CacheTiers.L1_L2_L3, store, FAST_READ, selective_hits=1)) as fast:
        fast.serve([Request("elsewhere", elsewhere, NEW_TOKENS)])
        fast.drain()
        assert fast.metrics.snapshot()["storage_backup_deferred"] == 0
        assert stored_pages(fast, elsewhere) == WHOLE // PAGE, "a fast store: write-through writes at once"


def test_a_backup_never_rests_while_an_allocation_waits_for_pages_it_pins():
    """Between puts to a store that is the slow leg the backup thread rests, holding its op's
    pins. A node deleted while its backup was queued frees its host pages under those pins, and
    the scheduler's allocation of them waits for the backup: resting then stops the engine. The
    rest ends once an allocation waits.
    (The thread is never started: the op stays queued and its pages pinned.)"""
    allocator = PageAllocator(num_pages=2, page_size=PAGE)
    slots = allocator.alloc(2 * PAGE)
    assert slots is not None
    metrics = CacheMetrics()
    backup = StorageBackup(
        metrics, 4, PageSet(), PinCap(allocator, None), stored=PageSet(), cost=CostModel(), page_tokens=PAGE, reads_pending=lambda: True
    )
    backup.submit(BackupOp(node=None, begin=0, pools=[PoolPages("kv", ["a", "b"], [], slots, allocator)]))  # type: ignore[arg-type]
    backup._rest(0.05, lambda: True)
    rested = metrics.snapshot()["storage_backup_yield_seconds"]
    assert rested > 0, "with no allocation waiting, the backup rests"

    allocator.free(slots)  # the node is deleted: its pages are free once the backup is written
    waiter = threading.Thread(target=allocator.alloc, args=(PAGE,), daemon=True)
    waiter.start()
    for _ in range(int(DEADLINE_S / 0.01)):
        if allocator.awaited:
            break
        waiter.join(0.01)
    assert allocator.awaited, "the allocation waits for the backup's pins"
    rest = threading.Thread(target=backup._rest, args=(DEADLINE_S, lambda: True), daemon=True)
    rest.start()
    rest.join(DEADLINE_S / 2)  # a guard against a hang, never a timing assertion
    assert not rest.is_alive(), "the backup rested while the scheduler waited for its pins"
    allocator.unpin_io(slots)  # the put is done
    waiter.join(DEADLINE_S)
    assert not waiter.is_alive() and not allocator.awaited


def test_pages_handed_to_a_backup_are_writing_until_the_op_is_taken_back():
    """A lookup about pages the engine's own backup is writing is not one about other engines'
    pages (``Prefetcher._others_pages``): the backup marks them from ``submit`` until the
    scheduler takes the completed op back. (The thread is never started; the op is acknowledged
    by hand.)"""
    allocator = PageAllocator(num_pages=2, page_size=PAGE)
    slots = allocator.alloc(2 * PAGE)
    assert slots is not None
    writing = PageSet()
    backup = StorageBackup(
        CacheMetrics(), 4, PageSet(), PinCap(allocator, None), stored=PageSet(), writing=writing, cost=CostModel(), page_tokens=PAGE,
        reads_pending=lambda: False,
    )
    op = BackupOp(node=None, begin=0, pools=[PoolPages("kv", ["a", "b"], [], slots, allocator)])  # type: ignore[arg-type]
    backup.submit(op)
    assert writing.leading(["a", "b", "c"]) == 2 and backup.queued_pages == 2
    backup._acks.put(op)
    assert backup.take() is op
    assert writing.leading(["a", "b"]) == 0 and backup.queued_pages == 0


# --- a prefetch short of host slots -------------------------------------------------------------


def test_a_prefetch_short_of_host_slots_is_waited_for_as_long_as_computing_it_takes():
    """Under ``timeout`` and the cost model, a request whose prefetch cannot get host slots stops
    waiting once it has waited as long as computing the op's pages instead would take to finish:
    the device work queued ahead of it, then the pages (10 pages: 1/256 s each), and only while
    no other request runs; ``wait_complete`` and ``LoadPolicy.ALL`` keep waiting for as long as
    I/O is in flight."""

    def gives_up(stop_policy: StopPolicy, load_policy: LoadPolicy, waited_s: float, ahead_tokens: int = 0, running: bool = False) -> bool:
        config = engine_config(CacheTiers.L1_L2_L3, f"cost-{uuid.uuid4().hex}")
        config.controller = dataclasses.replace(
            config.controller,
            prefetch=dataclasses.replace(config.controller.prefetch, stop_policy=stop_policy),
            cost=dataclasses.replace(config.controller.cost, policy=load_policy),
        )
        with Engine(config) as engine:
            prefetcher = engine.controller.prefetcher
            assert prefetcher is not None
            engine.controller.cost.enqueue("ahead", ahead_tokens)  # a request queued before it
            engine.controller.cost.enqueue("r", WHOLE)
            op = PrefetchOp("r", list(range(WHOLE)), 0, [f"h{i}" for i in range(WHOLE // PAGE)])
            op.planned_at = time.monotonic() - waited_s
            return prefetcher.gives_up(op, running=running)

    compute_s = (WHOLE // PAGE) * PAGE / COMPUTE_TOKENS_PER_S
    assert gives_up(StopPolicy.TIMEOUT, LoadPolicy.COST, waited_s=compute_s * 4)
    # behind device work of 8 times its compute it could not finish sooner by computing: it waits
    assert not gives_up(StopPolicy.TIMEOUT, LoadPolicy.COST, waited_s=compute_s * 4, ahead_tokens=8 * (WHOLE // PAGE) * PAGE)
    assert gives_up(StopPolicy.TIMEOUT, LoadPolicy.COST, waited_s=compute_s * 10, ahead_tokens=8 * (WHOLE // PAGE) * PAGE)
    # while other requests run, waiting costs the device nothing: it waits however long
    assert not gives_up(StopPolicy.TIMEOUT, LoadPolicy.COST, waited_s=3600.0, running=True)
    assert not gives_up(StopPolicy.TIMEOUT, LoadPolicy.COST, waited_s=-3600.0), "planned just now"
    assert not gives_up(StopPolicy.TIMEOUT, LoadPolicy.ALL, waited_s=3600.0)
    assert not gives_up(StopPolicy.WAIT_COMPLETE, LoadPolicy.COST, waited_s=3600.0)


def test_a_request_computes_rather_than_wait_for_host_slots_hung_backups_hold():
    """Puts that hang hold the host pages of the first request's backups (pinned until the put
    returns, here never within the test); the second request's stored prefix then finds no host
    slots, and I/O is in flight, so it would wait for the puts. It computes instead, while the
    puts still hang, and its outputs are those of no cache."""
    store = filled_store()
    first, second = prompt(40, 41), PROMPTS[0]
    expected = uncached([Request("first", first, NEW_TOKENS), Request("second", second, NEW_TOKENS)])
    faults = FaultInjectionLayer(MemoryBackend({"store": store}), {"enabled": False, "put": {"hang_rate": 1.0}})
    config = dataclasses.replace(engine_config(CacheTiers.L1_L2_L3, store), host_pages=16, storage_backend=None, storage_config=None)
    config.controller = dataclasses.replace(config.controller, prefetch=PrefetchConfig(threshold_tokens=8), storage_timeout_s=DEADLINE_S)
    engine = Engine(config, storage=faults)
    try:
        faults.resume()  # every put hangs from now on
        got = engine.serve([Request("first", first, NEW_TOKENS)])
        for _ in range(int(DEADLINE_S / 0.01)):  # its host copy lands, its backup reaches the store
            engine.controller.poll()  # (what the scheduler does each step: queues acknowledged copies' backups)
            if faults.hanging:
                break
            time.sleep(0.01)
        assert faults.hanging, "the first request's backup never called the store"
        got += engine.serve([Request("second", second, NEW_TOKENS)])
        counters = engine.metrics.snapshot()
        assert faults.hanging and counters["storage_timeouts"] == 0, "the second request waited for the hung puts"
        assert counters["prefetch_skipped_by_cost"] >= 1 and counters["prefetch_rate_limited"] >= 1
        assert got[1].cached_storage == 0 and got[1].stored_recomputed == 0
        assert_identical(expected, got)
    finally:
        faults.release_hangs()
        faults.pause()
        engine.close()


def test_lookups_that_never_find_new_pages_stop_being_waited_for():
    """Each request brings a prompt no engine stored. The first asks the store (its lookups take
    0.05 s here) and finds nothing; a 10-page plan saves 29 ms (computing 10 pages against reading
    them), half of which is less than a lookup's time, so the next ones compute without asking.
    The pages the engine wrote itself are still read without a lookup, and outputs stay those
    of no cache."""
    prompts = [prompt(60 + seed, 41) for seed in range(4)]
    requests = [Request(f"new-{i}", p, NEW_TOKENS) for i, p in enumerate(prompts)]
    expected = uncached(requests + [Request("again", prompts[0], NEW_TOKENS)])
    store = f"cost-{uuid.uuid4().hex}"
    faults = FaultInjectionLayer(MemoryBackend({"store": store}), {"exists": {"latency_rate": 1.0, "latency_seconds": 0.05}})
    config = dataclasses.replace(engine_config(CacheTiers.L1_L2_L3, store), storage_backend=None, storage_config=None)
    with Engine(config, storage=faults) as engine:
        got = [engine.serve([request])[0] for request in requests]
        counters = engine.metrics.snapshot()
        assert counters["prefetch_lookups_unlikely"] == len(requests) - 1 and counters["prefetch_revoked"] == len(requests)
        engine.drain()
        engine.flush_cache()
        got += engine.serve([Request("again", prompts[0], NEW_TOKENS)])
        counters = engine.metrics.snapshot()
    assert_identical(expected, got)
    assert got[-1].cached_storage == WHOLE and counters["prefetch_lookups_known"] == 1
