"""The fault injector: every kind of fault, per operation, replayable from its seed."""

import threading

import pytest

from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.errors import BackendClosedError, BackendContractError, ConfigError, StorageError
from hicache_storage.keys import KeyScope, Namespace, PageKey
from hicache_storage.layers import FaultInjectionLayer, MetricsLayer, find_layer
from hicache_storage.layers.faults import ERROR_KINDS
from hicache_storage.store import Store

SCOPE = KeyScope(Namespace(model="faults-tests", kv_dtype="bfloat16", page_size=16))
SIZE = 256


def keys(n: int) -> list[PageKey]:
    return SCOPE.keys([f"{i:016x}" for i in range(n)])


def page(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(SIZE))


MIXED = {
    "exists": {"error_rate": 0.2, "wrong_count_rate": 0.1},
    "get": {"error_rate": 0.1, "errors": ["timeout", "authentication"], "corrupt_rate": 0.2, "short_read_rate": 0.2},
    "put": {"error_rate": 0.3, "errors": ["unavailable", "runtime"], "latency_rate": 0.5, "latency_seconds": 0.0001},
}


def run_workload(seed: int) -> tuple[list, list]:
    faults = FaultInjectionLayer(MemoryBackend(), {"seed": seed, **MIXED})
    store = Store(faults)
    outcomes = []
    for step in range(30):
        batch = keys(8)[step % 4 : step % 4 + 4]
        for call in (
            lambda: store.put(batch, [page(step)] * 4),
            lambda: store.exists(batch),
            lambda: store.get(batch, SIZE),
        ):
            try:
                outcomes.append(call())
            except Exception as exc:  # the outcome being compared
                outcomes.append(type(exc).__name__)
    return faults.events, outcomes


def test_the_same_seed_replays_the_same_faults_and_outcomes():
    events, outcomes = run_workload(seed=42)
    assert {e.fault for e in events} == {"error", "wrong_count", "corrupt", "short_read", "latency"}
    assert run_workload(seed=42) == (events, outcomes)


def test_another_seed_gives_other_faults():
    assert run_workload(seed=1)[0] != run_workload(seed=2)[0]


@pytest.mark.parametrize("kind", sorted(ERROR_KINDS))
def test_every_error_kind_can_be_raised(kind):
    store = Store(FaultInjectionLayer(MemoryBackend(), {"get": {"error_rate": 1.0, "errors": [kind]}}))
    with pytest.raises(ERROR_KINDS[kind]) as caught:
        store.get(keys(1), SIZE)
    assert "injected fault" in str(caught.value)
    if isinstance(caught.value, StorageError):
        assert caught.value.operation == "get" and caught.value.backend == "faults(memory)"
    assert store.stats()["faults_error"] == 1
    assert store.put(keys(1), [page(1)]) == [True], "faults are per operation: put has none"


@pytest.mark.parametrize("op", ["exists", "get", "put", "delete"])
def test_a_wrong_result_count_is_rejected_by_the_sdk(op):
    faults = FaultInjectionLayer(MemoryBackend(), {op: {"wrong_count_rate": 1.0}})
    calls = {
        "exists": lambda s: s.exists(keys(3)),
        "get": lambda s: s.get(keys(3), SIZE),
        "put": lambda s: s.put(keys(3), [page(0)] * 3),
        "delete": lambda s: s.delete(keys(3)),
    }
    with pytest.raises(BackendContractError, match="results for 3 keys"):
        calls[op](Store(faults))
    # Also when another layer sits on top of the injector.
    with pytest.raises(BackendContractError, match="results for 3 keys"):
        calls[op](Store(MetricsLayer(faults)))


def test_corruption_flips_bytes_of_a_hit():
    store = Store(FaultInjectionLayer(MemoryBackend(), {"get": {"corrupt_rate": 1.0, "corrupt_bytes": 3}}))
    store.put(keys(1), [page(7)])
    head, tail = bytearray(100), bytearray(SIZE - 100)
    assert store.get_into(keys(1), [[head, tail]]) == [True]  # a lying store: wrong data as a hit
    got = bytes(head + tail)
    assert 1 <= sum(a != b for a, b in zip(got, page(7))) <= 3
    assert store.stats()["faults_corrupt"] == 1


def test_a_short_read_leaves_the_rest_of_the_buffer_as_it_was():
    faults = FaultInjectionLayer(MemoryBackend(), {"seed": 4, "get": {"short_read_rate": 1.0}})
    store = Store(faults)
    store.put(keys(1), [page(3)])
    head, tail = bytearray(b"\xaa" * 50), bytearray(b"\xaa" * (SIZE - 50))
    assert store.get_into(keys(1), [[head, tail]]) == [True]
    got = bytes(head + tail)
    (event,) = faults.events
    arrived = int(event.detail.split()[0])
    assert got[:arrived] == page(3)[:arrived]
    assert got[arrived:] == b"\xaa" * (SIZE - arrived)


