"""The cache controller: backup batching, prefetch threshold / rate limit / stop, page safety under
in-flight I/O, layer-wise loads, runtime attach/detach, and engines on a failing or hanging store."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid

import pytest
import torch

from hicache_core.controller import CacheController, ControllerConfig, WritePolicy
from hicache_core.metrics import CacheMetrics
from hicache_core.prefetch import PrefetchConfig, PrefetchState, StopPolicy
from hicache_core.engine import CacheTiers, Engine, EngineConfig, make_conversations, serve_conversations
from hicache_core.model import ModelConfig
from hicache_core.op_thread import Wakeup
from hicache_core.pools import DevicePool, HostPool, KVGeometry
from hicache_core.radix_tree import RadixTree
from hicache_core.storage_calls import StorageHealth, guarded_call
from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.health import BreakerConfig
from hicache_storage.errors import (
    AuthenticationError,
    BackendContractError,
    BackendUnavailableError,
    CapacityError,
    ErrorStatus,
    StorageError,
    StorageTimeoutError,
)
from hicache_storage.store import Store
from hicache_storage.keys import KeyScope, Namespace, page_hashes
from hicache_storage.layers.faults import FaultInjectionLayer

from pinned_cost import LOAD_AND_STORE_EVERY_PAGE

#: A guard against a hang, never a timing assertion: polls of 10 ms before a wait gives up.
HANG_GUARD_POLLS = 3000
GEOMETRY = KVGeometry(layers=2, kv_heads=1, head_dim=4)
SCOPE = KeyScope(Namespace("controller-test", "float32", 1, "page_first"))


class RecordingBackend(MemoryBackend):
    """A real in-memory store that records batch sizes and can fail one put batch halfway."""

    def __init__(self) -> None:
        super().__init__({"store": f"recording-{uuid.uuid4().hex}"})
        self.put_batches: list[int] = []
        self.fail_put_call: int | None = None
        self.get_entered = threading.Event()
        self.get_gate: threading.Event | None = None

    def _put_from(self, keys, sources):
        self.put_batches.append(len(keys))
        if len(self.put_batches) == self.fail_put_call:
            half = len(keys) // 2
            return super()._put_from(keys[:half], sources[:half]) + [False] * (len(keys) - half)
        return super()._put_from(keys, sources)

    def _get_into(self, keys, targets):
        self.get_entered.set()
        if self.get_gate is not None:
            self.get_gate.wait()
        return super()._get_into(keys, targets)


def make_controller(policy=WritePolicy.WRITE_THROUGH, page_size=1, device_pages=400, host_pages=400, **prefetch):
    device = DevicePool(GEOMETRY, device_pages, page_size, device="cpu")
    device.kv.copy_(torch.randn(device.kv.shape, generator=torch.Generator().manual_seed(0)))
    host = HostPool(GEOMETRY, page_size, "page_first", num_pages=host_pages)
    tree = RadixTree(page_size, device.allocator.free, host.allocator.free)
    config = ControllerConfig(write_policy=policy, storage_timeout_s=None, prefetch=PrefetchConfig(**prefetch))
    return CacheController(config, tree, device, host)


def insert(controller: CacheController, tokens: list[int]):
    slots = controller.alloc_device(len(tokens))
    result = controller.tree.insert(tokens, slots[: len(tokens)])
    controller.on_insert(result)
    return slots


def test_backup_goes_in_batches_of_128_and_stops_at_the_first_failed_batch():
    controller = make_controller()
    backend = RecordingBackend()
    backend.fail_put_call = 2
    controller.attach_storage(backend, SCOPE)
    try:
        tokens = list(range(300))
        insert(controller, tokens)
        controller.drain()
        assert backend.put_batches == [128, 128], "the third batch must not run after the second failed"
        stats = controller.metrics.snapshot()
        assert stats["storage_backup_pages"] == 128 + 64 and stats["storage_backup_failed_batches"] == 1
        keys = SCOPE.keys(page_hashes(tokens, 1))
        assert Store(backend).prefix_exists(keys) == 192
        # A second backup of the same pages skips what the store already holds (asked live).
        node = controller.tree.match_prefix(tokens).device_node
        controller.tree.evict_device(1000)
        assert node.host_value is not None
        controller._queue_storage_backup(node)
        controller.drain()
        assert backend.put_batches[2:] == [108], "only pages 192..299 are written again"
    finally:
        controller.close()


def plan(controller: CacheController, tokens: list[int]):
    match = controller.tree.match_prefix(tokens)
    return controller.prefetcher.plan("r", tokens, match)


def test_prefetch_below_threshold_is_revoked_and_frees_its_pages():
    controller = make_controller(page_size=2, threshold_tokens=4, stop_policy=StopPolicy.WAIT_COMPLETE)
    backend = RecordingBackend()
    tokens = list(range(20))
    Store(backend).put_from(SCOPE.keys(page_hashes(tokens, 2))[:1], [bytes(GEOMETRY.token_bytes * 2)])
    scope = KeyScope(Namespace("controller-test", "float32", 1, "page_first"))
    controller.attach_storage(backend, scope)
    try:
        free_before = controller.host.allocator.free_pages
        op = plan(controller, tokens)
        assert op is not None and op.pages == 10
        assert controller.prefetcher.try_issue(op)
        op.done.wait()
        assert op.state is PrefetchState.REVOKED and op.hit_pages == 1
        assert controller.prefetcher.ready(op)
        assert controller.prefetcher.finish(op) == 0
        assert controller.host.allocator.free_pages == free_before
        assert controller.metrics.snapshot()["prefetch_revoked"] == 1
    finally:
        controller.close()


def test_rate_limited_prefetch_keeps_its_hit_and_runs_later():
    controller = make_controller(page_size=2, threshold_tokens=2, capacity_pages=4, stop_policy=StopPolicy.WAIT_COMPLETE)
    backend = RecordingBackend()
    first, second = list(range(8)), list(range(100, 108))
    for tokens in (first, second):
        Store(backend).put_from(SCOPE.keys(page_hashes(tokens, 2)), [bytes(GEOMETRY.token_bytes * 2)] * 4)
    controller.attach_storage(backend, SCOPE)
    try:
        op1, op2 = plan(controller, first + [0]), plan(controller, second + [0])
        assert controller.prefetcher.try_issue(op1)
        assert not controller.prefetcher.try_issue(op2), "capacity (4 pages) is taken by the first prefetch"
        assert op2.state is PrefetchState.PLANNED and not controller.prefetcher.ready(op2)
        op1.done.wait()
        assert controller.prefetcher.finish(op1) == 8
        assert controller.prefetcher.try_issue(op2), "capacity is back: the rate-limited request is issued now"
        op2.done.wait()
        assert controller.prefetcher.ready(op2)
        assert controller.prefetcher.finish(op2) == 8, "the retried prefetch got its whole hit"
        assert controller.tree.match_prefix(second).host_hit_length == 8
        assert controller.metrics.snapshot()["prefetch_rate_limited"] == 1
    finally:
        controller.close()


def test_a_prefetch_short_of_host_pages_under_io_tries_later_instead_of_waiting():
    """A prefetch reservation runs on the scheduler thread: where its host pages are free only
    once a storage backup pinning them returns (and no cached copy can be evicted for it), the
    op is rate-limited and tried again at a later step, not waited for."""
    controller = make_controller(page_size=2, host_pages=4, threshold_tokens=2, capacity_pages=4, stop_policy=StopPolicy.WAIT_COMPLETE)
    backend = RecordingBackend()
    tokens = list(range(8))
    Store(backend).put_from(SCOPE.keys(page_hashes(tokens, 2)), [bytes(GEOMETRY.token_bytes * 2)] * 4)
    controller.attach_storage(backend, SCOPE)
    host = controller.host.allocator
    detached = host.alloc(8)
    assert detached is not None
    host.pin_io(detached)  # a deleted node's pages, its backup still writing them
    host.free(detached)
    try:
        op = plan(controller, tokens + [0])
        assert op is not None and op.pages == 4
        issued: list[bool] = []
        caller = threading.Thread(target=lambda: issued.append(controller.prefetcher.try_issue(op)), daemon=True)
        caller.start()
        caller.join(HANG_GUARD_POLLS * 0.01)  # a guard against a hang, never a timing assertion
        waited = caller.is_alive()
        host.unpin_io(detached)  # the backup returns
        caller.join(HANG_GUARD_POLLS * 0.01)
        assert not waited, "the reservation held the scheduler thread until the backup returned"
        assert issued == [False] and op.state is PrefetchState.PLANNED and op.pages == 4, "rate-limited, whole"
        assert controller.prefetcher.try_issue(op), "the pages are free now: issued at the next try"
        op.done.wait()
        assert controller.prefetcher.finish(op) == 8
        assert controller.metrics.snapshot()["prefetch_rate_limited"] == 1
    finally:
        controller.close()


def test_timeout_formula_defaults():
    config = PrefetchConfig()
    assert (config.threshold_tokens, config.timeout_base_s, config.timeout_per_ki_token_s, config.timeout_max_s) == (256, 2.0, 0.1, 30.0)
    assert config.timeout_for(2048) == pytest.approx(2.2)
    assert config.timeout_for(10**7) == 30.0


@pytest.mark.parametrize("policy", [StopPolicy.TIMEOUT, StopPolicy.WAIT_COMPLETE, StopPolicy.BEST_EFFORT])
def test_timeout_policy_stops_waiting_for_a_hung_read_and_wait_complete_does_not(policy):
    """Best effort waits too, here: it takes what arrived, but not before the first batch (all 4
    pages) is back; stopping an op before its first read returns would throw every page away."""
    controller = make_controller(page_size=2, threshold_tokens=2, stop_policy=policy, timeout_base_s=0.0,
                                 timeout_per_ki_token_s=0.0)
    backend = RecordingBackend()
    tokens = list(range(8))
    Store(backend).put_from(SCOPE.keys(page_hashes(tokens, 2)), [bytes(GEOMETRY.token_bytes * 2)] * 4)
    backend.get_gate = threading.Event()
    controller.attach_storage(backend, SCOPE)
    prefetcher = controller.prefetcher
    try:
        op = prefetcher.plan("r", tokens + [0], controller.tree.match_prefix(tokens))
        assert prefetcher.try_issue(op)
        assert backend.get_entered.wait(30)
        if policy is StopPolicy.TIMEOUT:
            assert prefetcher.ready(op), "a zero timeout has expired while the read hangs"
            assert prefetcher.finish(op) == 0
        else:
            assert not prefetcher.ready(op), f"{policy.value} keeps waiting while the first batch hangs"
            backend.get_gate.set()
            op.done.wait()
            assert prefetcher.ready(op)
            assert prefetcher.finish(op) == 8
    finally:
        backend.get_gate.set()
        controller.close()


def test_host_pages_under_a_hung_read_are_never_reused():
    controller = make_controller(page_size=2, host_pages=6, threshold_tokens=2, stop_policy=StopPolicy.TIMEOUT,
                                 timeout_base_s=0.0, timeout_per_ki_token_s=0.0)
    backend = RecordingBackend()
    tokens = list(range(8))
    Store(backend).put_from(SCOPE.keys(page_hashes(tokens, 2)), [bytes(GEOMETRY.token_bytes * 2)] * 4)
    backend.get_gate = threading.Event()
    controller.attach_storage(backend, SCOPE)
    try:
        op = plan(controller, tokens + [0])
        assert controller.prefetcher.try_issue(op)
        assert backend.get_entered.wait(30), "the prefetch thread must reach the read"
        read_pages = set(op.host_indices.tolist())
        assert controller.prefetcher.ready(op), "a zero timeout stops waiting at once"
        assert controller.prefetcher.finish(op) == 0
        allocator = controller.host.allocator
        assert allocator.idle_pages == 6 - len(read_pages) // 2
        taken = allocator.alloc(allocator.idle_pages * 2)
        assert taken is not None and not read_pages & set(taken.tolist()), "a page being read into was handed out"
        allocator.free(taken)
        backend.get_gate.set()
        op.done.wait()
        assert allocator.idle_pages == 6, "the pages come back once the read returned"
    finally:
        backend.get_gate.set()
        controller.close()


def test_a_host_allocation_evicts_rather_than_wait_for_a_backup_pinning_freed_pages():
    """Pages of a node deleted while its storage backup is queued are freed under the backup's
    pins: they count as free, and taking them means waiting for the backup (behind a slow
    write-through queue, up to a second of the scheduler thread). The controller's host
    allocations (prefetch reservations, device -> host copies) evict cached pages instead."""
    controller = make_controller(device_pages=16, host_pages=8)
    try:
        insert(controller, list(range(4)))  # write-through: a host copy in 4 of the 8 host pages
        controller.drain()
        host = controller.host.allocator
        detached = host.alloc(4)
        assert detached is not None
        host.pin_io(detached)  # its backup is still writing it
        host.free(detached)
        assert host.idle_pages == 0 and host.free_pages == 4
        got: list[torch.Tensor | None] = []
        caller = threading.Thread(target=lambda: got.append(controller.alloc_host(4)), daemon=True)
        caller.start()
        caller.join(HANG_GUARD_POLLS * 0.01)  # a guard against a hang, never a timing assertion
        waited = caller.is_alive()
        host.unpin_io(detached)  # the backup returns (and frees a waiting caller)
        caller.join(HANG_GUARD_POLLS * 0.01)
        assert not waited, "the allocation waited for the backup although a cached host copy could go"
        assert got and got[0] is not None
        assert controller.metrics.snapshot()["host_evicted_tokens"] == 4, "the cached host copy was evicted for it"
    finally:
        controller.close()


def test_the_default_storage_stack_is_zero_copy_and_bounds_a_hung_read_by_its_pages():
    """The controller's timeout is zero-copy: the store reads straight into host pages. A read
    that times out may still land in them, so they stay out of the allocator (not even counted
    as free, so nothing waits on them) until the store returns; then they come back."""
    device = DevicePool(GEOMETRY, 64, 2, device="cpu")
    host = HostPool(GEOMETRY, 2, "page_first", num_pages=8)
    tree = RadixTree(2, device.allocator.free, host.allocator.free)
    prefetch = PrefetchConfig(threshold_tokens=2, stop_policy=StopPolicy.WAIT_COMPLETE)
    config = ControllerConfig(storage_timeout_s=0.2, prefetch=prefetch, abandoned_pages_fraction=0.5)  # room for the 4-page read
    controller = CacheController(config, tree, device, host)
    backend = RecordingBackend()
    tokens = list(range(8))
    Store(backend).put_from(SCOPE.keys(page_hashes(tokens, 2)), [b"\x07" * (GEOMETRY.token_bytes * 2)] * 4)
    backend.get_gate = threading.Event()
    controller.attach_storage(backend, SCOPE)
    try:
        op = plan(controller, tokens + [0])
        assert controller.prefetcher.try_issue(op)
        assert op.done.wait(30), "the read timed out"
        assert controller.metrics.snapshot()["storage_timeouts"] == 1
        assert controller.prefetcher.finish(op) == 0
        allocator = controller.host.allocator
        assert allocator.free_pages == 4, "the 4 pages the hung read may still write are not free"
        assert allocator.alloc(5 * 2) is None, "and no allocation waits for them"
        backend.get_gate.set()
        deadline = threading.Event()
        for _ in range(3000):
            if allocator.free_pages == 8:
                break
            deadline.wait(0.01)
        assert allocator.free_pages == 8, "the pages come back once the store returned"
        late = b"".join(segment.numpy().tobytes() for page in host.segments_for(op.host_indices) for segment in page)
        assert late == b"\x07" * len(late), "the late read landed in the host pages themselves: no staging copy"
    finally:
        backend.get_gate.set()
        controller.close()


def test_layer_wise_load_releases_each_layer_on_its_own():
    controller = make_controller()
    transfers = controller.transfers
    gate = threading.Event()
    original = transfers._load_layer

    def slow_second_layer(layer, device_indices, host_indices):
        if layer == 1:
            gate.wait()
        original(layer, device_indices, host_indices)

    transfers._load_layer = slow_second_layer
    try:
        device_slots = controller.device.allocator.alloc(4)
        host_slots = controller.host.allocator.alloc(4)
        controller.host.kv.fill_(3.0)
        load = transfers.load(device_slots, host_slots, lambda _: None)
        load.wait(0)  # returns while layer 1 is still blocked
        assert not load._events[1].is_set()
        assert bool((controller.device.kv[:, 0, device_slots] == 3.0).all())
        gate.set()
        load.wait_all()
        assert bool((controller.device.kv[:, 1, device_slots] == 3.0).all())
    finally:
        gate.set()
        controller.close()


class CountedWakeup(Wakeup):
    """A wakeup that says which work notified it."""

    def __init__(self) -> None:
        super().__init__()
        self.notices = threading.Semaphore(0)

    def notify(self) -> None:
        self.notices.release()
        super().notify()

    def expect(self, what: str) -> None:
        assert self.notices.acquire(timeout=HANG_GUARD_POLLS * 0.01), f"{what} never woke the scheduler"


def test_every_background_thread_wakes_the_scheduler_when_its_work_ends():
    """The scheduler waits between steps on the controller's wakeup instead of polling: a copy,
    a load, a prefetch's lookup and read, and a storage backup each notify it once done, and the
    state they report is there for the scheduler's next poll."""
    wakeup = CountedWakeup()
    device = DevicePool(GEOMETRY, 64, 2, device="cpu")
    host = HostPool(GEOMETRY, 2, "page_first", num_pages=64)
    tree = RadixTree(2, device.allocator.free, host.allocator.free)
    config = ControllerConfig(storage_timeout_s=None, prefetch=PrefetchConfig(threshold_tokens=2, stop_policy=StopPolicy.WAIT_COMPLETE))
    controller = CacheController(config, tree, device, host, wakeup=wakeup)
    assert controller.wakeup is wakeup
    backend = RecordingBackend()
    controller.attach_storage(backend, SCOPE)
    try:
        tokens = list(range(8))
        insert(controller, tokens)  # write-through: a device -> host copy, then a storage backup
        wakeup.expect("the device -> host copy")
        controller.poll()  # as the woken scheduler does: the copy is applied, its storage backup queued
        wakeup.expect("the storage backup")
        controller.drain()
        assert controller.metrics.snapshot()["storage_backup_pages"] == 4

        loaded = threading.Event()
        transfers = controller.transfers
        assert transfers is not None
        transfers.load(device.allocator.alloc(2), host.allocator.alloc(2), lambda load: loaded.set())
        wakeup.expect("the load")
        assert loaded.is_set(), "the load had ended when it notified"

        longer = tokens + list(range(100, 104))
        Store(backend).put_from(SCOPE.keys(page_hashes(longer, 2))[4:], [bytes(GEOMETRY.token_bytes * 2)] * 2)
        tree.evict_device(1 << 30)
        tree.evict_host(1 << 30)
        op = plan(controller, longer)
        assert op is not None and controller.prefetcher.try_issue(op)
        # three notices, from two threads in either order: the lookup, the read's one batch, the read's end
        for what in ("the prefetch's lookup", "the batch read", "the prefetch's read"):
            wakeup.expect(what)
        assert op.done.is_set() and op.completed_pages == 6
    finally:
        controller.close()


