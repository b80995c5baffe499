"""The cache controller: moves KV between the tiers on the scheduler's behalf.

* **Write policies** (device -> host): ``write_through`` backs a node up when it is inserted,
  ``write_through_selective`` once it has been hit ``selective_hits`` times (default 2),
  ``write_back`` only when it is evicted from the device. The copies are the controller's host
  writer's (``host_writer``, :mod:`hicache_core.host_writes`).
* **Backup** (host -> storage): queued when a device -> host copy completes, run by the backup
  thread (:mod:`hicache_core.backup`) in batches of at most ``batch_pages``; pages already
  stored (a live ``prefix_exists``) are skipped, except pages a prefetch found unreadable
  (rewritten), and the first failed batch ends the operation. Only ``shard.is_writer`` ranks write.
* **Prefetch** (storage -> host): see :mod:`hicache_core.prefetch` (``controller.prefetcher``).
* **Load back** (host -> device) layer by layer; see :mod:`hicache_core.transfer`.
* **Buffer-only**: host memory only stages pages on their way to and from storage.
* **Components** (hybrid models, :mod:`hicache_core.side_pools`): every operation above moves
  each component's state of its nodes too, each in its own L3 pool (``MultiPoolStore``);
  ``backfill`` backs up state that appears on a node already backed up.

Threads and safety. The scheduler thread owns the tree and calls every public method here. The
backup and prefetch threads touch only pool memory they were handed (pinned in the allocator
while I/O is in flight, so no page is freed or reused under a transfer) and report back through
queues; ``poll`` applies their results. Both threads survive any exception from the backend
(logged and counted); a store that hangs is bounded by the SDK's timeout layer
(``storage_timeout_s``). Store health is a state: ``breaker.failures_to_open`` consecutive
timeouts or temporary errors open the store's breaker (:mod:`hicache_storage.health`): no data
calls (a prefetch finds nothing at once, a backup is skipped and counted), an ``exists`` of one
key as a probe on a backoff, calls again once it answers; one log line and one counter
(``storage_breaker_opened`` / ``_closed``) per transition. Host pages pinned by calls that timed
out and may never return stay under ``abandoned_pages_fraction`` of the host pool
(:mod:`hicache_core.pin_cap`). A store that fails permanently (bad credentials, a connector breaking the
contract, retries exhausted) is given up until it is detached and attached again: both threads
skip their work without calling it, said once in the log and in the ``storage_disabled`` counter
(see :class:`~hicache_core.storage_calls.StorageHealth`). With tensor parallelism every timing-dependent decision is agreed
(see :mod:`hicache_core.tp`).
"""

from __future__ import annotations

import enum
import functools
import logging
import time
from dataclasses import dataclass, field

import torch

from hicache_storage.connector import Level
from hicache_storage.cost import CostConfig, CostModel
from hicache_storage.health import BreakerConfig, BreakerState, CircuitBreaker
from hicache_storage.keys import KeyScope
from hicache_storage.multipool import MultiPoolStore, PoolSpec
from hicache_storage.layers import stack_layers
from hicache_storage.store import Store

from hicache_core.backup import BackupOp, StorageBackup
from hicache_core.host_writes import HostWriter
from hicache_core.metrics import CacheMetrics
from hicache_core.op_thread import Wakeup
from hicache_core.pin_cap import PinCap
from hicache_core.pools import DevicePool, HostPool
from hicache_core.prefetch import PrefetchConfig, Prefetcher, StopPolicy
from hicache_core.radix_tree import InsertResult, MatchResult, RadixTree, TreeNode
from hicache_core.side_pools import PoolPages, backup_pages, tiered, unsaved_state
from hicache_core.storage_calls import StorageHealth
from hicache_core.tp import TPContext
from hicache_core.transfer import LayerLoad, Transfers

log = logging.getLogger(__name__)

# StopPolicy and PrefetchConfig live in hicache_core.prefetch; re-exported as part of the controller's config.
__all__ = ["CacheController", "ControllerConfig", "PrefetchConfig", "StopPolicy", "WritePolicy"]


class WritePolicy(str, enum.Enum):
    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


