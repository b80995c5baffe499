"""The integrity layer: torn, truncated, misplaced, foreign and corrupted pages read as misses.

Damage is done behind the layer's back by writing through the inner memory connector directly,
as a broken store, a stray writer or a bit flip would.
"""

import logging
import struct

import pytest

from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.errors import ConfigError, ValueTooLargeError
from hicache_storage.keys import KeyScope, Namespace, PageKey, Shard
from hicache_storage.layers import FaultInjectionLayer, IntegrityLayer, find_layer, stack_layers
from hicache_storage.layers.integrity import TRAILER_SIZE, check_trailer, make_trailer
from hicache_storage.store import Store

NAMESPACE = Namespace(model="integrity-tests", kv_dtype="bfloat16", page_size=16)
SCOPE = KeyScope(NAMESPACE)
SIZE = 1000


def keys(n: int, scope: KeyScope = SCOPE) -> list[PageKey]:
    return scope.keys([f"{i:016x}" for i in range(n)])


def page(seed: int, size: int = SIZE) -> bytes:
    return bytes((seed * 31 + i * 7) % 256 for i in range(size))


@pytest.fixture
def memory():
    return MemoryBackend()


@pytest.fixture
def store(memory):
    store = Store(IntegrityLayer(memory))
    yield store
    store.close()


def stored(memory: MemoryBackend, key: PageKey, size: int = SIZE + TRAILER_SIZE) -> bytearray:
    (value,) = Store(memory).get([key], size)
    assert value is not None
    return bytearray(value)


def misses(store: Store, reason: str) -> int:
    return store.stats()[f"integrity_miss_{reason}"]


def test_round_trip_stores_the_page_then_its_trailer(store, memory):
    key = keys(1)[0]
    assert store.put([key], [page(1)]) == [True]
    assert store.get([key], SIZE) == [page(1)]
    raw = stored(memory, key)
    assert raw[:SIZE] == page(1) and raw[SIZE : SIZE + 4] == b"HCPG"
    assert sum(v for k, v in store.stats().items() if k.startswith("integrity_miss")) == 0


def test_reads_land_in_the_callers_buffers_without_a_copy(memory):
    seen = []

    class Spy(MemoryBackend):
        def _get_into(self, keys, targets):
            seen.extend(targets)
            return super()._get_into(keys, targets)

    store = Store(IntegrityLayer(Spy()))
    store.put(keys(1), [page(2)])
    head, tail = bytearray(400), bytearray(600)
    assert store.get_into(keys(1), [[head, tail]]) == [True]
    assert seen[0][0].obj is head and seen[0][1].obj is tail and seen[0][2].nbytes == TRAILER_SIZE
    assert bytes(head + tail) == page(2)


