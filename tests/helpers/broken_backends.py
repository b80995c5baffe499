"""Deliberately wrong connectors: the conformance suite must fail each of them.

Each is a small change to the memory connector (five at the end change a connector with a server:
redis, s3, mooncake, hf3fs, fsspec, to prove each one's backdoor) that a vendor under deadline
could plausibly ship and get through review: it serves most requests right and is wrong in one way (an operation, a
capability it declares, concurrency, identity, sizes, batching, ordering, partial failure or
persistence). ``MUTANTS`` lists them with their category and whether the cheap ``--quick`` run
must catch them too; tests/conformance/test_conformance_detects_broken.py runs the suite against each and
scripts/mutation_study.py publishes which clauses catch which (docs/reports/conformance/mutation-study.md).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import pydantic

from hicache_storage.connector import Connector
from hicache_storage.buffers import Segments, fill_segments, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.conformance.backdoor import (
    FsspecBackdoor,
    HF3FSBackdoor,
    MemoryBackdoor,
    MooncakeBackdoor,
    RedisBackdoor,
    S3Backdoor,
    register_backdoor,
)
from hicache_storage.connectors.fsspec import FsspecBackend
from hicache_storage.connectors.hf3fs import HF3FSBackend
from hicache_storage.connectors.memory import MemoryBackend, MemoryConfig
from hicache_storage.connectors.mooncake import MooncakeBackend
from hicache_storage.connectors.redis import RedisBackend
from hicache_storage.connectors.s3 import S3Backend
from hicache_storage.errors import StorageError
from hicache_storage.keys import KeyScope, Namespace, PageKey

MiB = 2**20


@dataclass(frozen=True)
class Mutant:
    name: str
    category: str
    #: A cheap single-operation bug: the ``--quick`` run must catch it too.
    quick: bool
    summary: str


MUTANTS: dict[str, Mutant] = {}


def mutant(category: str, *, quick: bool = True):
    def register(cls: type) -> type:
        summary = " ".join((cls.__doc__ or "").split())
        MUTANTS[cls.__name__] = Mutant(cls.__name__, category, quick, summary)
        return cls

    return register


def _chunked_copy(target: bytearray | memoryview, value: bytes | bytearray, chunk: int = 16 * 1024) -> None:
    """Copy in steps, as code that streams a value does (other threads run between steps)."""
    for start in range(0, len(value), chunk):
        target[start : start + chunk] = value[start : start + chunk]


class _Rekeyed(MemoryBackend):
    """Stores every page under ``_rekey(key)``: the base of the identity bugs."""

    def _rekey(self, key: PageKey) -> PageKey:
        return key

    def _rekey_namespace(self, namespace: Namespace) -> Namespace:
        return self._rekey(KeyScope(namespace).key("0" * 8)).scope.namespace

    def _exists(self, keys):
        return super()._exists([self._rekey(k) for k in keys])

    def _get_into(self, keys, targets):
        return super()._get_into([self._rekey(k) for k in keys], targets)

    def _put_from(self, keys, sources):
        return super()._put_from([self._rekey(k) for k in keys], sources)

    def _delete(self, keys):
        return super()._delete([self._rekey(k) for k in keys])

    def _clear(self, namespace):
        return super()._clear(self._rekey_namespace(namespace))


# --- single operations ----------------------------------------------------------------------------


@mutant("exists")
class LyingExists(MemoryBackend):
    """Claims every page exists (a cache that answers 'yes' to keep the hit rate up)."""

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        return [True] * len(keys)


@mutant("exists")
class ExistsHitsFirst(MemoryBackend):
    """exists returns as many True as there are hits, but first (the server answered with a set)."""

    def _exists(self, keys):
        return sorted(super()._exists(keys), reverse=True)


@mutant("overwrite")
class PutIfAbsent(MemoryBackend):
    """A page hash names its tokens, so an existing key is never rewritten (put-if-absent)."""

    def _put_from(self, keys, sources):
        with self._store.lock:
            fresh = [i for i, key in enumerate(keys) if key not in self._store.pages]
        super()._put_from([keys[i] for i in fresh], [sources[i] for i in fresh])
        return [True] * len(keys)


@mutant("delete")
class TombstoneExists(MemoryBackend):
    """delete leaves an empty tombstone, which exists still counts as a page."""

    def _delete(self, keys):
        results = super()._delete(keys)
        with self._store.lock:
            for key, removed in zip(keys, results):
                if removed:
                    self._store.pages[key] = b""
        return results


@mutant("delete")
class DeleteAlwaysTrue(MemoryBackend):
    """delete reports True for every key, present or not."""

    def _delete(self, keys):
        super()._delete(keys)
        return [True] * len(keys)


@mutant("delete")
class DeleteKeepsReadCache(MemoryBackend):
    """A write-through read cache in the instance that delete and clear forget to invalidate."""

    def __init__(self, config=None):
        super().__init__(config)
        self._cache: dict[PageKey, bytes] = {}

    def _put_from(self, keys, sources):
        for key, source in zip(keys, sources):
            self._cache[key] = b"".join(source)
        return super()._put_from(keys, sources)

    def _get_into(self, keys, targets):
        results = super()._get_into(keys, targets)
        for i, (key, target) in enumerate(zip(keys, targets)):
            cached = self._cache.get(key)
            if not results[i] and cached is not None and len(cached) == segments_size(target):
                fill_segments(target, cached)
                results[i] = True
        return results


@mutant("clear")
class ClearsEverything(MemoryBackend):
    """clear() wipes the whole store instead of one namespace."""

    def _clear(self, namespace: Namespace) -> None:
        with self._store.lock:
            self._store.pages.clear()
            self._store.size = 0


@mutant("clear")
class ClearByModelName(MemoryBackend):
    """clear removes every namespace of the same model (tenant, revision, dtype... ignored)."""

    def _clear(self, namespace):
        with self._store.lock:
            for key in [k for k in self._store.pages if k.scope.namespace.model == namespace.model]:
                self._store.size -= len(self._store.pages.pop(key))


# --- identity ------------------------------------------------------------------------------------


@mutant("identity")
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


@mutant("identity")
class IgnoresRevision(_Rekeyed):
    """The model name is taken as the whole model identity; the revision is left out of the key."""

    def _rekey(self, key):
        return KeyScope(replace(key.scope.namespace, revision=None), key.scope.shard, key.scope.part).key(key.page_hash)


@mutant("identity")
class IgnoresFormatVersion(_Rekeyed):
    """The key format version is left out of the key (old-format pages are then misread)."""

    def _rekey(self, key):
        return KeyScope(replace(key.scope.namespace, format_version=1), key.scope.shard, key.scope.part).key(key.page_hash)


@mutant("identity")
class IgnoresTpSize(_Rekeyed):
    """The shard renders as 'tp<rank>': TP rank 0 of 2 and TP rank 0 of 1 share pages."""

    def _rekey(self, key):
        shard = key.scope.shard
        return KeyScope(key.scope.namespace, replace(shard, tp_size=shard.tp_rank + 1), key.scope.part).key(key.page_hash)


@mutant("identity")
class CaseFoldedKeys(_Rekeyed):
    """Keys built from the identity's fields and lowercased (a case-insensitive store); None as ''."""

    def _rekey(self, key):
        ns = key.scope.namespace
        folded = replace(
            ns,
            model=ns.model.lower(),
            kv_dtype=ns.kv_dtype.lower(),
            revision=(ns.revision or "").lower(),
            tenant=(ns.tenant or "").lower(),
        )
        return KeyScope(folded, key.scope.shard, key.scope.part).key(key.page_hash)