# --- engines on misbehaving stores ---------------------------------------------------------------

MODEL = ModelConfig(vocab_size=256, hidden=32, layers=2, q_heads=4, kv_heads=2, head_dim=8, ffn=64, seed=3)
CONVERSATIONS = make_conversations(clients=2, rounds=2, turn_tokens=20, vocab_size=256, seed=9)


def engine_config(tiers: CacheTiers, timeout_s: float | None = 5.0) -> EngineConfig:
    # The tests count the tokens L3 served and the calls that reach the store: every page is
    # written, asked for and read, whatever the speeds.
    controller = ControllerConfig(
        storage_timeout_s=timeout_s, prefetch=PrefetchConfig(threshold_tokens=8, stop_policy=StopPolicy.WAIT_COMPLETE),
        cost=LOAD_AND_STORE_EVERY_PAGE,
    )
    return EngineConfig(model=MODEL, tiers=tiers, page_size=4, device_pages=20, host_pages=12, host_ratio=None,
                        controller=controller, max_running=2)


@pytest.fixture(scope="module")
def expected():
    with Engine(engine_config(CacheTiers.OFF)) as engine:
        return serve_conversations(engine, CONVERSATIONS, 3)


def check_same(expected_rounds, rounds):
    for want_round, have_round in zip(expected_rounds, rounds):
        for want, have in zip(want_round, have_round):
            assert have.output_ids == want.output_ids
            assert torch.equal(have.logits.view(torch.int32), want.logits.view(torch.int32))