def test_a_torn_page_reads_as_a_miss(store, memory):
    """Half of one write and half of another under one key (a store without atomic publication)."""
    key = keys(1)[0]
    store.put([key], [page(1)])
    first = stored(memory, key)
    store.put([key], [page(2)])
    second = stored(memory, key)
    Store(memory).put([key], [first[: SIZE // 2] + second[SIZE // 2 :]])
    assert store.get([key], SIZE) == [None]
    assert misses(store, "checksum") == 1


def test_a_truncated_page_reads_as_a_miss(store, memory):
    key = keys(1)[0]
    store.put([key], [page(1)])
    raw = stored(memory, key)
    # The first 600 bytes survived, then the trailer: a reader expecting 600-byte pages.
    Store(memory).put([key], [raw[:600] + raw[SIZE:]])
    assert store.get([key], 600) == [None]
    assert misses(store, "length") == 1
    # Cut without its trailer: the length no longer matches any page of this size.
    Store(memory).put([key], [raw[:SIZE]])
    assert store.get([key], SIZE) == [None]
    assert store.get([key], SIZE - TRAILER_SIZE) == [None]


def test_bytes_of_another_key_read_as_a_miss(store, memory):
    """Key A's stored value copied under key B (a misdirected write or rename)."""
    a, b = keys(2)
    store.put([a], [page(1)])
    Store(memory).put([b], [stored(memory, a)])
    assert store.get([b], SIZE) == [None]
    assert store.get([a], SIZE) == [page(1)]
    assert misses(store, "key") == 1


@pytest.mark.parametrize(
    "other",
    [
        KeyScope(Namespace(model="integrity-tests", kv_dtype="bfloat16", page_size=16, tenant="other-tenant")),
        KeyScope(Namespace(model="integrity-tests", kv_dtype="float16", page_size=16)),
        KeyScope(Namespace(model="integrity-tests", kv_dtype="bfloat16", page_size=16, layout="layer_first")),
        KeyScope(NAMESPACE, Shard(tp_rank=1, tp_size=2)),
        KeyScope(NAMESPACE, part="k"),
    ],
    ids=["tenant", "dtype", "layout", "shard", "part"],
)
def test_a_page_of_another_identity_reads_as_a_miss(store, memory, other):
    """The same page hash in another namespace, shard or part: the key digest covers them all."""
    ours, theirs = keys(1)[0], keys(1, other)[0]
    assert ours.page_hash == theirs.page_hash
    store.put([theirs], [page(3)])
    Store(memory).put([ours], [stored(memory, theirs)])
    assert store.get([ours], SIZE) == [None]
    assert misses(store, "key") == 1


@pytest.mark.parametrize(
    ("offset", "reason"),
    [
        (0, "checksum"),
        (SIZE - 1, "checksum"),
        (SIZE + 0, "magic"),
        (SIZE + 4, "version"),
        (SIZE + 6, "checksum_kind"),
        (SIZE + 8, "length"),
        (SIZE + 16, "key"),
        (SIZE + 40, "checksum"),
    ],
    ids=["first-byte", "last-page-byte", "magic", "version", "checksum-kind", "length", "key-digest", "checksum"],
)
def test_a_flipped_byte_anywhere_reads_as_a_miss(store, memory, offset, reason):
    key = keys(1)[0]
    store.put([key], [page(4)])
    raw = stored(memory, key)
    raw[offset] ^= 0x40
    Store(memory).put([key], [raw])
    assert store.get([key], SIZE) == [None]
    assert misses(store, reason) == 1


def test_a_reserved_byte_flip_is_caught_by_the_checksum(store, memory):
    key = keys(1)[0]
    store.put([key], [page(4)])
    raw = stored(memory, key)
    raw[SIZE + 7] ^= 1
    Store(memory).put([key], [raw])
    assert store.get([key], SIZE) == [None]
    assert misses(store, "checksum") == 1


def test_values_written_without_the_layer_read_as_misses(store, memory):
    key = keys(1)[0]
    Store(memory).put([key], [page(5, SIZE + TRAILER_SIZE)])
    assert store.get([key], SIZE) == [None]
    assert misses(store, "magic") == 1


def test_only_the_damaged_page_of_a_batch_is_a_miss(store, memory):
    batch = keys(5)
    store.put(batch, [page(i) for i in range(5)])
    raw = stored(memory, batch[2])
    raw[10] ^= 1
    Store(memory).put([batch[2]], [raw])
    assert store.get(batch, SIZE) == [page(0), page(1), None, page(3), page(4)]


@pytest.mark.parametrize("fault", ["corrupt_rate", "short_read_rate"])
def test_injected_corruption_and_short_reads_never_reach_the_caller(fault):
    store = Store(stack_layers(MemoryBackend(), [{"kind": "faults", "seed": 9, "get": {fault: 0.5}}, {"kind": "integrity"}]))
    batch = keys(40)
    pages = [page(i) for i in range(40)]
    store.put(batch, pages)
    got = store.get(batch, SIZE)
    damaged = {event.page for event in find_layer(store, FaultInjectionLayer).events}
    assert len(damaged) > 5
    assert all(value == expected for value, expected in zip(got, pages) if value is not None), "damaged data was served"
    missed = {i for i, value in enumerate(got) if value is None}
    if fault == "corrupt_rate":
        assert missed == damaged
    else:  # a short read that cuts only bytes already holding the right values is no damage
        assert missed <= damaged and len(missed) > 5


def test_exists_trusts_the_store_by_default(store, memory):
    key = keys(1)[0]
    store.put([key], [page(1)])
    raw = stored(memory, key)
    raw[0] ^= 1
    Store(memory).put([key], [raw])
    assert store.exists([key]) == [True]  # documented: callers handle the miss on read
    assert store.get([key], SIZE) == [None]


def test_verified_exists_reads_pages_of_known_size(memory):
    store = Store(IntegrityLayer(memory, {"verify_exists": True}))
    good, bad = keys(2)
    other_scope = KeyScope(NAMESPACE, part="v")
    unseen = keys(1, other_scope)[0]
    store.put([good, bad], [page(1), page(2)])
    raw = stored(memory, bad)
    raw[0] ^= 1
    Store(memory).put([bad], [raw])
    Store(memory).put([unseen], [b"not a page of a known size"])
    assert store.exists([good, bad, unseen]) == [True, False, True]
    assert store.prefix_exists([good, bad]) == 1


@pytest.mark.parametrize("checksum", ["crc32", "blake2b"])
def test_each_checksum_kind_round_trips_and_any_reader_verifies_it(memory, checksum):
    writer = Store(IntegrityLayer(memory, {"checksum": checksum}))
    reader = Store(IntegrityLayer(memory, {"checksum": "crc32" if checksum == "blake2b" else "blake2b"}))
    writer.put(keys(1), [page(6)])
    assert reader.get(keys(1), SIZE) == [page(6)]
    kind = stored(memory, keys(1)[0])[SIZE + 6]
    assert kind == (1 if checksum == "crc32" else 2)


def test_trailer_layout_is_the_documented_one():
    key = keys(1)[0]
    payload = [memoryview(page(7))]
    trailer = make_trailer(key, payload)
    assert len(trailer) == TRAILER_SIZE == 48
    magic, version, kind, reserved, length = struct.unpack_from("<4sHBBQ", trailer)
    assert (magic, version, kind, reserved, length) == (b"HCPG", 1, 1, 0, SIZE)
    assert check_trailer(key, payload, trailer) is None


def test_max_value_size_leaves_room_for_the_trailer():
    store = Store(IntegrityLayer(MemoryBackend({"capacity_bytes": 1000})))
    assert store.capabilities.max_value_size == 1000 - TRAILER_SIZE
    assert store.put(keys(1), [bytes(1000 - TRAILER_SIZE)]) == [True]
    with pytest.raises(ValueTooLargeError):
        store.put(keys(1), [bytes(1000 - TRAILER_SIZE + 1)])


def test_a_store_too_small_for_the_trailer_is_a_config_error():
    with pytest.raises(ConfigError, match="no room for a page"):
        IntegrityLayer(MemoryBackend({"capacity_bytes": TRAILER_SIZE}))


def test_failures_are_logged_with_the_key_and_reason(store, memory, caplog):
    key = keys(1)[0]
    Store(memory).put([key], [bytes(SIZE + TRAILER_SIZE)])
    with caplog.at_level(logging.WARNING, logger="hicache_storage.layers.integrity"):
        store.get([key], SIZE)
    assert "failed its magic check" in caplog.text and key.page_hash in caplog.text


class RegisteringMemory(MemoryBackend):
    """Declares buffer registration and notes, per read, whether every segment was registered memory."""

    capabilities = MemoryBackend.capabilities.replace(buffer_registration=True)

    def __init__(self, config=None):
        super().__init__(config)
        self.ranges = []
        self.all_registered = []

    def _register_buffer(self, view):
        start = _address(view)
        self.ranges.append((start, start + view.nbytes))

    def _get_into(self, keys, targets):
        for segments in targets:
            self.all_registered.append(
                all(any(lo <= _address(v) and _address(v) + v.nbytes <= hi for lo, hi in self.ranges) for v in segments)
            )
        return super()._get_into(keys, targets)


def _address(view):
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def test_reads_into_a_registered_pool_stay_in_registered_memory_trailer_included():
    inner = RegisteringMemory()
    store = Store(IntegrityLayer(inner))
    pool = bytearray(4 * SIZE)
    store.register_buffer(pool)
    view = memoryview(pool)
    store.put(keys(2), [page(1), page(2)])
    assert store.get_into(keys(2), [view[:SIZE], view[SIZE : 2 * SIZE]]) == [True, True]
    assert bytes(view[:SIZE]) == page(1) and bytes(view[SIZE : 2 * SIZE]) == page(2)
    assert inner.all_registered == [True, True]
    assert len(inner.ranges) == 2  # the caller's pool and the trailer arena, the arena once
    store.get_into(keys(1), [view[:SIZE]])
    assert len(inner.ranges) == 2


def test_more_reads_than_trailer_slots_still_verify():
    store = Store(IntegrityLayer(RegisteringMemory(), {"trailer_slots": 1}))
    store.put(keys(3), [page(i) for i in range(3)])
    assert store.get(keys(3), SIZE) == [page(i) for i in range(3)]
    assert store.top._slots._free == [0]


def test_a_store_that_does_not_register_gets_no_registration():
    inner = RegisteringMemory()
    inner.capabilities = MemoryBackend.capabilities
    store = Store(IntegrityLayer(inner))
    store.put(keys(1), [page(1)])
    assert store.get(keys(1), SIZE) == [page(1)]
    assert inner.ranges == []


def test_a_hit_without_a_delivered_trailer_fails_even_after_a_good_read():
    """A reused trailer buffer is zeroed first: stale bytes from an earlier read never vouch."""

    class ForgetsTrailer(MemoryBackend):
        forget = False

        def _get_into(self, keys, targets):
            if not self.forget:
                return super()._get_into(keys, targets)
            for segments in targets:  # delivers the page but not the trailer segment
                offset, value = 0, self._store.pages[keys[0]]
                for view in segments[:-1]:
                    view[:] = value[offset : offset + view.nbytes]
                    offset += view.nbytes
            return [True] * len(keys)

    inner = ForgetsTrailer()
    store = Store(IntegrityLayer(inner, {"trailer_slots": 1}))
    store.put(keys(1), [page(1)])
    assert store.get(keys(1), SIZE) == [page(1)]
    inner.forget = True
    assert store.get(keys(1), SIZE) == [None]
    assert misses(store, "magic") == 1