@dataclass(frozen=True)
class ControllerConfig:
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    buffer_only: bool = False
    selective_hits: int = 2
    batch_pages: int = 128
    #: Longest wait for one storage call; ``None`` trusts the backend's own timeouts (zero-copy).
    storage_timeout_s: float | None = 5.0
    kernel_backend: str | None = None
    #: Back up a component's state that appears on a node already backed up (a branch point's
    #: recurrent checkpoint): without it nothing copies that state to the host and L3.
    backfill: bool = True
    #: When the store counts as unhealthy (no data calls) and how it is probed.
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    #: Load or recompute: which stored pages a prefetch reads (``cost.policy``: ``cost``, the
    #: pages that arrive before computing them would be done, or ``all``), and when write-through
    #: to storage yields to reads (see :mod:`hicache_storage.cost`).
    cost: CostConfig = field(default_factory=CostConfig)
    #: Write-through degrades to selective (see ``CacheController._defers``) while the storage
    #: backups queued would take longer than this to write at the store's measured speed.
    backup_lag_s: float = 1.0
    #: The most host pages that storage calls abandoned on a timeout may pin, as a fraction of
    #: the host pool; at the cap, calls go through private buffers (a copy) instead. (Applies
    #: with ``storage_timeout_s``; without it no call is abandoned.)
    abandoned_pages_fraction: float = 0.25

    def __post_init__(self) -> None:
        if not 0.0 <= self.abandoned_pages_fraction <= 1.0:
            raise ValueError(f"abandoned_pages_fraction must be between 0 and 1, got {self.abandoned_pages_fraction}")


@dataclass(eq=False)
class _IssuedLoad:
    """A host -> device load ``load_back`` issued: the host pages of ``target``'s path from token
    ``begin`` are protected until it is released; ``used`` once its request is done with it."""

    load: LayerLoad
    target: TreeNode
    begin: int
    nodes: list[TreeNode]
    used: bool | None = None


