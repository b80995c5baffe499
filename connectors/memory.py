"""The reference connector: pages in a dict in this process.

Thread-safe, atomic (values are immutable ``bytes`` swapped under a lock), with optional LRU
eviction under a byte capacity (declared as ``capacity_bytes``; within one put the first pages
count as the most recent, so a prefix keeps its head). Instances given the same ``store`` name
share one dict, which is how two engine instances in one process share an L3; without a name
each instance is private.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import pydantic

from hicache_storage.connector import Connector
from hicache_storage.buffers import Segments, fill_segments, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.keys import Namespace, PageKey


class MemoryConfig(BackendConfig):
    store: str | None = pydantic.Field(
        None, description="name of an in-process store to share between instances; omit for a private one"
    )
    capacity_bytes: int | None = pydantic.Field(
        None, gt=0, description="evict least recently used pages beyond this many bytes; omit for no limit"
    )


class _Store:
    """One dict of pages: ``pages`` (key -> value, least recently used first) and their total
    ``size`` in bytes, both guarded by ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pages: OrderedDict[PageKey, bytes] = OrderedDict()
        self.size = 0


_SHARED: dict[str, _Store] = {}
_SHARED_LOCK = threading.Lock()


class MemoryBackend(Connector):
    name = "memory"
    Config = MemoryConfig
    config: MemoryConfig
    capabilities = Capabilities(native_batch_exists=True, delete=True, clear=True)

    def __init__(self, config: MemoryConfig | dict | str | None = None) -> None:
        super().__init__(config)
        if self.config.store is None:
            self._store = _Store()
        else:
            with _SHARED_LOCK:
                self._store = _SHARED.setdefault(self.config.store, _Store())
        if self.config.capacity_bytes is not None:
            capacity = self.config.capacity_bytes
            self.capabilities = self.capabilities.replace(evicts=True, max_value_size=capacity, capacity_bytes=capacity)

    @property
    def page_table(self) -> _Store:
        """Where this instance keeps its pages (the dict shared by every instance with the same
        ``store`` name), for code that reads or writes pages without the hooks, such as the
        conformance suite's backdoor. Hold its ``lock`` while reading or changing ``pages`` or
        ``size``, and keep ``size`` the sum of the values' lengths."""
        return self._store

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        pages = self._store.pages
        with self._store.lock:
            return [key in pages for key in keys]

    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        store = self._store
        with store.lock:
            values = [store.pages.get(key) for key in keys]
            for key, value in zip(keys, values):
                if value is not None:
                    store.pages.move_to_end(key)
        results = []
        for value, target in zip(values, targets):
            hit = value is not None and len(value) == segments_size(target)
            if value is not None and hit:
                fill_segments(target, value)
            results.append(hit)
        return results

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        # The last write of a key in the batch wins; the batch goes in back to front, so its first
        # pages are the most recently used and a prefix that overflows the capacity keeps its head.
        latest = dict(zip(keys, (b"".join(source) for source in sources)))
        store = self._store
        with store.lock:
            for key, value in reversed(latest.items()):
                old = store.pages.pop(key, None)
                if old is not None:
                    store.size -= len(old)
                store.pages[key] = value
                store.size += len(value)
            self._evict_locked()
        return [True] * len(keys)

    def _delete(self, keys: list[PageKey]) -> list[bool]:
        store = self._store
        results = []
        with store.lock:
            for key in keys:
                old = store.pages.pop(key, None)
                if old is not None:
                    store.size -= len(old)
                results.append(old is not None)
        return results

    def _clear(self, namespace: Namespace) -> None:
        store = self._store
        with store.lock:
            for key in [k for k in store.pages if k.scope.namespace == namespace]:
                store.size -= len(store.pages.pop(key))

    def _evict_locked(self) -> None:
        capacity = self.config.capacity_bytes
        if capacity is None:
            return
        store = self._store
        while store.size > capacity and store.pages:
            _, value = store.pages.popitem(last=False)
            store.size -= len(value)
