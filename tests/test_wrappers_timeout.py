"""The timeout wrapper: callers get control back from a hung store, and late calls touch no caller memory.

Hangs are injected with the fault wrapper and released through its event, so no test depends on
how long anything takes: a hung call stays hung until the test releases it.
"""

import logging
import threading

import pytest

from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.errors import (
    AuthenticationError,
    BackendUnavailableError,
    RetryableError,
    StorageTimeoutError,
)
from hicache_storage.keys import KeyScope, Namespace, PageKey
from hicache_storage.wrappers import FaultInjectionWrapper, RetryWrapper, TimeoutWrapper

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


def hanging(operation: str, inner=None, workers: int = 2):
    """timeout(faults(memory)) where every ``operation`` call hangs until released."""
    faults = FaultInjectionWrapper(inner or MemoryBackend(), {operation: {"hang_rate": 1.0}})
    return TimeoutWrapper(faults, {"seconds": SHORT, "workers": workers}), faults


def our_threads(store: TimeoutWrapper) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"hicache-{store.name}-")]


def test_a_hung_read_times_out_and_its_late_completion_never_writes_the_callers_buffer():
    spy = SpyMemory()
    store, faults = hanging("get", spy)
    page = bytes(range(256)) * 4
    assert store.put(keys(1), [page]) == [True]
    target = bytearray(len(page))

    with pytest.raises(StorageTimeoutError) as caught:
        store.get_into(keys(1), [target])
    assert isinstance(caught.value, RetryableError)
    assert caught.value.backend == "timeout(faults(memory))" and caught.value.operation == "get"

    # Let the hung read finish now that its caller has been told it failed.
    faults.release_hangs()
    assert store.wait_idle(30)
    assert store.stats()["timeout_late_completions"] == 1
    # The store really did deliver the page, late, but into a staging buffer, not the caller's.
    assert spy.read_results == [True]
    assert bytes(spy.read_targets[0][0]) == page
    assert spy.read_targets[0][0].obj is not target
    assert target == bytearray(len(page)), "a late read wrote into memory the caller was told had failed"
    store.close()


def test_a_hung_write_stores_the_bytes_passed_never_what_the_caller_wrote_afterwards():
    memory = MemoryBackend()
    store, faults = hanging("put", memory)
    source = bytearray(b"original" * 128)
    with pytest.raises(StorageTimeoutError):
        store.put_from(keys(1), [source])
    source[:] = b"REUSED!!" * 128  # the caller reuses its buffer once the call has returned
    faults.release_hangs()
    assert store.wait_idle(30)
    assert store.stats()["timeout_late_completions"] == 1
    assert memory.get(keys(1), len(source)) == [b"original" * 128]
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
    store = TimeoutWrapper(inner, {"seconds": SHORT, "workers": 2})
    pool = store._staging
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
    assert store.wait_idle(30)
    assert any(b is first_buffer for b in pool._free) and len(pool._free) == 2
    assert store.get(keys(2), 512) == [b"1" * 512, b"2" * 512]
    store.close()


def test_when_every_worker_is_stuck_new_calls_time_out_instead_of_queueing():
    store, faults = hanging("get", workers=1)
    store.put(keys(1), [b"p" * 64])
    errors = []
    caller = threading.Thread(target=lambda: errors.append(_raised(store.get, keys(1), 64)))
    caller.start()
    assert faults.wait_for_hangs(1, timeout=30)
    caller.join(30)
    assert not caller.is_alive() and isinstance(errors[0], StorageTimeoutError)

    # The one worker is still stuck in the store: an exists cannot get a worker at all.
    with pytest.raises(StorageTimeoutError, match="all 1 workers are still waiting"):
        store.exists(keys(1))
    assert store.stats()["timeout_busy"] == 1
    assert store.in_flight == 1

    faults.release_hangs()
    assert store.wait_idle(30)
    assert store.exists(keys(1)) == [True]
    store.close()


def test_threads_stay_bounded_however_many_callers_hit_a_hung_store():
    store, faults = hanging("exists", workers=3)
    results = []
    callers = [threading.Thread(target=lambda: results.append(_raised(store.exists, keys(1)))) for _ in range(20)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(60)
    assert all(isinstance(r, StorageTimeoutError) for r in results) and len(results) == 20
    assert len(our_threads(store)) <= 3
    assert faults.hanging <= 3
    faults.release_hangs()
    assert store.wait_idle(30)
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
    store = RetryWrapper(TimeoutWrapper(inner, {"seconds": SHORT, "workers": 2}), {"base_seconds": 0.001, "seed": 1})
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

    store = TimeoutWrapper(Failing(), {"seconds": 30})
    with pytest.raises(type(error)) as caught:
        store.exists(keys(1))
    assert caught.value is error
    store.close()


def test_reads_fill_every_segment_of_a_hit_and_leave_misses_alone():
    store = TimeoutWrapper(MemoryBackend(), {"seconds": 30})
    page = bytes(range(64))
    store.put(keys(1), [page])
    head, tail = bytearray(10), bytearray(54)
    untouched = bytearray(b"\xee" * 64)
    assert store.get_into(keys(2), [[head, tail], untouched]) == [True, False]
    assert bytes(head + tail) == page
    assert untouched == bytearray(b"\xee" * 64)
    assert not store.capabilities.zero_copy_read and not store.capabilities.zero_copy_write
    store.close()


def test_close_does_not_wait_for_a_hung_call_and_workers_exit():
    store, faults = hanging("get", workers=2)
    store.put(keys(1), [b"c" * 8])
    with pytest.raises(StorageTimeoutError):
        store.get(keys(1), 8)
    assert store.in_flight == 1
    threads = our_threads(store)
    store.close()  # closing the fault wrapper below releases its hang
    assert faults.closed
    assert store.wait_idle(30)
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()


def test_close_returns_when_the_inner_close_hangs(caplog):
    release = threading.Event()

    class StuckClose(MemoryBackend):
        def _close(self):
            release.wait(60)

    store = TimeoutWrapper(StuckClose(), {"seconds": SHORT})
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
    store = TimeoutWrapper(MemoryBackend(), {"seconds": 30, "staging_cache_bytes": 1000})
    store.put(keys(2), [b"a" * 600, b"b" * 600])
    assert store.get(keys(1), 600) == [b"a" * 600]
    assert store.get(keys(2), 600) == [b"a" * 600, b"b" * 600]
    assert sum(len(b) for b in store._staging._free) <= 1000
    store.close()


def test_a_staging_buffer_is_never_lent_twice_at_once():
    from hicache_storage.wrappers.timeout import _StagingPool

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
    faults = FaultInjectionWrapper(MemoryBackend(), {"seed": 5, "get": {"hang_rate": 0.3, "hang_seconds": 0.03}})
    store = TimeoutWrapper(faults, {"seconds": 0.005, "workers": 3})
    pages = {key: bytes([i + 1]) * 2048 for i, key in enumerate(keys(8))}
    for key, value in pages.items():
        faults.inner.put([key], [value])
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
    assert store.wait_idle(30)
    assert not wrong
    assert set_aside, "no call timed out: the test proved nothing"
    assert all(bytes(target) == sentinel for target, sentinel in set_aside)
    assert len(our_threads(store)) <= 3
    store.close()