@mutant("identity")
class TruncatedHashKeys(_Rekeyed):
    """Page hashes cut to 64 digits (SHA-256's length), so longer hashes collide with their prefix."""

    def _rekey(self, key):
        return key.scope.key(key.page_hash[:64])


@mutant("identity")
class ExistsByPrefix(MemoryBackend):
    """exists lists keys by prefix (as on an object store) and takes any match as a hit."""

    def _exists(self, keys):
        with self._store.lock:
            rendered = [k.render() for k in self._store.pages]
        return [any(r.startswith(key.render()) for r in rendered) for key in keys]


@mutant("identity")
class DeleteByPrefix(MemoryBackend):
    """delete removes every key that starts with the rendered key (a prefix delete)."""

    def _delete(self, keys):
        results = []
        with self._store.lock:
            for key in keys:
                doomed = [k for k in self._store.pages if k.render().startswith(key.render())]
                for k in doomed:
                    self._store.size -= len(self._store.pages.pop(k))
                results.append(bool(doomed))
        return results


@mutant("identity")
class DeleteAllParts(MemoryBackend):
    """delete of page h removes h's every part (k, v, kv, swa...), 'the page' being all of them."""

    def _delete(self, keys):
        results = []
        with self._store.lock:
            for key in keys:
                doomed = [
                    k
                    for k in self._store.pages
                    if k.page_hash == key.page_hash and (k.scope.namespace, k.scope.shard) == (key.scope.namespace, key.scope.shard)
                ]
                for k in doomed:
                    self._store.size -= len(self._store.pages.pop(k))
                results.append(key in doomed)
        return results


