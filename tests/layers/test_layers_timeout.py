"""The timeout layer: callers get control back from a hung store, and late calls touch no caller memory.

Hangs are injected with the fault layer and released through its event, so no test depends on
how long anything takes: a hung call stays hung until the test releases it.
"""

import itertools
import logging
import threading
import time

import pytest

from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.errors import (
    AuthenticationError,
    BackendClosedError,
    BackendUnavailableError,
    RetryableError,
    StorageTimeoutError,
)
from hicache_storage.keys import KeyScope, Namespace, PageKey
from hicache_storage.layers import FaultInjectionLayer, RetryLayer, TimeoutLayer
from hicache_storage.store import Store

SCOPE = KeyScope(Namespace(model="timeout-tests", kv_dtype="bfloat16", page_size=16))
SHORT = 0.2  # seconds a caller waits; every hang below lasts until the test releases it


def keys(n: int) -> list[PageKey]:
    return SCOPE.keys([f"{i:016x}" for i in range(n)])


class SpyMemory(MemoryBackend):
    """Memory connector remembering the buffers its hooks were given and what they returned."""

    def __init__(self, config=None):
        super().__init__(config)
        self.read_targets = []
        self.read_results = []

    def _get_into(self, keys, targets):
        results = super()._get_into(keys, targets)
        self.read_targets.extend(targets)
        self.read_results.extend(results)
        return results


class Gated(MemoryBackend):
    """Memory connector whose first ``len(gates)`` reads each hang until the test opens their gate."""

    def __init__(self, count: int):
        super().__init__()
        self.gates = [threading.Event() for _ in range(count)]
        self._calls = itertools.count()

    def open(self, call: int) -> None:
        self.gates[call].set()

    def _get_into(self, keys, targets):
        call = next(self._calls)
        if call < len(self.gates):
            self.gates[call].wait(60)
        return super()._get_into(keys, targets)


def hanging(operation: str, inner=None, workers: int = 2):
    """A store over timeout(faults(memory)) where every ``operation`` call hangs until released,
    with its timeout and faults layers."""
    faults = FaultInjectionLayer(inner or MemoryBackend(), {operation: {"hang_rate": 1.0}})
    timeout = TimeoutLayer(faults, {"seconds": SHORT, "workers": workers})
    return Store(timeout), timeout, faults


def our_threads(layer: TimeoutLayer) -> list[threading.Thread]:
    """The live worker threads of this very layer (an earlier test's layer may have the same name)."""
    named = [t for t in threading.enumerate() if t.name.startswith(f"hicache-{layer.name}-")]
    return [t for t in named if getattr(getattr(t, "_target", None), "__self__", None) is layer]


def test_a_hung_read_times_out_and_its_late_completion_never_writes_the_callers_buffer():
    spy = SpyMemory()
    store, timeout, faults = hanging("get", spy)
    page = bytes(range(256)) * 4
    assert store.put(keys(1), [page]) == [True]
    target = bytearray(len(page))

    with pytest.raises(StorageTimeoutError) as caught:
        store.get_into(keys(1), [target])
    assert isinstance(caught.value, RetryableError)
    assert caught.value.backend == "timeout(faults(memory))" and caught.value.operation == "get"

    # Let the hung read finish now that its caller has been told it failed.
    faults.release_hangs()
    assert timeout.wait_idle(30)
    assert store.stats()["timeout_late_completions"] == 1
    # The store really did deliver the page, late, but into a staging buffer, not the caller's.
    assert spy.read_results == [True]
    assert bytes(spy.read_targets[0][0]) == page
    assert spy.read_targets[0][0].obj is not target
    assert target == bytearray(len(page)), "a late read wrote into memory the caller was told had failed"
    store.close()


def test_a_hung_write_stores_the_bytes_passed_never_what_the_caller_wrote_afterwards():
    memory = MemoryBackend()
    store, timeout, faults = hanging("put", memory)
    source = bytearray(b"original" * 128)
    with pytest.raises(StorageTimeoutError):
        store.put_from(keys(1), [source])
    source[:] = b"REUSED!!" * 128  # the caller reuses its buffer once the call has returned
    faults.release_hangs()
    assert timeout.wait_idle(30)
    assert store.stats()["timeout_late_completions"] == 1
    assert Store(memory).get(keys(1), len(source)) == [b"original" * 128]
    store.close()


