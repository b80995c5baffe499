"""What the Connector base class and the store over it guarantee to callers, whatever the connector does."""

import ctypes

import numpy as np
import pytest
import torch

from hicache_storage import Capabilities, Connector, KeyScope, Namespace, RawBuffer, Store
from hicache_storage.buffers import as_segments
from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.errors import (
    BackendClosedError,
    BackendContractError,
    BackendUnavailableError,
    InvalidArgumentError,
    InvalidKeyError,
    UnsupportedOperationError,
    ValueTooLargeError,
)

SCOPE = KeyScope(Namespace("m", "bfloat16", 4))


def keys(n, start=0):
    return [SCOPE.key("%064x" % (start + i + 1)) for i in range(n)]


class Recording(MemoryBackend):
    name = "recording"
    capabilities = Capabilities(max_batch=3, max_value_size=100)

    def __init__(self, config=None):
        super().__init__(config)
        self.batches = []

    def _exists(self, keys):
        self.batches.append(len(keys))
        return super()._exists(keys)


class ExistsOnly(Connector):
    name = "exists-only"

    def _exists(self, keys):
        return [False] * len(keys)

    def _get_into(self, keys, targets):
        return [False] * len(keys)

    def _put_from(self, keys, sources):
        return [True] * len(keys)


def test_batches_are_split_to_max_batch():
    connector = Recording()
    assert Store(connector).exists(keys(8)) == [False] * 8
    assert connector.batches == [3, 3, 2]


class PutSpy(MemoryBackend):
    """Records the keys of every _put_from call and reports the values in ``refuse`` as not stored."""

    name = "put-spy"
    capabilities = Capabilities(max_batch=3)

    def __init__(self, config=None, refuse=()):
        super().__init__(config)
        self.puts = []
        self.refuse = set(refuse)

    def _put_from(self, keys, sources):
        self.puts.append(list(keys))
        stored = super()._put_from(keys, sources)
        return [ok and b"".join(source) not in self.refuse for ok, source in zip(stored, sources)]


def test_a_split_put_writes_the_head_last():
    """Within one put the first pages count as the most recent, also across max_batch chunks, so
    a store that evicts least recently written pages drops a prefix's tail, not its head."""
    connector = PutSpy()
    ks = keys(8)
    assert Store(connector).put(ks, [b"%d" % i for i in range(8)]) == [True] * 8
    assert connector.puts == [ks[6:8], ks[3:6], ks[0:3]]


def test_a_split_put_with_a_key_twice_keeps_the_last_write_and_answers_every_position():
    a, b, c, d = keys(4)
    batch = [a, b, a, c, d, b, a]  # chunks of 3: a in the first and third, b in the first and second
    connector = PutSpy(refuse={b"b5"})  # b's last write fails: b1, written alone, would have succeeded
    store = Store(connector)
    results = store.put(batch, [b"a0", b"b1", b"a2", b"c3", b"d4", b"b5", b"a6"])
    assert results == [True, False, True, True, True, False, True], "each position gets its key's last write's result"
    written = [k for call in connector.puts for k in call]
    assert len(written) == 4 and set(written) == {a, b, c, d}, "each key is written once"
    assert store.get([a, c, d], 2) == [b"a6", b"c3", b"d4"]


def test_a_put_within_max_batch_reaches_the_connector_as_given():
    """Duplicate keys in one call are the connector's to handle (the suite checks it does)."""
    connector = PutSpy()
    store = Store(connector)
    a, b = keys(2)
    assert store.put([a, b, a], [b"a0", b"b1", b"a2"]) == [True] * 3
    assert connector.puts == [[a, b, a]]
    assert store.get([a], 2) == [b"a2"]


def test_prefix_exists_stops_at_the_first_batch_with_a_miss():
    connector = Recording()
    store = Store(connector)
    ks = keys(9)
    store.put(ks[:4], [b"x"] * 4)
    assert store.prefix_exists(ks) == 4
    assert connector.batches == [3, 3], "the third batch must not be asked once the second had a miss"


class PerKeyRecording(Recording):
    """A store that answers ``exists`` one key at a time (an object store), no batch limit."""

    capabilities = Capabilities(max_value_size=100)


