"""Deliberately wrong connectors: the conformance suite must fail each of them loudly.

Each breaks one promise of the contract on top of the memory connector, the way real connectors
have been seen to break it.
"""

from __future__ import annotations

import time

from hicache_storage.buffers import Segments
from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.keys import KeyScope, Namespace, PageKey


class LyingExists(MemoryBackend):
    """Claims every page exists (a cache that answers 'yes' to keep the hit rate up)."""

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        return [True] * len(keys)


class TornWrite(MemoryBackend):
    """Publishes a page in two halves, so a concurrent reader can see half old, half new."""

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        for key, source in zip(keys, sources):
            value = b"".join(source)
            with self._store.lock:
                old = self._store.pages.get(key, bytes(len(value)))
            half = len(value) // 2
            with self._store.lock:
                self._store.pages[key] = value[:half] + old[half : len(value)]
            time.sleep(0.001)
            with self._store.lock:
                self._store.pages[key] = value
        return [True] * len(keys)


class IgnoresTenant(MemoryBackend):
    """Drops the tenant from the key, as backends that forgot the cache salt did."""

    @staticmethod
    def _strip(key: PageKey) -> PageKey:
        scope = key.scope
        namespace = scope.namespace
        plain = Namespace(namespace.model, namespace.kv_dtype, namespace.page_size, namespace.layout, namespace.revision)
        return KeyScope(plain, scope.shard, scope.part).key(key.page_hash)

    def _exists(self, keys):
        return super()._exists([self._strip(k) for k in keys])

    def _get_into(self, keys, targets):
        return super()._get_into([self._strip(k) for k in keys], targets)

    def _put_from(self, keys, sources):
        return super()._put_from([self._strip(k) for k in keys], sources)


class WrongResultCount(MemoryBackend):
    """Drops the last result of every batch read."""

    def _get_into(self, keys, targets):
        return super()._get_into(keys, targets)[:-1] if keys else []


class ClearsEverything(MemoryBackend):
    """clear() wipes the whole store instead of one namespace."""

    def _clear(self, namespace: Namespace) -> None:
        with self._store.lock:
            self._store.pages.clear()
            self._store.size = 0


class ShortRead(MemoryBackend):
    """Reports a hit for a value shorter than the target, leaving the rest of the target stale."""

    def _get_into(self, keys, targets):
        results = []
        with self._store.lock:
            values = [self._store.pages.get(k) for k in keys]
        for value, target in zip(values, targets):
            if value is None:
                results.append(False)
                continue
            flat = target[0]
            n = min(len(value), flat.nbytes)
            flat[:n] = value[:n]
            results.append(True)
        return results


class PersistsNothing(MemoryBackend):
    """Declares persistence it does not have."""

    capabilities = MemoryBackend.capabilities.replace(persistent=True)