class FailingBackend(MemoryBackend):
    """Answers every call, and every answer is 'no': nothing exists, nothing is read or stored."""

    def _exists(self, keys):
        return [False] * len(keys)

    def _get_into(self, keys, targets):
        return [False] * len(keys)

    def _put_from(self, keys, sources):
        return [False] * len(keys)


ALL_CALLS = ("exists", "get", "put", "register_buffer")


@pytest.mark.parametrize("fault", ["raises", "fails", "hangs"])
def test_engine_on_a_broken_store_recomputes_and_stays_alive(expected, fault):
    if fault == "raises":
        backend = FaultInjectionLayer(MemoryBackend(), {op: {"error_rate": 1.0, "errors": ["unavailable", "runtime"]} for op in ALL_CALLS})
    elif fault == "fails":
        backend = FailingBackend()
    else:
        backend = FaultInjectionLayer(MemoryBackend(), {op: {"hang_rate": 1.0} for op in ALL_CALLS})
    engine = Engine(engine_config(CacheTiers.L1_L2_L3, timeout_s=0.2), storage=backend)
    try:
        rounds = serve_conversations(engine, CONVERSATIONS, 3)
        check_same(expected, rounds)
        engine.flush_cache()  # drains every backup: each must have ended, failed or timed out
        assert engine.controller.threads_alive, "backup and prefetch threads survive the store's failures"
        assert engine.metrics.snapshot()["storage_hit_tokens"] == 0
        failures = engine.metrics.snapshot()
        if fault == "raises":
            assert failures["storage_errors"] > 0
        elif fault == "hangs":
            assert failures["storage_timeouts"] > 0
        else:
            assert failures["storage_backup_failed_batches"] > 0
        # Still responsive after the failures: the next round is served and correct.
        check_same(expected[:1], [engine.serve([r for r in _first_round()])])
    finally:
        if isinstance(backend, FaultInjectionLayer):
            backend.release_hangs()
        engine.close()