def test_a_staging_buffer_is_reused_only_after_its_late_call_has_returned():
    class HangsWhenAsked(MemoryBackend):
        hang_next = False
        release = threading.Event()

        def _get_into(self, keys, targets):
            if self.hang_next:
                self.hang_next = False
                self.release.wait(60)
            return super()._get_into(keys, targets)

    inner = HangsWhenAsked()
    timeout = TimeoutLayer(inner, {"seconds": SHORT, "workers": 2})
    store = Store(timeout)
    pool = timeout._staging
    store.put(keys(2), [b"1" * 512, b"2" * 512])
    assert store.get(keys(1), 512) == [b"1" * 512]
    (first_buffer,) = pool._free

    inner.hang_next = True
    with pytest.raises(StorageTimeoutError):
        store.get(keys(1), 512)
    # The hung call still owns its buffer: it is not free for anyone else.
    assert pool._free == []
    assert store.get(keys(2)[1:], 512) == [b"2" * 512]  # served from a new buffer meanwhile
    assert all(b is not first_buffer for b in pool._free)

    inner.release.set()
    assert timeout.wait_idle(30)
    assert any(b is first_buffer for b in pool._free) and len(pool._free) == 2
    assert store.get(keys(2), 512) == [b"1" * 512, b"2" * 512]
    store.close()


def test_beyond_max_abandoned_a_call_that_finds_no_free_worker_fails_at_once():
    faults = FaultInjectionLayer(MemoryBackend(), {"get": {"hang_rate": 1.0}})
    # Nothing may be set aside: the timed-out call keeps the one worker.
    timeout = TimeoutLayer(faults, {"seconds": SHORT, "workers": 1, "max_abandoned": 0})
    store = Store(timeout)
    store.put(keys(1), [b"p" * 64])
    errors = []
    caller = threading.Thread(target=lambda: errors.append(_raised(store.get, keys(1), 64)))
    caller.start()
    assert faults.wait_for_hangs(1, timeout=30)
    caller.join(30)
    assert not caller.is_alive() and isinstance(errors[0], StorageTimeoutError)

    # The one worker is still stuck in the store: an exists cannot get a worker, and does not wait for one.
    with pytest.raises(StorageTimeoutError, match=r"appears hung: 1 calls have not returned .*\(0 set aside"):
        store.exists(keys(1))
    assert store.stats()["timeout_busy"] == 1
    assert timeout.in_flight == 1

    faults.release_hangs()
    assert timeout.wait_idle(30)
    assert store.exists(keys(1)) == [True]
    store.close()


def test_hung_calls_are_set_aside_and_later_calls_succeed_without_waiting_for_them():
    """More calls than workers hang for good; once the store answers again, so does the layer."""
    workers = 2
    faults = FaultInjectionLayer(MemoryBackend(), {"get": {"hang_rate": 1.0}})
    timeout = TimeoutLayer(faults, {"seconds": SHORT, "workers": workers, "max_abandoned": 4})
    store = Store(timeout)
    pages = {key: bytes([i + 1]) * 256 for i, key in enumerate(keys(4))}
    assert store.put(list(pages), list(pages.values())) == [True] * 4

    hung = workers + 1
    for _ in range(hung):  # one after the other: each gets a worker, hangs, times out
        with pytest.raises(StorageTimeoutError, match="did not answer"):
            store.get(keys(1), 256)
    assert faults.wait_for_hangs(hung, timeout=30)
    assert timeout.in_flight == hung  # the hung inner calls have not returned: they are still in flight

    faults.pause()  # the store answers again; the hung calls stay hung
    for _ in range(3):
        assert store.get(list(pages), 256) == list(pages.values())
        assert store.exists(keys(5)) == [True] * 4 + [False]
    assert store.put(keys(6)[5:], [b"new" * 10]) == [True]
    assert faults.hanging == hung, "the later calls must not have waited for the hung ones"
    stats = store.stats()
    assert stats["timeouts"] == hung and stats["timeout_busy"] == 0
    assert stats["timeout_late_completions"] == 0
    assert len(our_threads(timeout)) == workers + hung  # each set-aside call keeps its thread, replaced

    faults.release_hangs()
    assert timeout.wait_idle(30)
    assert timeout.in_flight == 0
    assert store.stats()["timeout_late_completions"] == hung
    assert store.get(keys(1), 256) == [pages[keys(1)[0]]]
    threads = our_threads(timeout)
    store.close()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()