# --- sizes ---------------------------------------------------------------------------------------


@mutant("sizes")
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


@mutant("sizes")
class DropsLargeValues(MemoryBackend):
    """Values over 16 MiB hit a server limit; put still reports them stored."""

    def _put_from(self, keys, sources):
        small = [i for i, source in enumerate(sources) if segments_size(source) <= 16 * MiB]
        super()._put_from([keys[i] for i in small], [sources[i] for i in small])
        return [True] * len(keys)


@mutant("sizes")
class ZeroPadsTruncatedValues(MemoryBackend):
    """Stores at most 8 MiB of a value with its full length, and pads reads with zeros."""

    def __init__(self, config=None):
        super().__init__(config)
        self._lengths: dict[PageKey, int] = {}

    def _put_from(self, keys, sources):
        for key, source in zip(keys, sources):
            self._lengths[key] = segments_size(source)
        return super()._put_from(keys, [[memoryview(b"".join(s))[: 8 * MiB]] for s in sources])

    def _get_into(self, keys, targets):
        results = []
        with self._store.lock:
            values = [self._store.pages.get(k) for k in keys]
        for key, value, target in zip(keys, values, targets):
            size = segments_size(target)
            hit = value is not None and self._lengths.get(key) == size
            if hit:
                fill_segments(target, value + bytes(size - len(value)))
            results.append(hit)
        return results


@mutant("sizes")
class LosesLastPartialChunk(MemoryBackend):
    """Values over 1 MiB are stored in 1 MiB chunks; the last, partial chunk is dropped."""

    def _put_from(self, keys, sources):
        values = []
        for source in sources:
            value = b"".join(source)
            if len(value) > MiB:
                value = b"".join(value[i : i + MiB] for i in range(0, len(value) - MiB + 1, MiB))
            values.append([memoryview(value)])
        return super()._put_from(keys, values)


@mutant("sizes")
class FillsFirstSegmentOnly(MemoryBackend):
    """Reads fill the first segment of a target and skip the rest (contiguous targets assumed)."""

    def _get_into(self, keys, targets):
        with self._store.lock:
            values = [self._store.pages.get(k) for k in keys]
        results = []
        for value, target in zip(values, targets):
            hit = value is not None and len(value) == segments_size(target)
            if hit:
                target[0][:] = value[: target[0].nbytes]
            results.append(hit)
        return results


@mutant("sizes")
class StoresFirstSegmentOnly(MemoryBackend):
    """Writes store the first segment of a page (K) and drop the others (V)."""

    def _put_from(self, keys, sources):
        return super()._put_from(keys, [source[:1] for source in sources])


# --- batching and ordering -----------------------------------------------------------------------


@mutant("batching")
class WrongResultCount(MemoryBackend):
    """Drops the last result of every batch read."""

    def _get_into(self, keys, targets):
        return super()._get_into(keys, targets)[:-1] if keys else []


@mutant("batching")
class FirstWriteWins(MemoryBackend):
    """A key written twice in one batch keeps its first value (a 'seen' set skips the rest)."""

    def _put_from(self, keys, sources):
        first: dict[PageKey, Segments] = {}
        for key, source in zip(keys, sources):
            first.setdefault(key, source)
        super()._put_from(list(first), list(first.values()))
        return [True] * len(keys)