def _first_round():
    from hicache_core.engine import Request

    return [Request(f"x{c}", list(turns[0]), 3) for c, turns in enumerate(CONVERSATIONS)]


def test_attach_and_detach_storage_at_runtime(expected):
    store = MemoryBackend({"store": f"attach-{uuid.uuid4().hex}"})
    with Engine(engine_config(CacheTiers.L1_L2)) as engine:
        engine.attach_storage(store)
        assert engine.controller.threads_alive
        check_same(expected, serve_conversations(engine, CONVERSATIONS, 3))
        detached = engine.detach_storage()
        assert detached is not None and not engine.controller.threads_alive
        assert not engine.controller.io_pending, "detach drains in-flight backups"
        assert detached.stats()["put_stored"] > 0
        assert engine.detach_storage() is None
        check_same(expected, serve_conversations(engine, CONVERSATIONS, 3))
        engine.attach_storage(MemoryBackend({"store": store.config.store}))
        engine.flush_cache()
        results = engine.serve(_first_round())
        check_same(expected[:1], [results])
        assert sum(r.cached_storage for r in results) > 0, "re-attached storage serves the pages written before"


def test_streaming_driver_and_clear_errors(expected):
    from hicache_core.engine import EngineCapacityError, Request

    with Engine(engine_config(CacheTiers.L1_L2)) as engine:
        for request in _first_round():
            engine.submit(request)
        finished = []
        while engine.has_work():
            engine.step()
            finished.extend(engine.take_results())
        by_id = {r.rid: r for r in finished}
        check_same(expected[:1], [[by_id[f"x{c}"] for c in range(len(CONVERSATIONS))]])
        assert all(r.ttft_s > 0 and r.latency_s >= r.ttft_s for r in finished)
    with Engine(engine_config(CacheTiers.L1)) as engine:
        with pytest.raises(EngineCapacityError, match="raise device_pages"):
            engine.serve([Request("huge", list(range(200)), 3)])
    cfg = engine_config(CacheTiers.L1_L2)
    cfg.controller = ControllerConfig(buffer_only=True)
    with pytest.raises(ValueError, match="buffer-only mode .* needs tiers L1\\+L2\\+L3"):
        Engine(cfg)


