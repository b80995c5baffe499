"""The timeout layer in front of a real, frozen Redis: callers get control back, memory stays safe.

The server is frozen with SIGSTOP (it keeps its sockets open and answers nothing), as a hung
store would; its own client would wait ``socket_timeout`` (set long here), the layer does not.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hicache_storage import Store, create_backend
from hicache_storage.errors import StorageTimeoutError
from hicache_storage.keys import KeyScope, Namespace
from hicache_storage.layers import TimeoutLayer, stack_layers

pytest.importorskip("redis", reason="needs the redis client (the 'redis' extra)")

pytestmark = pytest.mark.services

SCOPE = KeyScope(Namespace(model="layers-redis", kv_dtype="bfloat16", page_size=16))
PAGE = 4096


@pytest.fixture
def frozen_redis() -> Iterator[object]:
    from hicache_storage.testing.redis_server import RedisServer

    server = RedisServer()
    server.start()
    yield server
    server.stop()  # thaws first if still frozen


def test_a_frozen_redis_cannot_block_callers_or_write_into_returned_buffers(frozen_redis):
    inner = create_backend("redis", {"url": frozen_redis.url, "socket_timeout": 60, "retries": 0})
    timeout = stack_layers(inner, [{"kind": "integrity"}, {"kind": "timeout", "seconds": 0.5, "workers": 2}])
    assert isinstance(timeout, TimeoutLayer)
    store = Store(timeout)
    keys = SCOPE.keys([f"{i:016x}" for i in range(3)])
    pages = [bytes([i + 1]) * PAGE for i in range(3)]
    assert store.put(keys, pages) == [True] * 3

    frozen_redis.freeze()
    target = bytearray(b"\xee" * PAGE)
    with pytest.raises(StorageTimeoutError):
        store.get_into(keys[:1], [target])
    with pytest.raises(StorageTimeoutError):
        store.exists(keys)
    # Both calls are set aside, still stuck in the frozen server; a third gets a fresh worker and is too.
    with pytest.raises(StorageTimeoutError, match="did not answer"):
        store.exists(keys)

    frozen_redis.thaw()
    assert timeout.wait_idle(60)
    assert target == bytearray(b"\xee" * PAGE), "a late read wrote into a buffer whose call had failed"
    assert store.stats()["timeout_late_completions"] == 3
    assert store.get(keys, PAGE) == pages
    store.close()