class NativeRecording(Recording):
    capabilities = Capabilities(native_batch_exists=True, max_value_size=100)


@pytest.mark.parametrize(
    ("connector_type", "stored", "asked"),
    [
        (PerKeyRecording, 0, [16]),
        (PerKeyRecording, 8, [16]),
        (PerKeyRecording, 20, [16, 32]),
        (PerKeyRecording, 100, [16, 32, 52]),
        (NativeRecording, 8, [100]),
    ],
)
def test_prefix_exists_asks_a_per_key_store_in_growing_batches(connector_type, stored, asked):
    """A short hit on a store without a batch ``exists`` costs one batch of PROBE_FIRST_KEYS
    requests, not one per key of the prompt; a store with one is asked everything at once."""
    assert Store.PROBE_FIRST_KEYS == 16
    connector = connector_type()
    store = Store(connector)
    ks = keys(100)
    if stored:
        store.put(ks[:stored], [b"x"] * stored)
    assert store.prefix_exists(ks) == stored
    assert connector.batches == asked


def test_oversized_values_raise_before_reaching_the_connector():
    store = Store(Recording())
    with pytest.raises(ValueTooLargeError, match="101 bytes exceeds .* 100 bytes") as info:
        store.put(keys(1), [bytes(101)])
    assert info.value.key == keys(1)[0] and info.value.backend == "recording"
    assert store.exists(keys(1)) == [False]


def test_unsupported_operations_raise_one_typed_error():
    store = Store(ExistsOnly())
    with pytest.raises(UnsupportedOperationError, match="delete"):
        store.delete(keys(1))
    with pytest.raises(UnsupportedOperationError, match="clear"):
        store.clear(SCOPE.namespace)


@pytest.mark.parametrize("results", [[True], [True, True, True], (True, True), [1, 0], None])
def test_broken_result_lists_are_contract_errors(results):
    class Broken(ExistsOnly):
        def _exists(self, keys):
            return results

    with pytest.raises(BackendContractError, match="exists"):
        Store(Broken()).exists(keys(2))


def test_storage_errors_gain_context():
    class Down(ExistsOnly):
        name = "down"

        def _get_into(self, keys, targets):
            raise BackendUnavailableError("connection refused")

    with pytest.raises(BackendUnavailableError) as info:
        Store(Down()).get(keys(1), 4)
    assert info.value.backend == "down" and info.value.operation == "get"
    assert info.value.retryable
    assert "backend=down" in str(info.value)


def test_bad_keys_and_buffers():
    store = Store(MemoryBackend())
    with pytest.raises(InvalidKeyError):
        store.exists(["abc"])
    with pytest.raises(InvalidArgumentError, match="sequence of PageKey"):
        store.exists(keys(1)[0])
    with pytest.raises(InvalidArgumentError, match="2 keys but 1 buffers"):
        store.put(keys(2), [b"x"])
    with pytest.raises(InvalidArgumentError, match="buffer protocol"):
        store.put(keys(1), [12345])
    with pytest.raises(InvalidArgumentError, match="writable"):
        store.get_into(keys(1), [b"abc"])
    with pytest.raises(InvalidArgumentError, match="C-contiguous"):
        store.put(keys(1), [np.arange(16, dtype=np.uint8)[::2]])
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        store.put(keys(1), [torch.arange(16, dtype=torch.uint8)[::2]])


def test_buffer_kinds_round_trip_without_copies():
    store = Store(MemoryBackend())
    tensor = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    array = np.arange(6, dtype=np.float32)
    raw_source = (ctypes.c_ubyte * 8).from_buffer_copy(b"rawbytes")
    ks = keys(3)
    assert store.put_from(ks, [tensor, [array[:3], array[3:]], RawBuffer(ctypes.addressof(raw_source), 8)]) == [True] * 3
    out_tensor = torch.zeros(3, 4, dtype=torch.bfloat16)
    out_array = np.zeros(6, dtype=np.float32)
    out_raw = (ctypes.c_ubyte * 8)()
    assert store.get_into(ks, [out_tensor, out_array, RawBuffer(ctypes.addressof(out_raw), 8)]) == [True] * 3
    assert torch.equal(out_tensor, tensor) and np.array_equal(out_array, array) and bytes(out_raw) == b"rawbytes"
    # the views alias the caller's memory: a read lands in the tensor itself
    [view] = as_segments(out_tensor, writable=True)
    view[0:2] = b"\x00\x00"
    assert out_tensor[0, 0].item() == 0