# --- errors that say what to do: temporary ones are lived through, permanent ones stop the calls --


class MiscountingBackend(MemoryBackend):
    """A real in-memory store whose every answer has one result too many (a connector bug the SDK
    rejects as a contract violation); counts the calls that reach it, from any thread."""

    def __init__(self) -> None:
        super().__init__({"store": f"miscount-{uuid.uuid4().hex}"})
        self._lock = threading.Lock()
        self.calls = 0

    def _called(self) -> None:
        with self._lock:
            self.calls += 1

    def _exists(self, keys):
        self._called()
        return super()._exists(keys) + [False]

    def _get_into(self, keys, targets):
        self._called()
        return super()._get_into(keys, targets) + [False]

    def _put_from(self, keys, sources):
        self._called()
        return super()._put_from(keys, sources) + [False]


def error_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_contract_violation_stops_the_calls_once_said_and_counted(expected, caplog):
    backend = MiscountingBackend()
    engine = Engine(engine_config(CacheTiers.L1_L2_L3), storage=backend)
    try:
        with caplog.at_level(logging.WARNING):
            check_same(expected, serve_conversations(engine, CONVERSATIONS, 3))
            engine.flush_cache()
            calls = backend.calls
            # The backup and the prefetch thread may each be inside a call when the first fails.
            assert 1 <= calls <= 2, f"{calls} calls reached a store that broke the contract"
            check_same(expected, serve_conversations(engine, CONVERSATIONS, 3))
            engine.flush_cache()
        assert backend.calls == calls, "a store given up was called again"
        counters = engine.metrics.snapshot()
        assert counters["storage_disabled"] == 1 and counters["storage_permanent_errors"] == calls
        assert counters["storage_hit_tokens"] == 0
        assert engine.controller.threads_alive
        [line] = error_lines(caplog)
        message = line.getMessage()
        assert "storage memory disabled" in message and "BackendContractError" in message
        assert "detach" in message and "attach" in message, "the line says how to get the store back"
        # Detaching and attaching again (here: the cause fixed, a correct connector) resets it.
        engine.detach_storage()
        engine.attach_storage(MemoryBackend({"store": backend.config.store}))
        check_same(expected, serve_conversations(engine, CONVERSATIONS, 3))
        engine.flush_cache()
        results = engine.serve(_first_round())
        check_same(expected[:1], [results])
        assert sum(r.cached_storage for r in results) > 0, "the re-attached store serves hits again"
        assert not engine.controller.storage_health.failed
        assert engine.metrics.snapshot()["storage_disabled"] == 1
    finally:
        engine.close()