def test_a_corrupted_write_stores_flipped_bytes_and_leaves_the_callers_buffer_alone():
    memory = MemoryBackend()
    store = Store(FaultInjectionLayer(memory, {"put": {"corrupt_rate": 1.0, "corrupt_bytes": 2}}))
    source = bytearray(page(5))
    assert store.put_from(keys(1), [[source[:100], source[100:]]]) == [True]
    assert source == bytearray(page(5))
    (kept,) = Store(memory).get(keys(1), SIZE)
    assert 1 <= sum(a != b for a, b in zip(kept, page(5))) <= 2


def test_a_truncated_write_stores_a_prefix_and_reads_as_a_miss():
    memory = MemoryBackend()
    faults = FaultInjectionLayer(memory, {"seed": 2, "put": {"truncate_write_rate": 1.0}})
    store = Store(faults)
    assert store.put(keys(1), [page(6)]) == [True]
    (event,) = faults.events
    kept = int(event.detail.split()[0])
    assert Store(memory).get(keys(1), kept) == [page(6)[:kept]]
    assert store.get(keys(1), SIZE) == [None]


@pytest.mark.parametrize("fault", ["corrupt_rate", "truncate_write_rate"])
def test_damaged_writes_read_as_misses_through_integrity(fault):
    from hicache_storage.layers import stack_layers

    store = Store(stack_layers(MemoryBackend(), [{"kind": "faults", "seed": 8, "put": {fault: 0.5}}, {"kind": "integrity"}]))
    pages = [page(i) for i in range(30)]
    store.put(keys(30), pages)
    damaged = {e.page for e in find_layer(store, FaultInjectionLayer).events}
    got = store.get(keys(30), SIZE)
    assert len(damaged) > 5
    assert {i for i, value in enumerate(got) if value is None} == damaged
    assert all(value == expected for value, expected in zip(got, pages) if value is not None)


def test_misses_are_left_alone_by_read_faults():
    faults = FaultInjectionLayer(MemoryBackend(), {"get": {"corrupt_rate": 1.0, "short_read_rate": 1.0}})
    store = Store(faults)
    target = bytearray(b"\x11" * SIZE)
    assert store.get_into(keys(1), [target]) == [False]
    assert target == bytearray(b"\x11" * SIZE) and faults.events == []


def test_hangs_last_until_released_and_then_block_again():
    faults = FaultInjectionLayer(MemoryBackend(), {"exists": {"hang_rate": 1.0}})
    store = Store(faults)
    results = []
    first = threading.Thread(target=lambda: results.append(store.exists(keys(1))))
    first.start()
    assert faults.wait_for_hangs(1, timeout=30)
    assert first.is_alive() and results == []
    faults.release_hangs()
    first.join(30)
    assert results == [[False]]

    def call_and_keep_error():
        try:
            store.exists(keys(1))
        except BackendClosedError as exc:
            results.append(exc)

    second = threading.Thread(target=call_and_keep_error)
    second.start()
    assert faults.wait_for_hangs(1, timeout=30), "a released hang must not release later ones"
    store.close()  # closing releases every hang for good; the hung call then finds the store closed
    second.join(30)
    assert not second.is_alive() and faults.hanging == 0
    assert isinstance(results[-1], BackendClosedError)
    assert store.stats()["faults_hang"] == 2


def test_a_hang_with_a_limit_ends_on_its_own():
    faults = FaultInjectionLayer(MemoryBackend(), {"put": {"hang_rate": 1.0, "hang_seconds": 0.01}})
    store = Store(faults)
    assert store.put(keys(1), [page(1)]) == [True]
    assert [e.fault for e in faults.events] == ["hang"]


def test_clear_and_register_buffer_can_fail_too():
    store = Store(
        FaultInjectionLayer(
            MemoryBackend(), {"clear": {"error_rate": 1.0, "errors": ["permission"]}, "register_buffer": {"error_rate": 1.0}}
        )
    )
    with pytest.raises(ERROR_KINDS["permission"]):
        store.clear(SCOPE.namespace)
    with pytest.raises(ERROR_KINDS["unavailable"]):
        store.register_buffer(bytearray(16))


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"exists": {"corrupt_rate": 0.1}}, "applies only to get and put"),
        ({"exists": {"short_read_rate": 0.1}}, "applies only to get"),
        ({"get": {"truncate_write_rate": 0.1}}, "applies only to put"),
        ({"clear": {"wrong_count_rate": 0.1}}, "no per-key results"),
        ({"get": {"error_rat": 0.1}}, "unknown fault field.*error_rat.*valid: .*error_rate"),
        ({"get": {"errors": ["gremlins"]}}, "unknown error kind.*gremlins.*valid: unavailable"),
        ({"get": {"error_rate": 1.5}}, "less than or equal to 1"),
        ({"get": {"errors": []}}, "at least 1"),
        ({"get": {"vanish_rate": 0.1}}, "applies only to exists"),
        ({"event_log_size": -1}, "greater than or equal to 0"),
        ({"gets": {}}, "valid keys: clear, delete, enabled, event_log_size, exists, get, put, register_buffer, seed"),
    ],
)
def test_bad_fault_configs_are_config_errors(config, match):
    with pytest.raises(ConfigError, match=match):
        FaultInjectionLayer(MemoryBackend(), config)