def test_closed_backend_and_context_manager():
    with Store(MemoryBackend()) as store:
        store.put(keys(1), [b"x"])
    assert store.closed
    with pytest.raises(BackendClosedError):
        store.get(keys(1), 1)


def test_stats_count_what_happened():
    store = Store(MemoryBackend())
    store.put(keys(3), [b"abcd"] * 3)
    store.get(keys(4), 4)
    store.exists(keys(2))
    stats = store.stats()
    assert stats["put_keys"] == 3 and stats["put_stored"] == 3 and stats["bytes_written"] == 12
    assert stats["get_keys"] == 4 and stats["get_hits"] == 3 and stats["bytes_read"] == 12
    assert stats["exists_keys"] == 2 and stats["exists_hits"] == 2


def test_get_requires_a_size():
    with pytest.raises(InvalidArgumentError, match="size"):
        Store(MemoryBackend()).get(keys(1), -1)


class RefusesEmptyCalls(MemoryBackend):
    """A connector whose hooks raise on a call with no keys (as 3FS's first put once did) and
    record every call they get."""

    name = "refuses-empty"
    capabilities = Capabilities(delete=True, clear=True, max_batch=2)

    def __init__(self, config=None):
        super().__init__(config)
        self.calls = []

    def _record(self, operation, keys):
        if not keys:
            raise ValueError(f"{operation} called with no keys")
        self.calls.append((operation, len(keys)))

    def _exists(self, keys):
        self._record("exists", keys)
        return super()._exists(keys)

    def _get_into(self, keys, targets):
        self._record("get", keys)
        return super()._get_into(keys, targets)

    def _put_from(self, keys, sources):
        self._record("put", keys)
        return super()._put_from(keys, sources)

    def _delete(self, keys):
        self._record("delete", keys)
        return super()._delete(keys)


@pytest.mark.parametrize("layers", [None, [{"kind": "integrity"}, {"kind": "retry"}, {"kind": "metrics"}, {"kind": "timeout", "seconds": 5}]])
def test_empty_batches_are_answered_by_the_store(layers):
    """An empty batch never reaches any level of the stack, and still counts as the caller's call."""
    from hicache_storage.layers import stack_layers

    connector = RefusesEmptyCalls()
    store = Store(stack_layers(connector, layers))
    assert store.exists([]) == []
    assert store.prefix_exists([]) == 0
    assert store.get_into([], []) == []
    assert store.get([], 4) == []
    assert store.put_from([], []) == []
    assert store.put([], []) == []
    assert store.delete([]) == []
    assert connector.calls == []
    stats = store.stats()
    # prefix_exists counts each batch it asks: an empty one asks none
    assert (stats["exists_calls"], stats["get_calls"], stats["put_calls"], stats["delete_calls"]) == (1, 2, 2, 1)
    assert store.put(keys(3), [b"x"] * 3) == [True] * 3  # a non-empty batch still reaches it, split to max_batch
    assert [call for call in connector.calls if call[0] == "put"] == [("put", 1), ("put", 2)]


def test_an_empty_batch_is_still_validated():
    store = Store(RefusesEmptyCalls())
    with pytest.raises(InvalidArgumentError, match="0 keys but 1 buffers"):
        store.put_from([], [b"x"])
    with pytest.raises(UnsupportedOperationError, match="delete"):
        Store(ExistsOnly()).delete([])
    store.close()
    with pytest.raises(BackendClosedError):
        store.put_from([], [])


def test_a_store_is_held_over_a_level_and_a_level_is_no_store():
    """Three types: the caller API is the store's alone, and Store() says what it takes."""
    connector = MemoryBackend()
    assert not hasattr(connector, "put") and not hasattr(connector, "facade")
    store = Store(connector)
    assert store.top is connector and store.levels() == [connector]
    with pytest.raises(InvalidArgumentError, match="already a store"):
        Store(store)
    with pytest.raises(InvalidArgumentError, match="a connector or a layer"):
        Store({})
