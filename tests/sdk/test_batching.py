"""The SDK's per-key batch helpers: every call ends before an error is raised."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hicache_storage.batching import map_all
from hicache_storage.errors import BackendClosedError


def test_map_all_waits_for_every_call_then_raises_the_first_error():
    finished = []

    def work(i):
        if i in (1, 2):
            raise (ValueError if i == 1 else KeyError)(f"item {i}")
        time.sleep(0.05)
        finished.append(i)
        return i

    with ThreadPoolExecutor(4) as pool:
        with pytest.raises(ValueError, match="item 1"):
            map_all(pool, work, [0, 1, 2, 3])
        assert sorted(finished) == [0, 3], "the slow calls ended before the error was raised"
        assert map_all(pool, lambda i: 2 * i, [1, 2, 3]) == [2, 4, 6]


def test_a_pool_shut_down_under_a_batch_is_a_closed_backend():
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    with pytest.raises(BackendClosedError, match="closed during the call"):
        map_all(pool, str, [1, 2])
