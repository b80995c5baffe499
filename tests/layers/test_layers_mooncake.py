"""The integrity layer keeps Mooncake's zero-copy reads, against a real Mooncake master.

Mooncake reads straight into caller memory only when every segment of a page lies in registered
memory; integrity adds a trailer segment, so its trailer arena must be registered too.
"""

from __future__ import annotations

import pytest

from hicache_storage import Store, create_backend
from hicache_storage.conformance import ConformanceTests
from hicache_storage.keys import KeyScope, Namespace
from hicache_storage.layers import connector_of, stack_layers
from reused_store import ReusedStore

pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine(-non-cuda)")

pytestmark = pytest.mark.services

PAGE = 4096


@pytest.mark.parametrize(("trailer_slots", "path"), [(1024, "direct"), (0, "staged")])
def test_integrity_reads_into_a_registered_pool_are_zero_copy(mooncake_master, trailer_slots, path):
    store = Store(stack_layers(create_backend("mooncake", mooncake_master.client_config()), [{"kind": "integrity", "trailer_slots": trailer_slots}]))
    connector = connector_of(store)
    paths = []
    registered_addresses = connector._registered_addresses  # how the connector picks its path

    def spy(target):
        addresses = registered_addresses(target)
        paths.append("staged" if addresses is None else "direct")
        return addresses

    connector._registered_addresses = spy
    try:
        scope = KeyScope(Namespace(model=f"layers-mooncake-{trailer_slots}", kv_dtype="bfloat16", page_size=16))
        keys = scope.keys([f"{i:016x}" for i in range(4)])
        pool = bytearray(8 * PAGE)
        store.register_buffer(pool)
        view = memoryview(pool)
        pages = [bytes([i + 1]) * PAGE for i in range(4)]
        for i, page in enumerate(pages):
            view[i * PAGE : (i + 1) * PAGE] = page
        assert store.put_from(keys, [view[i * PAGE : (i + 1) * PAGE] for i in range(4)]) == [True] * 4
        paths.clear()
        assert store.get_into(keys, [view[(4 + i) * PAGE : (5 + i) * PAGE] for i in range(4)]) == [True] * 4
        assert [bytes(view[(4 + i) * PAGE : (5 + i) * PAGE]) for i in range(4)] == pages
        # With the registered trailer arena every read goes direct; without it, through staging.
        assert paths == [path] * 4
        store.clear(scope.namespace)
    finally:
        store.close()


class TestRecommendedStackOnMooncakeConformance(ReusedStore, ConformanceTests):
    """One stack serves every clause that leaves it as it was (closing its client takes a second)."""

    backend = "mooncake"
    layers = [{"kind": "integrity"}, {"kind": "timeout", "seconds": 60}, {"kind": "retry", "base_seconds": 0.01}, {"kind": "metrics"}]

    @pytest.fixture
    def backend_config(self, mooncake_master):
        return mooncake_master.client_config()