class CacheController:
    def __init__(
        self,
        config: ControllerConfig,
        tree: RadixTree,
        device: DevicePool,
        host: HostPool | None = None,
        *,
        metrics: CacheMetrics | None = None,
        tp: TPContext | None = None,
        compute_tokens_per_s: float | None = None,
        wakeup: Wakeup | None = None,
    ) -> None:
        self.config = config
        self.tree = tree
        self.device = device
        self.host = host
        self.metrics = metrics or CacheMetrics()
        self.tp = tp or TPContext()
        self.page_size = device.page_size
        #: The speeds of the store, the copies and the compute, and the compute queued: what a
        #: prefetch loads and when backups yield (the engine reports its compute to it).
        self.cost = CostModel(config.cost, compute_tokens_per_s=compute_tokens_per_s)
        #: Notified when a copy, load, prefetch or backup ends: the scheduler waits on it (``Engine.step``).
        self.wakeup = wakeup or Wakeup()
        self.transfers = Transfers(device, host, config.kernel_backend, self.wakeup) if host is not None else None
        self.storage: Store | None = None
        self.scope: KeyScope | None = None
        #: Components whose state moves with the FULL KV (none for a FULL-only model).
        self.components = tiered(tree.components)
        self.store: MultiPoolStore | None = None
        #: Whether the attached store is still called; a fresh one per attachment.
        self.storage_health: StorageHealth | None = None
        #: Device -> host copies and storage backups applied so far (agreed across ranks).
        self.completions = 0
        #: While the store is the slow leg, pages a write-through backup may still write: each
        #: node offered earns the share of stored pages loads take (``CostModel.load_share``).
        self._write_credit = 0.0
        #: Host -> device loads issued and not released yet (``loads_done``), in the order they land.
        self._loads: list[_IssuedLoad] = []
        #: Device -> host copies (none without a host pool).
        self.host_writer = (
            HostWriter(
                tree,
                host,
                self.transfers,
                page_size=self.page_size,
                components=self.components,
                metrics=self.metrics,
                ranks=self.tp.scheduler,
                alloc_host=self.alloc_host,
                on_copied=self._queue_storage_backup,
                make_room=self._wait_for_staging if config.buffer_only else None,
            )
            if host is not None and self.transfers is not None
            else None
        )
        #: Room for host pages that abandoned storage calls pin (see ``abandoned_pages_fraction``);
        #: without a storage timeout the controller abandons no call, so there is no cap.
        cap = None if config.storage_timeout_s is None or host is None else int(host.num_pages * config.abandoned_pages_fraction)
        self.pin_cap = PinCap(host.allocator, cap) if host is not None else None
        self.prefetcher = (
            Prefetcher(
                config.prefetch,
                tree,
                host,
                functools.partial(self.alloc_host, wait=False),
                metrics=self.metrics,
                tp=self.tp,
                batch_pages=config.batch_pages,
                pin_cap=self.pin_cap,
                cost=self.cost,
                wakeup=self.wakeup,
            )
            if host is not None and self.pin_cap is not None
            else None
        )
        self.backup = (
            StorageBackup(
                self.metrics,
                config.batch_pages,
                self.prefetcher.suspects,
                self.prefetcher.pin_cap,
                stored=self.prefetcher.stored,
                writing=self.prefetcher.writing,
                cost=self.cost,
                page_tokens=self.page_size,
                reads_pending=self.prefetcher.reads_pending,
                wakeup=self.wakeup,
            )
            if self.prefetcher
            else None
        )

    # --- storage attachment -------------------------------------------------------------------

    def attach_storage(self, storage: Store | Level, scope: KeyScope) -> None:
        """Start using ``storage`` as L3 (needs a host pool); starts the backup and prefetch threads.

        ``storage`` is a store, or a connector or layer to hold one over (:meth:`storage_stack`).
        Each attachment starts with a fresh :class:`StorageHealth`: a store given up after a
        permanent error is called again once it is detached and attached anew.
        """
        if self.host is None:
            raise ValueError("storage (L3) needs a host pool (L2) to stage pages in")
        if self.storage is not None:
            raise RuntimeError("a storage backend is already attached; detach it first")
        given_name = storage.name
        attached = self.storage_stack(storage)
        try:
            attached.register_buffer(self.host.as_buffer())
        except Exception:  # registration is an optimization: a store that refuses it still works
            log.exception("registering the host pool with %s failed; continuing without", attached.name)
        self.storage, self.scope = attached, scope
        pools = [PoolSpec(scope.part), *(c.pool_spec(self.page_size) for c in self.components)]
        store = self.store = MultiPoolStore(attached, scope, pools)
        probe_key = scope.key("0" * 64)
        breaker = CircuitBreaker(
            given_name, lambda: attached.exists([probe_key]), self.config.breaker, on_transition=self._count_transition
        )
        health = self.storage_health = StorageHealth(self.metrics, given_name, breaker)
        assert self.backup is not None and self.prefetcher is not None
        self.backup.start(store, health, writer=scope.shard.is_writer)
        self.prefetcher.start(scope, health, store)

    def _count_transition(self, old: BreakerState, new: BreakerState) -> None:
        if new is BreakerState.OPEN:
            self.metrics.add(storage_breaker_opened=1)
        else:
            self.metrics.add(storage_breaker_closed=1)

    def storage_stack(self, storage: Store | Level) -> Store:
        """The store the controller calls: ``storage`` with every call bounded within ``storage_timeout_s``.

        A stack that does not bound its calls itself (``capabilities.bounded_calls``: a connector
        with client timeouts of its own, or a timeout among its layers) goes behind a zero-copy
        timeout layer (``hicache_storage.layers.stack_layers``, the stack builder every caller
        uses), and the controller holds a new store over it. Zero-copy because the controller
        keeps the host pages of a call that timed out pinned until the call really returns
        (``StorageTimeoutError.when_settled``), so pages move between the host pool and the store
        without a staging copy. A store given that needs no layer is used as it is.
        """
        store = storage if isinstance(storage, Store) else Store(storage)
        if self.config.storage_timeout_s is None:
            return store
        top = stack_layers(store, (), default_timeout={"seconds": self.config.storage_timeout_s, "zero_copy": True})
        return store if top is store.top else Store(top)

    def detach_storage(self) -> Store | None:
        """Stop using L3: queued backups and prefetches finish (bounded by the timeout), then the threads exit.

        Returns the store as the controller held it (over a timeout layer when one was added);
        the caller closes it. Prefetches still held by requests stay consumable.
        """
        backend = self.storage
        if backend is None:
            return None
        self.storage = None
        assert self.backup is not None and self.prefetcher is not None
        if self.storage_health is not None and self.storage_health.breaker is not None:
            self.storage_health.breaker.close()
        self.backup.stop()
        self.prefetcher.stop()
        self.drain()
        return backend

    @property
    def threads_alive(self) -> bool:
        """Whether the backup and prefetch threads both run (a storage backend is attached)."""
        return self.backup is not None and self.backup.thread_alive and self.prefetcher is not None and self.prefetcher.thread_alive

    @property
    def io_pending(self) -> bool:
        """Whether copies or backups are in flight (their completion may make memory evictable):
        among them the loads to the device whose requests are done with them (``loads_done``),
        whose host pages ``poll`` releases once they land; not those of a start under way."""
        writer = self.host_writer
        loads = any(entry.used is not None for entry in self._loads)
        return loads or (writer is not None and writer.in_flight) or (self.backup is not None and self.backup.outstanding > 0)

    # --- device and host memory ---------------------------------------------------------------

    def alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        """Whole pages for ``num_tokens`` device slots, evicting LRU nodes if needed; None if impossible."""
        backup = self._backup_on_evict if self.config.write_policy is WritePolicy.WRITE_BACK and self.host else None

        def evict(tokens: int) -> None:
            self.metrics.add(device_evicted_tokens=self.tree.evict_device(tokens, backup))

        return self.device.allocator.alloc_evicting(num_tokens, evict)

    def alloc_host(self, num_tokens: int, *, wait: bool = True) -> torch.Tensor | None:
        """Host slots for ``num_tokens``, evicting cached host copies rather than waiting for the
        backups that pin freed pages (see ``PageAllocator.alloc_evicting``); only where eviction
        cannot free enough does it wait for that I/O, or, with ``wait=False`` (the prefetcher's
        reservations: the request tries again at a later step), return None."""
        assert self.host is not None

        def evict(tokens: int) -> None:
            self.metrics.add(host_evicted_tokens=self.tree.evict_host(tokens))

        return self.host.allocator.alloc_evicting(num_tokens, evict, self.tp.scheduler.all_max, wait=wait)

    # --- writes: device -> host -> storage ----------------------------------------------------

    def on_insert(self, result: InsertResult) -> None:
        """Apply the write policy to the nodes of the inserted path (and backfill components)."""
        writer = self.host_writer
        if writer is None:
            return
        policy = self.config.write_policy
        for node in self.tree.path(result.last_node):
            if node.host_value is not None:
                if node.backup_deferred and node.hit_count >= self.config.selective_hits:
                    self._queue_storage_backup(node)  # hit again: selective backs it up now
                if self.config.backfill and self.components:
                    self._backfill(node)
                continue
            if node.device_value is None or policy is WritePolicy.WRITE_BACK:
                continue
            if node.stored and self.storage is not None and not unsaved_state(node, self.components):
                # Its host copy was evicted after it reached L3 (a running request's copy gives
                # way to prefetches): copying it again would only find it stored.
                continue
            if policy is WritePolicy.WRITE_THROUGH or node.hit_count >= self.config.selective_hits:
                writer.write(node)

    def _backup_on_evict(self, node: TreeNode) -> bool:
        """Write-back: copy an evicted node to the host before its device copy goes."""
        assert self.host_writer is not None
        return self.host_writer.write(node, wait=True)

    def _wait_for_staging(self) -> bool:
        """Buffer-only, no host page free: wait for the pages on their way to storage (whether there were any)."""
        if not self.io_pending:
            return False
        self.drain()
        return True

    def _backfill(self, node: TreeNode) -> None:
        """Back up components' state that appeared on ``node`` after its FULL KV was backed up."""
        backed_up = [c for c in self.components if c.back_up(node)]
        if backed_up:
            self._queue_storage_backup(node, full=False)

    def _queue_storage_backup(self, node: TreeNode, *, full: bool = True) -> None:
        """Queue ``node``'s host pages of every pool for storage (only its components' with
        ``full=False``). A rank that does not write (replicated MLA KV) queues an operation
        anyway: every rank must protect and release the same host pages at the same agreed
        points, or their trees would diverge."""
        if self.storage is None or node.host_value is None:
            return
        if full and self._defers(node):
            node.backup_deferred = True
            self.metrics.add(storage_backup_deferred=1)
            return
        node.backup_deferred = False
        assert self.host is not None and self.scope is not None
        pools = backup_pages(node, self.components)
        if full:
            slots = node.host_value.clone()
            kv = PoolPages(self.scope.part, list(node.page_hashes), self.host.segments_for(slots), slots, self.host.allocator, True)
            pools.insert(0, kv)
        begin = node.end - len(node.key)
        self.tree.protect_host(node, begin)
        if full:
            node.stored = True
        assert self.backup is not None
        self.backup.submit(BackupOp(node, begin, pools))

    def _defers(self, node: TreeNode) -> bool:
        """Whether ``node``'s storage backup waits for its next hit (agreed by every rank):
        write-through degrades towards selective while the store lags. It lags when the backups
        queued would take it longer than ``backup_lag_s`` to write (no node is queued then), or
        when loading a page from it costs more than computing it: then loads take only the head
        a busy engine's compute hides (``CostModel.load_share`` of the stored pages), and a
        backup only serves loads to come, so a node waits until it was hit ``selective_hits``
        times and its pages fit the write credit the nodes offered so far earned at that share
        (a store whose pages are seldom loaded is seldom written)."""
        config = self.config
        if config.write_policy is not WritePolicy.WRITE_THROUGH or config.buffer_only or not self.cost.adaptive:
            return False
        assert self.host is not None and self.backup is not None
        page_bytes = self.host.page_bytes
        write_s = self.cost.write_s_per_byte()
        lags = write_s is not None and self.backup.queued_pages * page_bytes * write_s > config.backup_lag_s
        share = 1.0
        if not lags and self.cost.store_is_slow_leg(page_bytes, self.page_size):
            share = self.cost.load_share(page_bytes, self.page_size)
            pages = len(node.page_hashes)
            lags = node.hit_count < config.selective_hits or self._write_credit + share * pages < pages
        defers = bool(self.tp.scheduler.all_max(int(lags)))
        if share < 1.0:  # the pages offered earn the share loads take; a write spends its pages
            pages = len(node.page_hashes)
            self._write_credit = min(self._write_credit + share * pages - (0 if defers else pages), float(config.batch_pages))
        return defers

    def _drop_staging(self, node: TreeNode, *, components: bool = True) -> None:
        """Buffer-only: the host copy was only staging; free it once nothing reads it (with
        ``components=False`` the components' host state stays: it may be their only copy)."""
        # A locked node is in use by a request: its host copy may go once the device holds the KV.
        if node.device_value is not None:
            free = node.host_io == 0
        else:
            free = node.host_ref == 0 and node.lock_ref == 0
        if node.host_value is not None and free:
            for component in self.components if components else ():
                component.drop(node, device=False)
            self.tree.drop_host_value(node)

    # --- host -> device ----------------------------------------------------------------------

    def load_back(self, match: MatchResult, node: TreeNode | None = None) -> tuple[TreeNode, LayerLoad | None]:
        """Bring the host part of ``match`` (down to ``node``, a node of the match: by default
        its end) to the device, layer by layer.

        Locks and returns the deepest node now usable (``node`` on success, or an ancestor on
        the device when ``node`` lies above the device part, else the device node when device
        memory could not be found), and the load to wait on (None when nothing is loaded). The
        caller unlocks the node when the request is done.
        """
        target = match.host_node if node is None else node
        if target.end <= match.device_hit_length or self.transfers is None:
            # A fallback to the device part resumes where every component accepts (a checkpoint
            # or window may be missing at its end); for a FULL-only model that is the node itself.
            usable = target if target.end <= match.device_hit_length else self.tree.resume_point(match.device_node, on_device=True)
            self.tree.lock(usable)
            return usable, None
        self.tree.lock(target)  # keeps the host copies and the device prefix during the load
        slots = self.alloc_device(target.end - match.device_hit_length)
        if slots is None:
            self.tree.unlock(target)
            usable = self.tree.resume_point(match.device_node, on_device=True)
            self.tree.lock(usable)
            return usable, None
        nodes = self.tree.path(target, below=match.device_node)
        host_parts, offset = [], 0
        for node in nodes:
            assert node.host_value is not None and node.device_value is None
            node.device_value = slots[offset : offset + len(node.key)]
            host_parts.append(node.host_value)
            offset += len(node.key)
        device_indices = slots[:offset]
        host_indices = torch.cat(host_parts)
        bytes_moved = offset * self.device.geometry.token_bytes

        def on_done(load: LayerLoad) -> None:
            self.metrics.add(load_back_tokens=load.tokens, load_back_bytes=bytes_moved, load_back_seconds=load.seconds)
            if load.error is None:
                self.cost.record_copy(bytes_moved, load.seconds)

        load = self.transfers.load(device_indices, host_indices, on_done)
        # The lock keeps the nodes; this keeps the host pages the load reads (a locked node's host
        # copy may otherwise go once its KV is on the device: see ``_host_evictable``).
        self.tree.protect_host(target, match.device_hit_length)
        self._loads.append(_IssuedLoad(load, target, match.device_hit_length, nodes))
        return target, load

    def loads_done(self, *, used: bool = True, wait: bool = True) -> None:
        """The request the loads issued since the last call were for is done with them (it
        started, or gave up its start): once they have landed, their host pages are free to
        evict again, and in buffer-only mode the FULL staging they read is freed. ``used``: the
        request computed from them, so its components' staging goes too; a request that gave up
        its start (no memory) keeps that, as a component's state (a checkpoint) may live only
        there until the request starts. ``wait``: wait for every load now; else each is released
        by ``poll`` once it has landed (on every rank), and the scheduler goes on meanwhile."""
        for entry in self._loads:
            if entry.used is None:
                entry.used = used
        if wait:
            self._release_loads(len(self._loads))

    def _release_loads(self, count: int) -> None:
        for entry in self._loads[:count]:
            entry.load.wait_all()
            self.tree.release_host(entry.target, entry.begin)
            if self.config.buffer_only and self.storage is not None:
                for node in entry.nodes:
                    self._drop_staging(node, components=bool(entry.used))
        del self._loads[:count]
        self.completions += count

    def _release_landed_loads(self) -> None:
        """Release the loads done with (``loads_done``) that have landed on every rank, in order."""
        landed = 0
        for entry in self._loads:
            if entry.used is None or not entry.load.landed():
                break
            landed += 1
        self._release_loads(self.tp.scheduler.all_min(landed))

    # --- progress ----------------------------------------------------------------------------

    def poll(self) -> None:
        """Apply finished device -> host copies, storage backups and prefetches left to land (counts agreed across ranks)."""
        if self.host_writer is not None:
            self.completions += self.host_writer.acknowledge()
        if self._loads:  # (the same list on every rank: the same collectives)
            self._release_landed_loads()
        if self.prefetcher is not None:
            self.prefetcher.land()
        backup = self.backup
        ready = self.tp.scheduler.all_min(backup.acknowledged()) if backup is not None else 0
        self.completions += ready
        for _ in range(ready):
            assert backup is not None
            op = backup.take()
            parent = op.node.parent
            self.tree.release_host(op.node, op.begin)
            if self.config.buffer_only:
                self._drop_staging(op.node)
                # A split may have moved part of the staged pages into ancestors: free those too.
                while parent is not None and parent is not self.tree.root:
                    above = parent.parent
                    self._drop_staging(parent)
                    parent = above

    def drain(self, poll_interval_s: float = 0.001) -> None:
        """Wait until every queued device -> host copy and storage backup has completed and been applied."""
        while True:
            self.poll()
            busy = self.tp.scheduler.all_max(int(self.io_pending))
            if not busy:
                return
            time.sleep(poll_interval_s)

    def flush(self) -> None:
        """Empty L1 and L2 (after finishing every backup); storage keeps its pages."""
        backup = self._backup_on_evict if self._write_back_to_host else None
        while True:
            # Write-back evictions queue backups that protect host pages (and their ancestors)
            # until acknowledged, so alternate until a whole pass frees nothing.
            self.drain()
            device = self.tree.evict_device(1 << 62, backup)
            self.drain()
            host = self.tree.evict_host(1 << 62) if self.host is not None else 0
            self.metrics.add(device_evicted_tokens=device, host_evicted_tokens=host)
            if device == 0 and host == 0:
                return

    @property
    def copies_on_insert(self) -> bool:
        """Whether an insert may start device -> host copies (every write policy but write-back)."""
        return self.host_writer is not None and not self._write_back_to_host

    @property
    def _write_back_to_host(self) -> bool:
        return self.host is not None and self.config.write_policy is WritePolicy.WRITE_BACK

    def close(self) -> None:
        backend = self.detach_storage()
        if backend is not None:
            backend.close()
        if self.transfers is not None:
            self.transfers.close()