def test_temporary_errors_open_the_breaker_probes_keep_calling_and_hits_resume(expected):
    """Temporary errors never give the store up: they open its breaker (no data calls, counted),
    probes keep asking the store, and once it answers L3 hits come back in the same process."""
    store = MemoryBackend({"store": f"flaky-{uuid.uuid4().hex}"})
    faults = FaultInjectionLayer(
        store, {"enabled": False, **{op: {"error_rate": 1.0, "errors": ["unavailable"]} for op in ("exists", "get", "put")}}
    )
    config = engine_config(CacheTiers.L1_L2_L3)
    config.controller = dataclasses.replace(config.controller, breaker=BreakerConfig(probe_backoff_s=0.01, probe_backoff_max_s=0.02))
    engine = Engine(config, storage=faults)
    try:
        faults.resume()
        check_same(expected, serve_conversations(engine, CONVERSATIONS, 3))
        engine.flush_cache()
        counters = engine.metrics.snapshot()
        assert counters["storage_breaker_opened"] == 1 and counters["storage_skipped_calls"] > 0
        raised = faults.event_counts()["faults_error"]
        time.sleep(0.05)  # past the probe backoff: the next call asked for starts a probe
        check_same(expected, serve_conversations(engine, CONVERSATIONS, 3))
        for _ in range(HANG_GUARD_POLLS):  # the probe runs on its own thread
            if faults.event_counts()["faults_error"] > raised:
                break
            time.sleep(0.01)
        assert faults.event_counts()["faults_error"] > raised, "a store failing temporarily must still be probed"
        faults.pause()  # the store is back
        hits = 0
        for _ in range(20):
            engine.flush_cache()
            results = engine.serve(_first_round())
            check_same(expected[:1], [results])
            hits = sum(r.cached_storage for r in results)
            if hits:
                break
            time.sleep(0.02)  # the next probe is due after its backoff
        assert hits > 0, "hits resume once the store recovers"
        counters = engine.metrics.snapshot()
        assert counters["storage_breaker_closed"] >= 1
        assert counters["storage_disabled"] == 0 and counters["storage_permanent_errors"] == 0
        assert counters["storage_errors"] >= BreakerConfig().failures_to_open
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("error", "gives_up"),
    [
        (BackendUnavailableError("down"), False),
        (CapacityError("full"), False),
        (StorageError("EIO", status=ErrorStatus.TEMPORARY), False),
        (BackendUnavailableError("down", status=ErrorStatus.PERSISTENT), True),
        (StorageTimeoutError("slow", status=ErrorStatus.PERSISTENT), True),
        (AuthenticationError("bad secret"), True),
        (BackendContractError("two results for one key"), True),
        (StorageError("refused", status=ErrorStatus.PERMANENT), True),
        (RuntimeError("a connector bug of no known kind"), False),
    ],
)
def test_guarded_call_gives_a_store_up_on_permanent_and_persistent_errors_only(error, gives_up):
    metrics = CacheMetrics()
    health = StorageHealth(metrics, "memory")
    calls = []

    def call():
        calls.append(1)
        raise error

    assert guarded_call(metrics, call, "miss", "get", health=health) == "miss"
    assert health.failed is gives_up
    guarded_call(metrics, call, "miss", "get", health=health)
    assert len(calls) == (1 if gives_up else 2)
    assert metrics.snapshot()["storage_disabled"] == int(gives_up)
