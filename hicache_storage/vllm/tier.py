"""Any hicache-storage connector as a secondary tier of vLLM's CPU offloading.

vLLM's ``OffloadingConnector`` with ``spec_name="TieringOffloadingSpec"`` copies KV blocks from
the device to a CPU primary tier (one shared memory region, a row per chunk) and cascades every
row it stores to its secondary tiers; a chunk found only in a secondary tier is promoted (read
into a primary row) and then loaded to the device. :class:`HiCacheStorageTier` is such a tier
over a :class:`~hicache_storage.store.Store`, selected by ``type`` and ``module_path`` in one
``secondary_tiers`` entry::

    vllm serve MODEL --kv-transfer-config '{
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 17179869184,
            "secondary_tiers": [{"type": "HiCacheStorageTier", "module_path": "hicache_storage.vllm.tier",
                                 "connector": "file", "connector_config": {"root": "/mnt/nvme/kv"}}]}}'

The rest of the entry is the KV connector's config (:class:`~hicache_storage.vllm.config.
VllmConnectorConfig`: ``connector``, ``connector_config``, ``layers``, ``tenant``, ``revision``,
``model``, ``breaker``, ``timeout_s``), plus vLLM's own ``locality`` and ``backpressure``. A page
is one primary row and its key the chunk's vLLM block hash (:func:`~hicache_storage.vllm.identity.
offload_rows`: a namespace of its own, never the KV connector's).

Everything here runs in vLLM's scheduler process, whose contract is that no method blocks:

* **lookup**: asynchronous, through vLLM's own ``AsyncLookupManager``: the keys a step asks
  about are checked after it, one ``exists`` per request on a lookup thread, and answered
  ``RETRY`` until then; vLLM asks again next step;
* **store** (a cascade): on a store thread, ``exists``, then ``put_from`` of the rows the store
  lacks (and of rows that failed to load here, once recomputed), straight from the primary
  tier's memory;
* **load** (a promotion): on a load thread, ``get_into`` the primary rows vLLM allocated. A row
  that does not arrive (a miss, an integrity failure, a store error or timeout) is reported
  failed: vLLM frees its slot, the lookup's verdict for it becomes a miss, so no request is
  offered it again, and vLLM computes it;
* **health**: every call goes through the store's breaker (:mod:`hicache_storage.vllm.guard`);
  vLLM never sees a storage error.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from hicache_storage.keys import PageKey
from hicache_storage.vllm.config import VllmConnectorConfig
from hicache_storage.vllm.guard import GuardedStore
from hicache_storage.vllm.identity import offload_rows

logger = logging.getLogger(__name__)

#: How long shutdown waits for transfers under way (each store call is bounded by ``timeout_s``).
SHUTDOWN_WAIT_S = 30.0


class _StoreLookups(AsyncLookupManager):
    """vLLM's asynchronous lookups, answered by the store's ``exists``."""

    def __init__(self, tier: HiCacheStorageTier) -> None:
        self._tier = tier
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.exists(keys)


class HiCacheStorageTier(SecondaryTierManager):
    """vLLM's ``SecondaryTierManager`` over a hicache-storage store (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        locality: str | None = None,
        **config: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self.config = VllmConnectorConfig.from_tier_config(config)
        self.rows = offload_rows(offloading_spec.config, self.config, self.block_size_bytes)
        #: the primary tier's rows as one flat byte view (row ``c`` at ``c * block_size_bytes``)
        self._primary = primary_kv_view.cast("B")
        self.store = GuardedStore(self.config, self.rows.scope(0))
        self.store.call("register_buffer", "buffer registration", None, lambda: self.store.store.register_buffer(self._primary))
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-tier-load")
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-tier-store")
        self._lock = threading.Condition()
        self._in_flight = 0
        #: finished jobs, with the keys of a promotion that did not arrive
        self._finished: queue.SimpleQueue[tuple[JobResult, list[OffloadKey]]] = queue.SimpleQueue()
        #: rows that failed to load (corrupt, unreadable): written again once vLLM recomputed
        #: them, though ``exists`` still finds them
        self._rewrite: set[PageKey] = set()
        #: rows looked up, found, loaded, failed to load, stored, already stored, not stored
        self.counts: collections.Counter[str] = collections.Counter()
        self._lookups = _StoreLookups(self)
        logger.info(
            "hicache_storage: secondary tier %s on store %s, namespace %s (%s)",
            tier_type,
            self.config.connector,
            self.rows.namespace.fingerprint,
            self.rows.namespace.geometry,
        )

    # --- lookups ------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def exists(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Which of ``keys`` the store holds (the lookup thread's call); none while it is unhealthy."""
        page_keys = self._page_keys(keys)
        found = self.store.call("exists", f"lookup of {len(keys)} rows", None, lambda: self.store.store.exists(page_keys))
        hits = [bool(hit) for hit in found] if found is not None else [False] * len(keys)
        self._count(rows_looked_up=len(keys), rows_found=sum(hits))
        return hits

    # --- transfers ----------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys, rows = list(job_metadata.keys), [int(c) for c in job_metadata.chunk_ids]
        self._submit(self._saver, job_metadata.job_id, keys, lambda: self._store_rows(job_metadata.job_id, keys, rows))

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys, rows = list(job_metadata.keys), [int(c) for c in job_metadata.chunk_ids]
        self._submit(self._loader, job_metadata.job_id, keys, lambda: self._load_rows(job_metadata.job_id, keys, rows))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        while True:
            try:
                result, missed = self._finished.get_nowait()
            except queue.Empty:
                return results
            if missed:
                # The lookup said these were stored: it must not say so again (vLLM would
                # promote them over and over).
                self._lookups.mark_miss(missed)
            results.append(result)

    def has_pending_work(self) -> bool:
        with self._lock:
            return self._in_flight > 0

    def drain_jobs(self) -> None:
        """Wait for every job submitted; their results stay for :meth:`get_finished_jobs`."""
        with self._lock:
            self._lock.wait_for(lambda: self._in_flight == 0)

    def _submit(self, pool: ThreadPoolExecutor, job_id: int, keys: list[OffloadKey], job: Callable[[], tuple[JobResult, list[OffloadKey]]]) -> None:
        with self._lock:
            self._in_flight += 1
        pool.submit(self._run, job_id, keys, job)

    def _run(self, job_id: int, keys: list[OffloadKey], job: Callable[[], tuple[JobResult, list[OffloadKey]]]) -> None:
        """Run one job; whatever happens, it ends with a result, so vLLM never waits on it forever."""
        try:
            outcome = job()
        except Exception:
            logger.exception("hicache_storage: tier job %d failed", job_id)
            outcome = (JobResult(job_id=job_id, success=False), keys)
        self._finished.put(outcome)
        with self._lock:
            self._in_flight -= 1
            self._lock.notify_all()

    def _store_rows(self, job_id: int, keys: list[OffloadKey], rows: list[int]) -> tuple[JobResult, list[OffloadKey]]:
        start = time.monotonic()
        page_keys = self._page_keys(keys)
        stored = self.store.call("exists", f"exists query of {len(keys)} rows", None, lambda: self.store.store.exists(page_keys))
        if stored is None:
            self._count(rows_not_stored=len(keys))
            return JobResult(job_id=job_id, success=False), []
        with self._lock:
            todo = [i for i, hit in enumerate(stored) if not hit or page_keys[i] in self._rewrite]
        written: list[bool] | None = []
        if todo:
            written = self.store.call(
                "put",
                f"write of {len(todo)} rows",
                None,
                lambda: self.store.store.put_from([page_keys[i] for i in todo], [self._row(rows[i]) for i in todo]),
            )
        ok = sum(bool(w) for w in written or ())
        with self._lock:
            self._rewrite.difference_update(page_keys[i] for i, w in zip(todo, written or ()) if w)
        self._count(rows_stored=ok, rows_already_stored=len(keys) - len(todo), rows_not_stored=len(todo) - ok)
        return (
            JobResult(
                job_id=job_id,
                success=ok == len(todo),
                transfer_time=time.monotonic() - start,
                transfer_bytes=ok * self.block_size_bytes,
            ),
            [],
        )

    def _load_rows(self, job_id: int, keys: list[OffloadKey], rows: list[int]) -> tuple[JobResult, list[OffloadKey]]:
        start = time.monotonic()
        page_keys = self._page_keys(keys)
        hits = self.store.call(
            "get", f"read of {len(keys)} rows", None, lambda: self.store.store.get_into(page_keys, [self._row(r) for r in rows])
        )
        arrived = [bool(hit) for hit in hits] if hits is not None else [False] * len(keys)
        good = [key for key, hit in zip(keys, arrived) if hit]
        missed = [key for key, hit in zip(keys, arrived) if not hit]
        with self._lock:
            self._rewrite.update(page for page, hit in zip(page_keys, arrived) if not hit)
        self._count(rows_loaded=len(good), rows_failed_to_load=len(missed))
        result = JobResult(
            job_id=job_id,
            success=not missed,
            # on a partial failure, the rows that did arrive are kept
            successful_keys=tuple(good) if missed and good else None,
            transfer_time=time.monotonic() - start,
            transfer_bytes=len(good) * self.block_size_bytes,
        )
        return result, missed

    # --- per request and step -----------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def shutdown(self) -> None:
        """Let the transfers under way end (a cascade still writing is a page a later engine
        finds), then close the store."""
        with self._lock:
            drained = self._lock.wait_for(lambda: self._in_flight == 0, timeout=SHUTDOWN_WAIT_S)
        if not drained:
            logger.warning("hicache_storage: tier transfers still under way after %.0f s at shutdown; abandoned", SHUTDOWN_WAIT_S)
        self._loader.shutdown(wait=drained)
        self._saver.shutdown(wait=drained)
        self._lookups.shutdown()
        self.store.close()
        if drained:
            self._primary.release()

    # --- helpers ------------------------------------------------------------------------------

    def _page_keys(self, keys: Sequence[OffloadKey]) -> list[PageKey]:
        return [self.rows.key(get_offload_block_hash(key), get_offload_group_idx(key)) for key in keys]

    def _row(self, chunk: int) -> memoryview:
        size = self.block_size_bytes
        return self._primary[chunk * size : (chunk + 1) * size]

    def _count(self, **amounts: int) -> None:
        with self._lock:
            self.counts.update(amounts)
