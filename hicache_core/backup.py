"""Host -> storage backup: one op per node, every pool of its pages, run on the backup thread.

The cache controller submits an op when a node's device -> host copy completes (or, for
backfill, when a component's state appears on a node already backed up). The op carries one
:class:`~hicache_core.side_pools.PoolPages` per pool (the FULL KV's first), each pinned on its
own host allocator until the thread is done with it. Per pool, pages already stored (a live
``prefix_exists``) are skipped, except pages a prefetch found unreadable (``suspects``: they are
rewritten); puts go in batches of at most ``batch_pages``, and the first failed batch ends the
op. Only writer ranks (``shard.is_writer``) call the store; a store given up
(:class:`~hicache_core.storage_calls.StorageHealth`) is not called at all, and while its breaker
is open an op is skipped (``storage_backup_skipped_unhealthy``); every rank still acknowledges
every op, so their trees change at the same agreed points. A put pins the host pages it reads
only within the room :class:`~hicache_core.pin_cap.PinCap` grants; without room it writes from
a private copy, so a put that hangs never holds more of the pool than the cap.

Threads: the scheduler thread calls ``submit``, ``acknowledged`` and ``take``; the backup thread
reads only the host pages of the ops it was handed and survives any exception from the store.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hicache_storage.cost import CostModel
from hicache_storage.multipool import MultiPoolStore

from hicache_core.metrics import CacheMetrics
from hicache_core.op_thread import OpThread, Wakeup
from hicache_core.pin_cap import PinCap, private_copy
from hicache_core.page_sets import PageSet
from hicache_core.pools import PageAllocator
from hicache_core.radix_tree import TreeNode
from hicache_core.side_pools import PoolPages
from hicache_core.storage_calls import StorageHealth, guarded_call, leading_successes

log = logging.getLogger(__name__)


@dataclass(eq=False)
class BackupOp:
    """One node's storage backup: its pages of every pool (the FULL KV's first, when it has any)."""

    node: TreeNode
    #: Where ``node`` started when queued: the range its host pages are protected over.
    begin: int
    pools: list[PoolPages]
    stored_pages: int = 0


#: The longest a backup batch waits for reads (then it goes anyway: backups are never starved).
YIELD_LIMIT_S = 0.5
YIELD_POLL_S = 0.002
#: Pages read back after a put while the store's reads are not timed (see ``_probe_reads``).
PROBE_PAGES = 4


class StorageBackup:
    """The backup thread and its queue; acknowledgements come back in completion order.

    Backups yield to reads: while loading a page from the store costs more than computing it
    (``cost``, with pages of ``page_tokens``) and ``reads_pending``, a batch waits for the reads
    (at most ``YIELD_LIMIT_S``; counted in ``storage_backup_yield_seconds``)."""

    def __init__(
        self,
        metrics: CacheMetrics,
        batch_pages: int,
        suspects: PageSet,
        pin_cap: PinCap,
        *,
        stored: PageSet,
        writing: PageSet | None = None,
        cost: CostModel,
        page_tokens: int,
        reads_pending: Callable[[], bool],
        wakeup: Wakeup | None = None,
    ) -> None:
        self.metrics = metrics
        self.batch_pages = batch_pages
        self.suspects = suspects
        #: The FULL pool's pages known stored (the prefetcher's record; see ``Prefetcher.stored``).
        self.stored = stored
        #: The FULL pool's pages of the ops submitted and not taken back (``Prefetcher.writing``).
        self.writing = writing if writing is not None else PageSet()
        self.pin_cap = pin_cap
        self.cost = cost
        self.page_tokens = page_tokens
        self.reads_pending = reads_pending
        #: Ops submitted and not taken back yet, and their FULL pages (the backlog's size).
        self.outstanding = 0
        self.queued_pages = 0
        #: Resident buffers the read probe reads into (made on first use).
        self._probe_buffers: list[Any] = []
        #: The allocators whose pages submitted ops pin: ``_rest`` ends while one has an alloc waiting.
        self._allocators: list[PageAllocator] = []
        self._thread: OpThread[BackupOp] = OpThread("hicache-backup", wakeup)
        self._acks: queue.SimpleQueue[BackupOp] = queue.SimpleQueue()

    def start(self, store: MultiPoolStore, health: StorageHealth, *, writer: bool) -> None:
        """Store ops into ``store`` on a new thread (``writer=False``: acknowledge without storing)."""
        self._thread.start(lambda op: self._serve(store, health, writer, op))

    def stop(self) -> None:
        """Queued ops finish (each call bounded by the storage timeout), then the thread exits."""
        self._thread.stop()

    @property
    def thread_alive(self) -> bool:
        return self._thread.alive

    def submit(self, op: BackupOp) -> None:
        for pages in op.pools:
            pages.pin()
            if all(pages.allocator is not known for known in self._allocators):
                self._allocators.append(pages.allocator)
        self.outstanding += 1
        if op.pools:
            self.queued_pages += len(op.pools[0].hashes)
            self.writing.add(op.pools[0].hashes)
        self._thread.put(op)

    def acknowledged(self) -> int:
        """Ops completed and not taken yet (this rank's count; the caller agrees on one)."""
        return self._acks.qsize()

    def take(self) -> BackupOp:
        """The next completed op (one is ``acknowledged``)."""
        self.outstanding -= 1
        op = self._acks.get()
        if op.pools:
            self.queued_pages -= len(op.pools[0].hashes)
            self.writing.forget(op.pools[0].hashes)
        return op

    def _serve(self, store: MultiPoolStore, health: StorageHealth, writer: bool, op: BackupOp) -> None:
        try:
            if writer:
                if health.allows_call():
                    self._run(store, health, op)
                elif not health.failed:
                    self.metrics.add(storage_backup_skipped_unhealthy=1)
        except Exception:  # never let one failure stop later backups
            log.exception("storage backup of %d pages failed", sum(len(p.hashes) for p in op.pools))
            self.metrics.add(storage_errors=1)
        finally:
            # A put that timed out may still read the pages: they stay pinned until it returns.
            for pages in op.pools:
                pages.unpin()
            self._acks.put(op)

    def _run(self, store: MultiPoolStore, health: StorageHealth, op: BackupOp) -> None:
        started = time.perf_counter()
        for pages in op.pools:
            if not self._store_pages(store, health, op, pages):
                break
        self.metrics.add(storage_backup_ops=1, storage_backup_seconds=time.perf_counter() - started)

    def _store_pages(self, store: MultiPoolStore, health: StorageHealth, op: BackupOp, pool: PoolPages) -> bool:
        """Store the pages of one pool the store lacks, and rewrite those a read found bad;
        whether every page is stored. A page stored here stops being suspect."""
        keys = store.keys(pool.pool, pool.hashes)
        present = guarded_call(self.metrics, lambda: store.store.prefix_exists(keys), 0, "exists", health=health)
        suspects = self.suspects
        rewrite = suspects.among(pool.hashes[:present]) if pool.rewrite_suspects else []
        op.stored_pages += present - len(rewrite)
        if pool.rewrite_suspects:
            self.stored.add(pool.hashes[:present])
        self.metrics.add(storage_backup_skipped_pages=present - len(rewrite))
        pages = [*rewrite, *range(present, len(keys))]
        begin = 0
        while begin < len(pages):
            want = min(self.batch_pages, len(pages) - begin)
            capped = pool.allocator is self.pin_cap.allocator
            granted = self.pin_cap.acquire(want) if capped else want
            batch = pages[begin : begin + want]
            begin += want
            self._yield_to_reads(pool.page_bytes)
            called = time.perf_counter()
            if granted:
                try:
                    results = guarded_call(
                        self.metrics,
                        lambda: store.store.put_from([keys[i] for i in batch], [pool.buffers[i] for i in batch]),
                        None,
                        "put",
                        lambda exc: pool.abandon(batch, exc),
                        health=health,
                    )
                finally:
                    if capped:
                        self.pin_cap.release(granted)
            else:  # pages pinned by abandoned calls are at their cap: write from a private copy
                self.metrics.add(storage_staged_calls=1)
                sources = [private_copy(pool.buffers[i], fill=True) for i in batch]
                results = guarded_call(
                    self.metrics, lambda: store.store.put_from([keys[i] for i in batch], sources), None, "put", lambda exc: None, health=health
                )
            stored = leading_successes(results)
            took = time.perf_counter() - called
            if results is not None and stored == len(batch):
                self.cost.record_write(stored * pool.page_bytes, took)
                if capped and self.cost.adaptive and not self.cost.reads_timed:
                    self._probe_reads(store, health, [keys[i] for i in batch], [pool.buffers[i] for i in batch])
            self._keep_duty(pool.page_bytes, took)
            if pool.rewrite_suspects:
                suspects.forget(pool.hashes[i] for i in batch[:stored])
                self.stored.add(pool.hashes[i] for i in batch[:stored])
            op.stored_pages += stored
            self.metrics.add(storage_backup_pages=stored, storage_backup_bytes=stored * pool.page_bytes)
            if results is None or stored < len(results):
                self.metrics.add(storage_backup_failed_batches=1)
                return False
        return True

    def _probe_reads(self, store: MultiPoolStore, health: StorageHealth, keys: list[Any], like: list[Any]) -> None:
        """Read back a few pages just written, into buffers of the thread's own, to time the
        store's reads: the cost model needs them before an engine's first loads (reads from a
        store too slow to load from would otherwise go untimed while write-through fills it)."""
        count = min(PROBE_PAGES, len(keys))
        while len(self._probe_buffers) < count:
            self._probe_buffers.append(private_copy(like[len(self._probe_buffers)], fill=True))  # resident: written once
        called = time.perf_counter()
        results = guarded_call(self.metrics, lambda: store.store.get_into(keys[:count], self._probe_buffers[:count]), None, "get", health=health)
        if results is not None and all(results):
            page_bytes = sum(s.numel() * s.element_size() for s in (like[0] if isinstance(like[0], (list, tuple)) else [like[0]]))
            self.cost.record_read(count * page_bytes, time.perf_counter() - called)

    def _keep_duty(self, page_bytes: int, took: float) -> None:
        """While the store is the slow leg, a store k times slower to load a page from than to
        compute it gives backups 1/k of its time: after a put of ``took`` seconds the thread rests
        ``took x (k - 1)``. Its queue then grows, and write-through defers what it cannot take
        (``CacheController._defers``): pages nobody is likely to load (loads from a slow store
        take only the head a busy engine has time for) do not cost the engine's machine."""
        if not self.cost.store_is_slow_leg(page_bytes, self.page_tokens):
            return
        load = self.cost.load_s_per_page(page_bytes)
        compute = self.cost.compute_s_per_page(self.page_tokens)
        assert load is not None and compute is not None  # both timed: the store is the slow leg
        self._rest(min(took * (load / compute - 1.0), YIELD_LIMIT_S), lambda: True)

    def _yield_to_reads(self, page_bytes: int) -> None:
        """Wait while reads are pending and the store is the slow leg (see the class docstring)."""
        if not self.cost.store_is_slow_leg(page_bytes, self.page_tokens):
            return
        self._rest(YIELD_LIMIT_S, self.reads_pending)

    def _rest(self, longest: float, wait: Callable[[], bool]) -> None:
        """Sleep while ``wait()``, at most ``longest`` seconds, and never while an alloc waits for
        pages the backups pin (``PageAllocator.awaited``: the pages of a node deleted while its
        backup was queued are free once it is written). That alloc is the scheduler's: every
        request waits inside it, so a rest then costs the whole engine its length."""
        started = time.perf_counter()
        waited = 0.0
        while waited < longest and wait() and not any(allocator.awaited for allocator in self._allocators):
            time.sleep(min(YIELD_POLL_S, longest - waited))
            waited = time.perf_counter() - started
        if waited:
            self.metrics.add(storage_backup_yield_seconds=waited)