def test_a_paused_layer_lets_calls_through_and_resumes_the_same_sequence():
    """Paused calls are untouched and take no call number: the faults after resume() are the
    ones a run without the paused calls gets."""
    uninterrupted_faults = FaultInjectionLayer(MemoryBackend(), {"seed": 3, **MIXED})
    uninterrupted = Store(uninterrupted_faults)
    interrupted_faults = FaultInjectionLayer(MemoryBackend(), {"seed": 3, **MIXED, "enabled": False})
    interrupted = Store(interrupted_faults)
    assert not interrupted_faults.enabled
    for _ in range(10):  # starts paused: every call is healthy
        assert interrupted.put(keys(4), [page(1)] * 4) == [True] * 4
        assert interrupted.get(keys(4), SIZE) == [page(1)] * 4
    assert interrupted_faults.events == [] and interrupted.stats()["faults_error"] == 0

    def calls(store):
        outcomes = []
        for step in range(10):
            for call in (lambda: store.put(keys(4), [page(step)] * 4), lambda: store.exists(keys(4))):
                try:
                    outcomes.append(call())
                except Exception as exc:  # the outcome being compared
                    outcomes.append(type(exc).__name__)
        return outcomes

    interrupted_faults.resume()
    assert interrupted_faults.enabled
    assert calls(interrupted) == calls(uninterrupted)
    assert interrupted_faults.events == uninterrupted_faults.events and interrupted_faults.events
    interrupted_faults.pause()
    assert interrupted.put(keys(4), [page(2)] * 4) == [True] * 4 and interrupted.exists(keys(4)) == [True] * 4


def test_pausing_leaves_a_hanging_call_hanging_until_released():
    faults = FaultInjectionLayer(MemoryBackend(), {"exists": {"hang_rate": 1.0}})
    store = Store(faults)
    done = []
    hung = threading.Thread(target=lambda: done.append(store.exists(keys(1))))
    hung.start()
    assert faults.wait_for_hangs(1, timeout=30)
    faults.pause()
    assert store.exists(keys(1)) == [False], "a call made while paused does not hang"
    assert hung.is_alive() and faults.hanging == 1
    faults.release_hangs()
    hung.join(30)
    assert done == [[False]]


def test_a_vanishing_page_exists_then_is_gone_at_get_time():
    memory = MemoryBackend()
    faults = FaultInjectionLayer(memory, {"seed": 6, "exists": {"vanish_rate": 0.5}})
    store = Store(faults)
    store.put(keys(20), [page(i) for i in range(20)])
    assert store.exists(keys(20)) == [True] * 20, "exists still reports every page"
    vanished = {e.page for e in faults.events}
    assert [e.fault for e in faults.events] == ["vanish"] * len(vanished) and 3 < len(vanished) < 17
    got = store.get(keys(20), SIZE)
    assert {i for i, value in enumerate(got) if value is None} == vanished
    assert Store(memory).exists(keys(20)) == [i not in vanished for i in range(20)], "deleted from the store itself"
    assert store.stats()["faults_vanish"] == len(vanished)
    again = store.exists(keys(20))
    assert again == [i not in vanished for i in range(20)]
    assert {e.page for e in faults.events[len(vanished):]} <= set(range(20)) - vanished, "only present pages vanish"


def test_vanishing_needs_a_store_that_can_delete():
    class NoDelete(MemoryBackend):
        def __init__(self) -> None:
            super().__init__()
            self.capabilities = self.capabilities.replace(delete=False)

    with pytest.raises(ConfigError, match="cannot delete"):
        FaultInjectionLayer(NoDelete(), {"exists": {"vanish_rate": 0.1}})


@pytest.mark.parametrize("size", [0, 5])
def test_the_event_log_keeps_only_the_latest_events_and_stats_count_them_all(size):
    faults = FaultInjectionLayer(MemoryBackend(), {"event_log_size": size, "get": {"error_rate": 1.0}})
    store = Store(faults)
    for _ in range(20):
        with pytest.raises(ERROR_KINDS["unavailable"]):
            store.get(keys(1), SIZE)
    assert [e.call for e in faults.events] == list(range(20 - size, 20))
    assert store.stats()["faults_error"] == 20


def test_the_event_log_is_capped_by_default():
    faults = FaultInjectionLayer(MemoryBackend(), {"get": {"error_rate": 1.0}})
    store = Store(faults)
    for _ in range(1500):
        with pytest.raises(ERROR_KINDS["unavailable"]):
            store.get(keys(1), SIZE)
    assert len(faults.events) == 1000 and faults.events[-1].call == 1499