def test_threads_stay_within_workers_plus_max_abandoned_and_calls_beyond_fail_at_once():
    workers, max_abandoned = 2, 3
    faults = FaultInjectionLayer(MemoryBackend(), {"get": {"hang_rate": 1.0}})
    timeout = TimeoutLayer(faults, {"seconds": SHORT, "workers": workers, "max_abandoned": max_abandoned})
    store = Store(timeout)
    store.put(keys(1), [b"b" * 64])
    stuck = workers + max_abandoned
    for _ in range(stuck):  # 3 set aside, then 2 that keep their workers: the bound is reached
        with pytest.raises(StorageTimeoutError, match="did not answer"):
            store.get(keys(1), 64)
    assert faults.wait_for_hangs(stuck, timeout=30)
    assert len(our_threads(timeout)) == workers + max_abandoned

    faults.pause()  # even a store that answers again gets no call: no worker is free
    for operation in (lambda: store.get(keys(1), 64), lambda: store.exists(keys(1))):
        for _ in range(5):
            with pytest.raises(StorageTimeoutError, match=rf"appears hung: {stuck} calls .*\(3 set aside, .* 2 holding"):
                operation()
    assert store.stats()["timeout_busy"] == 10
    assert len(our_threads(timeout)) == workers + max_abandoned
    assert faults.hanging == stuck and timeout.in_flight == stuck

    faults.release_hangs()
    assert timeout.wait_idle(30)
    assert store.get(keys(1), 64) == [b"b" * 64]
    threads = our_threads(timeout)
    assert len(threads) <= workers + max_abandoned
    store.close()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()


def test_when_a_set_aside_call_returns_an_overdue_one_takes_its_place_and_frees_a_worker():
    gates = Gated(2)  # the first two reads hang, each until its own gate opens
    timeout = TimeoutLayer(gates, {"seconds": SHORT, "workers": 1, "max_abandoned": 1, "zero_copy": True})
    store = Store(timeout)
    store.put(keys(1), [b"g" * 32])
    with pytest.raises(StorageTimeoutError) as first:
        store.get(keys(1), 32)  # set aside
    with pytest.raises(StorageTimeoutError):
        store.get(keys(1), 32)  # the bound is reached: keeps the only worker
    with pytest.raises(StorageTimeoutError, match="appears hung"):
        store.exists(keys(1))

    gates.open(0)
    assert first.value.settled.wait(30)  # set after the worker's bookkeeping: the second is now set aside
    assert store.exists(keys(1)) == [True]
    assert store.get(keys(1), 32) == [b"g" * 32]
    assert timeout.in_flight == 1 and len(our_threads(timeout)) <= 2
    gates.open(1)
    assert timeout.wait_idle(30)
    store.close()