@mutant("batching")
class DuplicateGetFillsOnce(MemoryBackend):
    """A key asked twice in one read is fetched once: its first target is filled, both report a hit."""

    def _get_into(self, keys, targets):
        first: dict[PageKey, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        unique = list(first)
        hits = super()._get_into(unique, [targets[first[k]] for k in unique])
        by_key = dict(zip(unique, hits))
        return [by_key[k] for k in keys]


@mutant("ordering")
class LargeBatchTargetsReversed(MemoryBackend):
    """Batches over 32 keys are fetched in parallel and handed out in completion order (reversed)."""

    def _get_into(self, keys, targets):
        if len(keys) <= 32:
            return super()._get_into(keys, targets)
        return super()._get_into(keys, targets[::-1])


@mutant("batching")
class MaxBatchDropsTail(MemoryBackend):
    """Declares max_batch 16, but the server takes 8 per call: the rest are reported stored, not stored."""

    capabilities = MemoryBackend.capabilities.replace(max_batch=16)

    def _put_from(self, keys, sources):
        super()._put_from(keys[:8], sources[:8])
        return [True] * len(keys)


@mutant("capability")
class ExistsKeyByKey(MemoryBackend):
    """Declares native batch exists, but asks key by key (the batch path 'was flaky')."""

    def _exists(self, keys):
        if len(keys) > 1:
            return [self._exists([key])[0] for key in keys]
        return super()._exists(keys)


# --- partial failure -----------------------------------------------------------------------------


@mutant("partial failure")
class AllOrNothingGet(MemoryBackend):
    """A batch read with one miss reports every key missed (SGLang's old all-or-nothing batch_get)."""

    def _get_into(self, keys, targets):
        results = super()._get_into(keys, targets)
        return results if all(results) else [False] * len(keys)


@mutant("partial failure")
class RaisesOnMiss(MemoryBackend):
    """A missing key raises instead of being a per-key miss."""

    def _get_into(self, keys, targets):
        results = super()._get_into(keys, targets)
        if not all(results):
            raise StorageError(f"key not found: {keys[results.index(False)]}")
        return results


@mutant("errors")
class SlotsFromFirstPut(MemoryBackend):
    """Sizes its slots from the first put's largest page, as a slot-file store does: a first page of zero bytes divides by zero (a bare ZeroDivisionError, not a StorageError)."""

    SPACE = 64 * MiB

    def __init__(self, config=None):
        super().__init__(config)
        self._slots: int | None = None

    def _put_from(self, keys, sources):
        if self._slots is None:
            self._slots = self.SPACE // max(segments_size(source) for source in sources)
        return super()._put_from(keys, sources)


@mutant("errors")
class KeyErrorOnMiss(MemoryBackend):
    """get looks each page up with [] and lets the KeyError of a missing one escape (a bare exception, not a StorageError)."""

    def _get_into(self, keys, targets):
        results = super()._get_into(keys, targets)
        if not all(results):
            raise KeyError(keys[results.index(False)].render("/"))
        return results


@mutant("ordering")
class WriteBehind(MemoryBackend):
    """put queues the write to a background thread and reports it stored at once."""

    def __init__(self, config=None):
        super().__init__(config)
        self._queue: list[tuple[list[PageKey], list[Segments]]] = []
        self._wake = threading.Condition()
        self._flusher = threading.Thread(target=self._flush, daemon=True)
        self._flusher.start()

    def _put_from(self, keys, sources):
        copies = [[memoryview(b"".join(s))] for s in sources]
        with self._wake:
            self._queue.append((keys, copies))
            self._wake.notify()
        return [True] * len(keys)

    def _flush(self):
        while True:
            with self._wake:
                while not self._queue:
                    self._wake.wait()
            time.sleep(0.02)
            with self._wake:
                batches, self._queue = self._queue, []
            for keys, sources in batches:
                MemoryBackend._put_from(self, keys, sources)


# --- the caller's buffers and zero copy ----------------------------------------------------------


@mutant("caller buffers")
class KeepsCallersBuffer(MemoryBackend):
    """A single-segment page is stored as the caller's memoryview, not a copy ('zero copy')."""

    def _put_from(self, keys, sources):
        with self._store.lock:
            for key, source in zip(keys, sources):
                value = source[0] if len(source) == 1 else b"".join(source)
                old = self._store.pages.pop(key, None)
                self._store.size += len(value) - (len(old) if old is not None else 0)
                self._store.pages[key] = value
        return [True] * len(keys)


@mutant("capability")
class StagedZeroCopyRead(MemoryBackend):
    """Declares zero-copy reads, but reads through a staging buffer it allocates per page."""

    capabilities = MemoryBackend.capabilities.replace(zero_copy_read=True)

    def _get_into(self, keys, targets):
        with self._store.lock:
            values = [self._store.pages.get(k) for k in keys]
        results = []
        for value, target in zip(values, targets):
            hit = value is not None and len(value) == segments_size(target)
            if hit:
                staging = bytearray(value)
                fill_segments(target, staging)
            results.append(hit)
        return results


@mutant("capability")
class StagedZeroCopyWrite(MemoryBackend):
    """Declares zero-copy writes, but gathers every page into a staging buffer first."""

    capabilities = MemoryBackend.capabilities.replace(zero_copy_write=True)

    def _put_from(self, keys, sources):
        staged = []
        for source in sources:
            staging = bytearray(segments_size(source))
            fill_segments([memoryview(staging)], b"".join(source))
            staged.append([memoryview(bytes(staging))])
        return super()._put_from(keys, staged)


class _TtlConfig(MemoryConfig):
    ttl_seconds: int | None = pydantic.Field(None, description="expire pages this many seconds after their write")


@mutant("capability", quick=False)
class TtlNeverExpires(MemoryBackend):
    """Declares ttl and takes ttl_seconds in its config, but never expires a page."""

    Config = _TtlConfig
    capabilities = MemoryBackend.capabilities.replace(ttl=True, evicts=True)


# --- capacity ------------------------------------------------------------------------------------


class _CappedConfig(MemoryConfig):
    capacity_bytes: int | None = pydantic.Field(16 * MiB, gt=0)


@mutant("capacity")
class CapacityEvictsHead(MemoryBackend):
    """Under its capacity, a batch is stored front to back, so one put over capacity loses its head."""

    Config = _CappedConfig

    def _put_from(self, keys, sources):
        with self._store.lock:
            for key, source in zip(keys, sources):
                value = b"".join(source)
                old = self._store.pages.pop(key, None)
                self._store.size += len(value) - (len(old) if old is not None else 0)
                self._store.pages[key] = value
            self._evict_locked()
        return [True] * len(keys)


@mutant("capacity")
class CapacityCountedInPages(MemoryBackend):
    """Counts its capacity in 4 KiB pages: larger pages overrun the declared byte capacity."""

    Config = _CappedConfig

    def _evict_locked(self):
        store = self._store
        while len(store.pages) > self.config.capacity_bytes // 4096:
            _, value = store.pages.popitem(last=False)
            store.size -= len(value)


@mutant("capability")
class UndeclaredEviction(MemoryBackend):
    """Keeps at most 16 MiB (LRU) without declaring evicts or a capacity: big pages vanish at once."""

    def _evict_locked(self):
        store = self._store
        while store.size > 16 * MiB and store.pages:
            _, value = store.pages.popitem(last=False)
            store.size -= len(value)


# --- concurrency ---------------------------------------------------------------------------------


@mutant("concurrency", quick=False)
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


@mutant("concurrency", quick=False)
class PublishBeforeFill(MemoryBackend):
    """Reserves the key with a zeroed buffer, then streams the value into it (exists is True early)."""

    def _put_from(self, keys, sources):
        for key, source in zip(keys, sources):
            value = b"".join(source)
            slot = bytearray(len(value))
            with self._store.lock:
                self._store.pages[key] = slot
            _chunked_copy(slot, value)
            with self._store.lock:
                self._store.pages[key] = value
        return [True] * len(keys)


@mutant("concurrency", quick=False)
class InPlaceOverwrite(MemoryBackend):
    """Overwrites a page of the same length in place, chunk by chunk, to save an allocation."""

    def _put_from(self, keys, sources):
        for key, source in zip(keys, sources):
            value = b"".join(source)
            with self._store.lock:
                old = self._store.pages.get(key)
            if isinstance(old, bytearray) and len(old) == len(value):
                _chunked_copy(old, value)
            else:
                with self._store.lock:
                    self._store.pages[key] = bytearray(value)
        return [True] * len(keys)


@mutant("concurrency", quick=False)
class SharedStagingBuffer(MemoryBackend):
    """Reads go through one staging buffer per instance, reused without a lock."""

    def __init__(self, config=None):
        super().__init__(config)
        self._staging = bytearray()

    def _get_into(self, keys, targets):
        with self._store.lock:
            values = [self._store.pages.get(k) for k in keys]
        results = []
        for value, target in zip(values, targets):
            hit = value is not None and len(value) == segments_size(target)
            if hit:
                if len(self._staging) < len(value):
                    self._staging = bytearray(len(value))
                staging = self._staging
                _chunked_copy(staging, value)
                fill_segments(target, memoryview(staging)[: len(value)])
            results.append(hit)
        return results


@mutant("concurrency", quick=False)
class CopyOnWriteLostUpdate(MemoryBackend):
    """'Lock-free' copy-on-write of the page table: concurrent writers lose each other's pages."""

    def _put_from(self, keys, sources):
        store = self._store
        table = OrderedDict(store.pages)
        for key, source in zip(keys, sources):
            value = b"".join(source)
            table[key] = value
        store.pages = table
        return [True] * len(keys)


# --- persistence and processes -------------------------------------------------------------------


@mutant("persistence")
class PersistsNothing(MemoryBackend):
    """Declares persistence it does not have."""

    capabilities = MemoryBackend.capabilities.replace(persistent=True)


class _NamedStoreConfig(MemoryConfig):
    store: str | None = pydantic.Field("broken-delete-not-persisted")


@mutant("persistence")
class DeleteNotPersisted(MemoryBackend):
    """A persistent store whose delete only records a tombstone in the instance: a reopen resurrects the page."""

    Config = _NamedStoreConfig
    capabilities = MemoryBackend.capabilities.replace(persistent=True)

    def __init__(self, config=None):
        super().__init__(config)
        self._deleted: set[PageKey] = set()

    def _exists(self, keys):
        return [hit and key not in self._deleted for key, hit in zip(keys, super()._exists(keys))]

    def _get_into(self, keys, targets):
        return [hit and key not in self._deleted for key, hit in zip(keys, super()._get_into(keys, targets))]

    def _put_from(self, keys, sources):
        self._deleted.difference_update(keys)
        return super()._put_from(keys, sources)

    def _delete(self, keys):
        present = self._exists(keys)
        self._deleted.update(keys)
        return present


@mutant("processes", quick=False)
class InvisibleToOtherProcesses(MemoryBackend):
    """Declares pages shared across processes, but keeps them in this process."""

    capabilities = MemoryBackend.capabilities.replace(shared_across_processes=True)


class _SegmentConfig(BackendConfig):
    root: str = pydantic.Field(
        default_factory=lambda: os.path.join(tempfile.gettempdir(), f"hicache-broken-segments-{os.getuid()}")
    )


@mutant("processes", quick=False)
class SegmentLeavesWithWriter(Connector):
    """Each client keeps its pages in its own segment (a directory per process) that every client reads;
    the segment is removed when its client closes, though the store declares pages outlive their writer."""

    name = "segments"
    Config = _SegmentConfig
    capabilities = Capabilities(
        native_batch_exists=True, delete=True, clear=True, persistent=False, shared_across_processes=True, outlives_writer=True
    )

    def __init__(self, config=None):
        super().__init__(config)
        self._segment = os.path.join(self.config.root, f"{os.getpid()}-{id(self)}")
        os.makedirs(self._segment, exist_ok=True)
        self._lock = threading.Lock()

    def _segments(self) -> list[str]:
        try:
            return [os.path.join(self.config.root, name) for name in os.listdir(self.config.root)]
        except FileNotFoundError:
            return []

    @staticmethod
    def _name(key: PageKey) -> str:
        return key.render("_")

    def _find(self, key: PageKey) -> str | None:
        for segment in self._segments():
            path = os.path.join(segment, self._name(key))
            if os.path.exists(path):
                return path
        return None

    def _exists(self, keys):
        return [self._find(k) is not None for k in keys]

    def _get_into(self, keys, targets):
        results = []
        for key, target in zip(keys, targets):
            path = self._find(key)
            try:
                with open(path or "", "rb") as page:
                    value = page.read()
            except FileNotFoundError:
                value = None
            hit = value is not None and len(value) == segments_size(target)
            if hit:
                fill_segments(target, value)
            results.append(hit)
        return results

    def _put_from(self, keys, sources):
        for key, source in zip(keys, sources):
            for segment in self._segments():
                if segment != self._segment:
                    _unlink(os.path.join(segment, self._name(key)))
            path = os.path.join(self._segment, self._name(key))
            temp = f"{path}.{threading.get_ident()}.tmp"
            with open(temp, "wb") as page:
                page.write(b"".join(source))
            os.replace(temp, path)
        return [True] * len(keys)

    def _delete(self, keys):
        results = []
        for key in keys:
            removed = False
            for segment in self._segments():
                removed = _unlink(os.path.join(segment, self._name(key))) or removed
            results.append(removed)
        return results

    def _clear(self, namespace):
        for segment in self._segments():
            for name in os.listdir(segment) if os.path.isdir(segment) else []:
                if name.startswith(namespace.fingerprint + "_"):
                    _unlink(os.path.join(segment, name))

    def _close(self):
        shutil.rmtree(self._segment, ignore_errors=True)


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


# Every mutant above is the memory connector with one bug, keeping its pages in the memory
# connector's dict under the caller's keys as that connector does: each declares the memory
# connector's backdoor its own (a backdoor belongs to the class that declares it, so a subclass
# has none unless it says so).
for _mutant in MUTANTS:
    if issubclass(globals()[_mutant], MemoryBackend):
        register_backdoor(globals()[_mutant], MemoryBackdoor)


# --- a correct re-keying, for subclasses that store pages under other names --------------------


class ReversedHashes(Connector):
    """Mixed in before a connector: every page under its hash reversed (its namespace, shard and part kept).

    A correct connector on its own (one name per key, each its own): wrong only in a class that
    claims its parent's layout."""

    @staticmethod
    def _reversed(keys):
        return [key.scope.key(key.page_hash[::-1]) for key in keys]

    def _exists(self, keys):
        return super()._exists(self._reversed(keys))

    def _get_into(self, keys, targets):
        return super()._get_into(self._reversed(keys), targets)

    def _put_from(self, keys, sources):
        return super()._put_from(self._reversed(keys), sources)

    def _delete(self, keys):
        return super()._delete(self._reversed(keys))


# --- connectors with a server, wrong both ways ------------------------------------------------
# Each writes pages under other names or as other bytes and undoes it on read, so every round
# trip passes; each claims its parent's documented layout (declares its parent's backdoor), which
# is what catches it. Not in MUTANTS: they need a server and a config
# (tests/conformance/test_conformance_detects_broken.py runs them).

#: Every byte flipped: a page stored through it is never its caller's bytes.
_FLIP = bytes(b ^ 0xA5 for b in range(256))


class FlippedBytes(Connector):
    """Mixed in before a connector: flips every byte it writes and flips it back on read."""

    def _put_from(self, keys, sources):
        return super()._put_from(keys, [[memoryview(b"".join(source).translate(_FLIP))] for source in sources])

    def _get_into(self, keys, targets):
        hits = super()._get_into(keys, targets)
        for hit, target in zip(hits, targets):
            for view in target if hit else ():
                view[:] = bytes(view).translate(_FLIP)
        return hits


class RekeyedRedis(RedisBackend):
    """Its naming method puts the page hash reversed in the Redis key: a key scheme the docstring does not describe."""

    def _name(self, key):
        return super()._name(key.scope.key(key.page_hash[::-1]))


class ScrambledS3(FlippedBytes, S3Backend):
    """Stores every page's bytes flipped and flips them back on read."""


class RekeyedMooncake(MooncakeBackend):
    """Its naming method puts the page hash reversed in the object key."""

    def _object_key(self, key):
        return super()._object_key(key.scope.key(key.page_hash[::-1]))


class RekeyedHF3FS(ReversedHashes, HF3FSBackend):
    """Publishes every page in the slot index under its hash reversed."""


class ScrambledFsspec(FlippedBytes, FsspecBackend):
    """Stores every page's bytes flipped and flips them back on read."""


for _broken, _backdoor in (
    (RekeyedRedis, RedisBackdoor),
    (ScrambledS3, S3Backdoor),
    (RekeyedMooncake, MooncakeBackdoor),
    (RekeyedHF3FS, HF3FSBackdoor),
    (ScrambledFsspec, FsspecBackdoor),
):
    register_backdoor(_broken, _backdoor)