def test_threads_stay_bounded_however_many_callers_hit_a_hung_store():
    faults = FaultInjectionLayer(MemoryBackend(), {"exists": {"hang_rate": 1.0}})
    timeout = TimeoutLayer(faults, {"seconds": SHORT, "workers": 3, "max_abandoned": 2})
    store = Store(timeout)
    results = []
    callers = [threading.Thread(target=lambda: results.append(_raised(store.exists, keys(1)))) for _ in range(20)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(60)
    assert all(isinstance(r, StorageTimeoutError) for r in results) and len(results) == 20
    assert len(our_threads(timeout)) <= 5
    assert faults.hanging <= 5
    faults.release_hangs()
    assert timeout.wait_idle(30)
    store.close()


def test_a_timed_out_try_is_retried_and_the_retry_succeeds():
    class HangsOnce(MemoryBackend):
        release = threading.Event()
        tries = 0

        def _get_into(self, keys, targets):
            HangsOnce.tries += 1
            if HangsOnce.tries == 1:
                HangsOnce.release.wait(60)
            return super()._get_into(keys, targets)

    inner = HangsOnce()
    store = Store(RetryLayer(TimeoutLayer(inner, {"seconds": SHORT, "workers": 2}), {"base_seconds": 0.001, "seed": 1}))
    store.put(keys(1), [b"v" * 100])
    assert store.get(keys(1), 100) == [b"v" * 100]
    stats = store.stats()
    assert stats["timeouts"] == 1 and stats["retries"] == 1
    HangsOnce.release.set()
    store.close()


@pytest.mark.parametrize("error", [BackendUnavailableError("down"), AuthenticationError("bad password"), RuntimeError("bug")])
def test_inner_errors_reach_the_caller_unchanged(error):
    class Failing(MemoryBackend):
        def _exists(self, keys):
            raise error

    store = Store(TimeoutLayer(Failing(), {"seconds": 30}))
    with pytest.raises(type(error)) as caught:
        store.exists(keys(1))
    assert caught.value is error
    store.close()


def test_reads_fill_every_segment_of_a_hit_and_leave_misses_alone():
    store = Store(TimeoutLayer(MemoryBackend(), {"seconds": 30}))
    page = bytes(range(64))
    store.put(keys(1), [page])
    head, tail = bytearray(10), bytearray(54)
    untouched = bytearray(b"\xee" * 64)
    assert store.get_into(keys(2), [[head, tail], untouched]) == [True, False]
    assert bytes(head + tail) == page
    assert untouched == bytearray(b"\xee" * 64)
    assert not store.capabilities.zero_copy_read and not store.capabilities.zero_copy_write
    store.close()


def test_close_does_not_wait_for_a_hung_call_and_workers_exit(caplog):
    store, timeout, faults = hanging("get", workers=2)
    store.put(keys(1), [b"c" * 8])
    with pytest.raises(StorageTimeoutError):
        store.get(keys(1), 8)
    assert timeout.in_flight == 1
    threads = our_threads(timeout)
    with caplog.at_level(logging.WARNING):
        store.close()  # returns although the call still hangs
    assert "closed when the last returns" in caplog.text
    assert not faults.closed, "the level below was closed under a call still running in it"
    with pytest.raises(BackendClosedError):
        store.exists(keys(1))
    faults.release_hangs()
    assert timeout.wait_idle(30)
    deadline = time.monotonic() + 30
    while not faults.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert faults.closed, "the inner close left to the last call never ran"
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()


class BlockingExists(MemoryBackend):
    """exists() blocks until ``release`` is set; records how many calls ran when it was closed."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.lock = threading.Condition()
        self.running = 0
        self.running_at_close: list[int] = []

    def _exists(self, keys):
        with self.lock:
            self.running += 1
            self.lock.notify_all()
        self.release.wait(60)
        with self.lock:
            self.running -= 1
        return super()._exists(keys)

    def _close(self):
        with self.lock:
            self.running_at_close.append(self.running)


@pytest.mark.parametrize("returns", ["within_the_close_wait", "after_close_returned"])
def test_the_level_below_is_never_closed_under_a_running_call(returns):
    """A client library may free what a running call still uses (Mooncake's segfaults), so the
    level below is closed only once no call runs in it: at once when they return within the
    wait, else by the call that returns last."""
    inner = BlockingExists()
    timeout = TimeoutLayer(inner, {"seconds": 5.0 if returns == "within_the_close_wait" else SHORT, "workers": 2})
    store = Store(timeout)
    callers = [threading.Thread(target=_raised, args=(store.exists, keys(1))) for _ in range(2)]
    for caller in callers:
        caller.start()
    with inner.lock:
        assert inner.lock.wait_for(lambda: inner.running == 2, 30)
    closer = threading.Thread(target=store.close)
    closer.start()
    if returns == "within_the_close_wait":
        deadline = time.monotonic() + 30
        while not timeout._closing and time.monotonic() < deadline:
            time.sleep(0.001)
        inner.release.set()
        closer.join(30)
        assert inner.closed, "close() returned before closing the level below"
    else:
        closer.join(30)
        assert not inner.closed, "the level below was closed under a call still running in it"
        inner.release.set()
        assert timeout.wait_idle(30)
        deadline = time.monotonic() + 30
        while not inner.closed and time.monotonic() < deadline:
            time.sleep(0.01)
    for caller in callers:
        caller.join(30)
    assert inner.running_at_close == [0]


def test_close_returns_when_the_inner_close_hangs(caplog):
    release = threading.Event()

    class StuckClose(MemoryBackend):
        def _close(self):
            release.wait(60)

    store = TimeoutLayer(StuckClose(), {"seconds": SHORT})
    with caplog.at_level(logging.WARNING):
        store.close()
    assert store.closed
    assert "did not finish in time" in caplog.text
    release.set()
    assert store.wait_idle(30)


def _raised(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # the test inspects it
        return exc
    return None


def test_staging_memory_kept_for_reuse_is_bounded():
    timeout = TimeoutLayer(MemoryBackend(), {"seconds": 30, "staging_cache_bytes": 1000})
    store = Store(timeout)
    store.put(keys(2), [b"a" * 600, b"b" * 600])
    assert store.get(keys(1), 600) == [b"a" * 600]
    assert store.get(keys(2), 600) == [b"a" * 600, b"b" * 600]
    assert sum(len(b) for b in timeout._staging._free) <= 1000
    store.close()


def test_a_staging_buffer_is_never_lent_twice_at_once():
    from hicache_storage.layers.timeout import _StagingPool

    pool = _StagingPool(10_000)
    pages = [[memoryview(bytearray(100))]]
    first, second = pool.lend(pages), pool.lend(pages)
    for staging in (first, second):  # both references of each: caller and job
        staging.release()
        staging.release()
    # Two free buffers with equal bytes: lending both must hand out both, not one of them twice.
    a, b = pool.lend(pages), pool.lend(pages)
    assert a._buffer is not b._buffer
    assert pool._free == []


def test_under_random_hangs_no_caller_buffer_is_ever_written_after_its_call_returned():
    """Many threads, random short hangs: a hit holds the page; a timed-out target keeps its sentinel.

    Whether a given call times out depends on timing; what is asserted never does.
    """
    faults = FaultInjectionLayer(MemoryBackend(), {"seed": 5, "get": {"hang_rate": 0.3, "hang_seconds": 0.03}})
    timeout = TimeoutLayer(faults, {"seconds": 0.005, "workers": 3, "max_abandoned": 3})
    store = Store(timeout)
    pages = {key: bytes([i + 1]) * 2048 for i, key in enumerate(keys(8))}
    for key, value in pages.items():
        Store(faults.inner).put([key], [value])
    set_aside = []  # (target, sentinel) of calls that failed; checked once every late call is done
    wrong = []

    def reader(worker: int) -> None:
        for n in range(25):
            key = keys(8)[(worker + n) % 8]
            sentinel = bytes([200 + worker]) * 2048
            target = bytearray(sentinel)
            try:
                hit = store.get_into([key], [target])
            except StorageTimeoutError:
                set_aside.append((target, sentinel))
                continue
            if hit != [True] or bytes(target) != pages[key]:
                wrong.append((key, hit))

    readers = [threading.Thread(target=reader, args=(w,)) for w in range(4)]
    for thread in readers:
        thread.start()
    for thread in readers:
        thread.join(120)
    assert timeout.wait_idle(30)
    assert not wrong
    assert set_aside, "no call timed out: the test proved nothing"
    assert all(bytes(target) == sentinel for target, sentinel in set_aside)
    assert len(our_threads(timeout)) <= 6
    store.close()


# --- zero-copy mode: the inner backend gets the caller's buffers, the caller waits for 'settled' ---


class ZeroCopySpy(SpyMemory):
    """A memory connector declaring zero-copy I/O and registration, remembering every buffer it was given."""

    capabilities = MemoryBackend.capabilities.replace(zero_copy_read=True, zero_copy_write=True, buffer_registration=True)

    def __init__(self, config=None):
        super().__init__(config)
        self.write_sources = []
        self.registered = []

    def _put_from(self, keys, sources):
        self.write_sources.extend(sources)
        return super()._put_from(keys, sources)

    def _register_buffer(self, view):
        self.registered.append(view)


def test_zero_copy_reads_and_writes_hand_the_callers_own_buffers_to_the_store():
    spy = ZeroCopySpy()
    timeout = TimeoutLayer(spy, {"seconds": 30, "zero_copy": True})
    store = Store(timeout)
    source = bytearray(b"zero-copy page!!" * 64)
    head, tail = bytearray(400), bytearray(624)
    assert store.put_from(keys(1), [source]) == [True]
    assert store.get_into(keys(1), [[head, tail]]) == [True]
    assert bytes(head + tail) == source
    (written,) = spy.write_sources
    assert written[0].obj is source  # the caller's own buffer object, not a staged copy
    (read,) = spy.read_targets
    assert [view.obj for view in read] == [head, tail]
    assert timeout._staging._free == []  # no staging buffer was ever made
    store.close()


def test_zero_copy_keeps_the_inner_capabilities_and_forwards_register_buffer():
    spy = ZeroCopySpy()
    store = Store(TimeoutLayer(spy, {"zero_copy": True}))
    assert store.capabilities == spy.capabilities.replace(bounded_calls=True)  # and it bounds every call
    pool = bytearray(4096)
    store.register_buffer(pool)
    assert [view.obj for view in spy.registered] == [pool]
    store.close()

    hung = FaultInjectionLayer(ZeroCopySpy(), {"register_buffer": {"hang_rate": 1.0}})
    bounded_timeout = TimeoutLayer(hung, {"seconds": SHORT, "zero_copy": True})
    bounded = Store(bounded_timeout)
    with pytest.raises(StorageTimeoutError):  # a hung registration cannot block the caller either
        bounded.register_buffer(pool)
    hung.release_hangs()
    assert bounded_timeout.wait_idle(30)
    assert [view.obj for view in hung.inner.registered] == [pool]  # it went on and finished
    bounded.close()

    staged_spy = ZeroCopySpy()
    staged = Store(TimeoutLayer(staged_spy))  # the default mode: the inner sees no caller memory
    caps = staged.capabilities
    assert not (caps.zero_copy_read or caps.zero_copy_write or caps.buffer_registration)
    staged.register_buffer(pool)
    assert staged_spy.registered == []
    staged.close()


def test_a_hung_zero_copy_read_settles_only_once_its_late_write_has_landed_in_the_callers_buffer():
    spy = ZeroCopySpy()
    faults = FaultInjectionLayer(spy, {"get": {"hang_rate": 1.0}})
    timeout = TimeoutLayer(faults, {"seconds": SHORT, "workers": 2, "zero_copy": True})
    store = Store(timeout)
    page = bytes(range(256)) * 4
    assert store.put(keys(1), [page]) == [True]
    target = bytearray(len(page))

    with pytest.raises(StorageTimeoutError) as caught:
        store.get_into(keys(1), [target])
    error = caught.value
    assert error.settled is not None and not error.settled.is_set()
    seen_when_settled = []
    error.when_settled(lambda: seen_when_settled.append(bytes(target)))
    assert faults.wait_for_hangs(1, timeout=30)
    assert target == bytearray(len(page)) and seen_when_settled == []

    faults.release_hangs()  # the abandoned read goes on, into the caller's buffer itself
    assert error.settled.wait(30)
    assert seen_when_settled == [page]  # the callback ran after the write had landed
    assert target == page
    assert spy.read_targets[0][0].obj is target
    assert timeout.wait_idle(30)
    assert store.stats()["timeout_late_completions"] == 1
    late = []
    error.when_settled(lambda: late.append("now"))  # already settled: runs at once, here
    assert late == ["now"]
    store.close()


def test_a_hung_zero_copy_write_reads_the_callers_source_until_it_settles():
    spy = ZeroCopySpy()
    faults = FaultInjectionLayer(spy, {"put": {"hang_rate": 1.0}})
    store = Store(TimeoutLayer(faults, {"seconds": SHORT, "zero_copy": True}))
    source = bytearray(b"first" * 100)
    with pytest.raises(StorageTimeoutError) as caught:
        store.put_from(keys(1), [source])
    settled = caught.value.settled
    assert settled is not None and not settled.is_set()
    # A caller breaking the contract (changing the source before it settles) would store this:
    source[:] = b"later" * 100
    faults.release_hangs()
    assert settled.wait(30)
    assert Store(spy).get(keys(1), 500) == [b"later" * 100]
    assert spy.write_sources[0][0].obj is source
    store.close()


def test_calls_without_buffers_and_staged_calls_carry_no_settled_event():
    faults = FaultInjectionLayer(MemoryBackend(), {"exists": {"hang_rate": 1.0}, "get": {"hang_rate": 1.0}})
    zero_copy_timeout = TimeoutLayer(faults, {"seconds": SHORT, "zero_copy": True})
    zero_copy = Store(zero_copy_timeout)
    with pytest.raises(StorageTimeoutError) as exists_error:
        zero_copy.exists(keys(1))
    assert exists_error.value.settled is None  # no caller buffer to protect
    staged_timeout = TimeoutLayer(faults, {"seconds": SHORT})
    staged = Store(staged_timeout)
    with pytest.raises(StorageTimeoutError) as get_error:
        staged.get(keys(1), 8)
    assert get_error.value.settled is None  # the store only ever saw a staging buffer
    ran = []
    get_error.value.when_settled(lambda: ran.append(True))
    assert ran == [True]
    faults.release_hangs()
    assert zero_copy_timeout.wait_idle(30) and staged_timeout.wait_idle(30)
    zero_copy.close()
    staged.close()


class WorkersStartLate(TimeoutLayer):
    """A timeout layer whose worker threads start only when the test says so."""

    go = None

    def _start_threads(self, count):
        go = self.go
        threading.Thread(target=lambda: (go.wait(60), TimeoutLayer._start_threads(self, count)), daemon=True).start()


def test_a_call_dropped_before_a_worker_started_it_is_settled_at_once_and_never_runs():
    spy = ZeroCopySpy()
    timeout = WorkersStartLate(spy, {"seconds": SHORT, "workers": 1, "zero_copy": True})
    store = Store(timeout)
    timeout.go = threading.Event()
    Store(spy).put(keys(1), [b"d" * 64])
    target = bytearray(64)
    with pytest.raises(StorageTimeoutError) as caught:
        store.get_into(keys(1), [target])  # no worker yet: the caller gives up on a queued call
    assert caught.value.settled is None
    assert timeout.in_flight == 0

    timeout.go.set()  # the worker starts, finds the dropped call and skips it
    assert store.get(keys(2)[1:], 64) == [None]
    assert timeout.wait_idle(30)
    assert len(spy.read_targets) == 1 and spy.read_targets[0][0].obj is not target
    assert target == bytearray(64)
    stats = store.stats()
    assert stats["timeouts"] == 1 and stats["timeout_busy"] == 0 and stats["timeout_late_completions"] == 0
    store.close()


def test_pages_of_a_mebibyte_and_more_round_trip_through_staging():
    store = Store(TimeoutLayer(MemoryBackend(), {"seconds": 30}))
    pages = [bytes([n]) * (3 * 2**20 + n) for n in (1, 2)]
    assert store.put(keys(2), pages) == [True, True]
    assert store.get(keys(2)[:1], len(pages[0])) == [pages[0]]
    assert store.get(keys(2)[1:], len(pages[1])) == [pages[1]]  # a reused buffer, holding the first page
    store.close()
