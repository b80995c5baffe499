"""Storage -> host prefetch: plan, rate-limit, query and read on the prefetch threads, stop by policy.

A request whose prompt continues past its cached prefix by at least ``threshold_tokens`` gets a
:class:`PrefetchOp` for the pages after the prefix (keys continue the prefix's hash chain). The
op is issued when the host pages it needs fit the in-flight capacity; a rate-limited op keeps
its place and is issued on a later try. The query thread asks the store ``prefix_exists``
(live, never cached) and revokes the op below the threshold, so a request whose pages the store
lacks does not wait behind other requests' reads; the read thread reads in batches of at most
``batch_pages``, each batch's leading successes only, stopping at the first failed batch. A page
the store reported yet failed to read (corrupted, truncated, gone) is remembered in
:attr:`Prefetcher.suspects`, so the next backup of that page rewrites it instead of skipping it
as present. The scheduler stops waiting by the stop policy: ``best_effort`` (take what
arrived once the first batch is back, and never wait longer than ``best_effort_wait_s`` after
the op was planned: an op whose read is under way but has nothing back then is left to *land*,
its pages put into the tree when it ends, so a refetch under way is not thrown away), ``wait_complete``, or
``timeout`` (``min(max, base + per_ki * tokens / 1024)`` seconds after the thread began the op),
then puts the completed pages into the tree as host copies.

Store health: while the store's breaker is open (:mod:`hicache_storage.health`) an op is
answered "nothing stored" at once, with no host pages taken and no call made
(``prefetch_skipped_unhealthy``). A read pins host pages only within the room the
:class:`~hicache_core.pin_cap.PinCap` grants (pages pinned by abandoned calls stay under their
cap); without room it reads into private buffers and copies them in. A read that timed out keeps
only its own batch's pages pinned until it returns; the op's other pages are released at once.

Components (hybrid models): the op restores the longest cut every pool accepts
(``MultiPoolStore.restorable_pages``) and reads each component's trailing pages before that
cut with the FULL pages (:class:`~hicache_core.side_pools.SideFetch`); their state is placed at
the cut only when every rank read all of it and every FULL page up to the cut. Their host slots
are reserved when the op is issued: short of them, the op waits as for FULL pages. Such a cut may
lie past the capacity, so a hybrid op covers what the host pool holds, and one longer than the
capacity runs alone (``try_issue``).

Page safety: the read thread pins an op's host pages in the allocator when it begins the op and
until it is done with them, so pages freed by an early stop are not reused while a read may still
land in them; an op stopped before the read thread began it is never read, and its pages are
free at once (nothing waits for a read queued behind a hung call).

Tensor parallelism: ranks agree on issuing (MAX of "rate-limited"), on the hit length (MIN, in
the thread's own group, for every op in issue order, even a stopped one), on stopping (MAX of
"keep waiting") and on the pages used (MIN).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hicache_storage.cost import CostModel, LoadPolicy
from hicache_storage.errors import StorageTimeoutError
from hicache_storage.keys import KeyScope, PageKey, page_hashes
from hicache_storage.multipool import MultiPoolStore
from hicache_storage.store import Store

from hicache_core.metrics import CacheMetrics
from hicache_core.op_thread import OpThread, Wakeup
from hicache_core.pin_cap import PinCap, copy_back, private_copy
from hicache_core.pools import HostPool
from hicache_core.radix_tree import MatchResult, RadixTree
from hicache_core.side_pools import SideFetch, lead_hashes, tiered
from hicache_core.storage_calls import StorageHealth, guarded_call, leading_successes
from hicache_core.page_sets import PageSet
from hicache_core.token_sequence import TokenSequence
from hicache_core.tp import TPContext

log = logging.getLogger(__name__)


#: Page hashes a prefetcher remembers as stored (about 60 bytes each).
STORED_PAGES_REMEMBERED = 1 << 16


class StopPolicy(str, enum.Enum):
    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class PrefetchConfig:
    threshold_tokens: int = 256
    #: ``timeout`` by default, as in SGLang 0.5.23 (``--hicache-storage-prefetch-policy``): it
    #: serves every page that arrives within its deadline. ``best_effort`` recomputed 10% of all
    #: prompt tokens more at the long-history bench shape (83.7% vs 93.0% hit) and tied at the
    #: short one (docs/benchmarks.md).
    stop_policy: StopPolicy = StopPolicy.TIMEOUT
    timeout_base_s: float = 2.0
    timeout_per_ki_token_s: float = 0.1
    timeout_max_s: float = 30.0
    #: ``best_effort``: the longest a request waits for its prefetch after it was planned.
    best_effort_wait_s: float = 0.25
    #: Most host pages prefetches may hold at once; default: half the host pool.
    capacity_pages: int | None = None

    def timeout_for(self, tokens: int) -> float:
        return min(self.timeout_max_s, self.timeout_base_s + self.timeout_per_ki_token_s * tokens / 1024)


class PrefetchState(str, enum.Enum):
    PLANNED = "planned"  # not issued yet (rate-limited requests stay here)
    RUNNING = "running"
    REVOKED = "revoked"  # the store had less than the threshold
    DONE = "done"
    FINISHED = "finished"  # consumed by the scheduler


@dataclass(eq=False)
class PrefetchOp:
    """One request's read of ``tokens[start:]`` from storage into host pages.

    ``tokens`` is what ``Prefetcher.plan`` was given, cut after the last page to read (a
    :class:`~hicache_core.token_sequence.TokenSequence` stays one, so the tree insert at
    ``finish`` reuses its page hashes); read on the scheduler thread only.
    """

    request_id: str
    tokens: Sequence[int]
    start: int
    hashes: list[str]
    state: PrefetchState = PrefetchState.PLANNED
    #: Pages after ``start`` the store holds (agreed by every rank); ``hit_pages`` of them are
    #: read: all, or the head the cost model found worth loading.
    stored_pages: int = 0
    #: Of ``hit_pages``, those the read thread has not read (or given up) yet.
    queued_read_pages: int = 0
    host_indices: torch.Tensor | None = None
    #: When ``Prefetcher.plan`` made the op: the ``best_effort`` bound's clock.
    planned_at: float = field(default_factory=time.monotonic)
    issued_at: float = 0.0
    #: Pages of the prefetch capacity the op holds until it is finished.
    reserved_pages: int = 0
    #: When the prefetch thread began the op (``None`` while it waits behind earlier ops): the
    #: ``timeout`` policy's clock, so time queued behind other requests' reads is not charged.
    started_at: float | None = None
    hit_pages: int = 0
    completed_pages: int = 0
    terminate: threading.Event = field(default_factory=threading.Event)
    #: Orders the read thread's pinning of the slots against ``finish`` freeing them.
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Set once the first batch of reads has returned (or the op ended without one).
    first_batch: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    #: Hybrid models: the hashes of the pages before ``start`` that components' trailing
    #: windows may need, and each component's read (see :mod:`hicache_core.side_pools`).
    lead_hashes: list[str] = field(default_factory=list)
    sides: list[SideFetch] = field(default_factory=list)
    #: ``Prefetcher._side_epoch()`` when this rank last found a component short of host slots for
    #: the op: it is not tried again (an eviction walk per try) until that changes.
    sides_short_at: tuple[int, ...] | None = None

    @property
    def pages(self) -> int:
        return len(self.hashes)


class Prefetcher:
    """Owns prefetch operations; the scheduler thread calls every public method, one thread reads."""

    def __init__(
        self,
        config: PrefetchConfig,
        tree: RadixTree,
        host: HostPool,
        alloc_host: Callable[[int], torch.Tensor | None],
        *,
        metrics: CacheMetrics,
        tp: TPContext,
        batch_pages: int,
        pin_cap: PinCap,
        cost: CostModel,
        wakeup: Wakeup | None = None,
    ) -> None:
        self.config = config
        self.tree = tree
        self.host = host
        #: Host pages for a number of tokens, evicting, without waiting for pages freed under I/O
        #: (``CacheController.alloc_host``): a reservation short of them tries again at a later
        #: step instead of holding the scheduler thread until storage backups return.
        self.alloc_host = alloc_host
        self.metrics = metrics
        self.tp = tp
        self.batch_pages = batch_pages
        self.pin_cap = pin_cap
        self.cost = cost
        self.page_size = host.page_size
        self.capacity = config.capacity_pages or max(1, host.num_pages // 2)
        self.pages_in_flight = 0
        self.storage: Store | None = None
        self.scope: KeyScope | None = None
        self.components = tiered(tree.components)
        #: Pages before a cut each component's window needs, and the longest of them.
        self._trailing: dict[str, int] = {}
        self.lead_pages = 0
        #: Two threads, so that a request whose pages the store lacks learns it at once instead of
        #: after every read queued before it: one asks the store what it holds (and revokes ops
        #: below the threshold), in issue order; the other reads, op after op.
        self._query_thread: OpThread[PrefetchOp] = OpThread("hicache-prefetch-query", wakeup)
        self._thread: OpThread[PrefetchOp] = OpThread("hicache-prefetch", wakeup)
        #: Told of each batch read too: a request may stop waiting once some of its pages are in.
        self.wakeup = wakeup
        #: Pages whose read failed although the store reported them; the backup rewrites them.
        self.suspects = PageSet()
        #: Pages this engine stored or read: known to be in the store without asking it (what a
        #: prefetch the cost model declined without a lookup would have found, at least).
        self.stored = PageSet(capacity=STORED_PAGES_REMEMBERED)
        #: Pages handed to this engine's backups and not taken back yet (``StorageBackup``).
        self.writing = PageSet(capacity=STORED_PAGES_REMEMBERED)
        #: The store keeps what it is given until it is deleted (no ``evicts`` capability): a page
        #: this engine wrote or read is there without asking (``_known_leading``).
        self._keeps_pages = False
        self._health: StorageHealth | None = None
        #: ``best_effort`` ops their requests stopped waiting for before anything arrived: their
        #: pages go into the tree when they end (``land``).
        self._landing: list[PrefetchOp] = []
        #: An op longer than the capacity waiting for the reads in flight to end (``_fits``).
        self._alone: PrefetchOp | None = None
        #: Pages handed to the read thread and not read yet: the reads a new op queues behind.
        self._reads_queued = 0
        self._reads_lock = threading.Lock()

    def start(self, scope: KeyScope, health: StorageHealth, store: MultiPoolStore) -> None:
        """Read from ``store``'s pools on a new thread; a prefetch finds nothing once ``health`` gave it up."""
        self.storage, self.scope, self._health = store.store, scope, health
        self._keeps_pages = not store.store.capabilities.evicts
        self._trailing = {c.name: store.pools[c.name].trailing_pages for c in self.components}
        self.lead_pages = max(self._trailing.values(), default=0)
        self._thread.start(lambda op: self._serve(self._read, store, health, op))
        self._query_thread.start(lambda op: self._serve(self._query, store, health, op))

    def stop(self) -> None:
        """Queued queries and reads finish (each call bounded by the storage timeout), then the threads exit."""
        self.storage = None
        self._query_thread.stop()
        self._thread.stop()

    @property
    def thread_alive(self) -> bool:
        return self._query_thread.alive and self._thread.alive

    def reads_pending(self) -> bool:
        """Whether pages are queued on the read thread (any thread may ask)."""
        return self._reads_queued > 0

    def plan(self, request_id: str, tokens: Sequence[int], match: MatchResult) -> PrefetchOp | None:
        """A prefetch for what follows ``match`` in ``tokens``, or None when it cannot reach the threshold.

        The keys continue the hash chain of the matched prefix (SGLang's). A
        :class:`~hicache_core.token_sequence.TokenSequence` with the pool's page size (the
        engine's) hands over the hashes it already holds; other sequences are hashed here.
        """
        if self.storage is None:
            return None
        ps = self.page_size
        start = match.matched_length
        whole = (len(tokens) - start) // ps
        # A FULL-only op capped at the capacity still restores every page it holds. A hybrid
        # model restores only at cuts where every component's state is stored, and those may all
        # lie past the capacity (a branch point deep in a long prompt): its op covers what the
        # host pool can hold, and one longer than the capacity runs alone (``try_issue``).
        whole = min(whole, self.host.num_pages if self.components else self.capacity)
        if whole * ps < max(self.config.threshold_tokens, 1):
            return None
        end = start + whole * ps
        if isinstance(tokens, TokenSequence) and tokens.page_size == ps:
            # The matched prefix ends at ``host_node``, whose last page hash is this sequence's
            # page ``start // ps - 1``: the chain continues from the same digest either way.
            hashes = tokens.page_hashes(end // ps)[start // ps :]
            head: Sequence[int] = tokens.prefix(end)
        else:
            hashes = page_hashes(tokens[start:end], ps, match.host_node.last_hash)
            head = list(tokens[:end])
        # The prefetcher does not pin the prefix (the engine does while its request waits). If it
        # is evicted meanwhile, insert_host finds the gap and the prefetched pages are dropped
        # (counted), never attached to the wrong place.
        op = PrefetchOp(request_id, head, start, hashes)
        if self.lead_pages:
            op.lead_hashes = lead_hashes(tokens, start, self.lead_pages, match.host_node, ps)
        return op

    def try_issue(self, op: PrefetchOp) -> bool:
        """Start ``op`` if host capacity allows (agreed by all ranks); False: try again later.
        While the store is not called (its breaker open, or given up) the op is answered
        "nothing stored" at once (True).

        An op longer than the capacity (a hybrid model's, see ``plan``) runs alone: it waits
        until no read is in flight, no other op is issued meanwhile, and then it takes the host
        pages it needs; if the host pool cannot give them, it is cut to the capacity."""
        assert op.state is PrefetchState.PLANNED
        health = self._health
        if self.tp.scheduler.all_max(int(health is not None and not health.allows_call())):
            op.host_indices = torch.empty(0, dtype=torch.long)
            op.state = PrefetchState.REVOKED
            op.first_batch.set()
            op.done.set()
            self.metrics.add(prefetch_skipped_unhealthy=1)
            return True
        # ``_fits`` reads state every rank agrees on: ranks skip ``_reserve``'s collective together.
        reserved, host_short = self._reserve(op) if self._fits(op) else (None, False)
        if host_short and op.pages > self.capacity:
            self._shorten(op, self.capacity)
            reserved, _ = self._reserve(op) if self._fits(op) else (None, False)
        if reserved is None:
            self.metrics.add(prefetch_rate_limited=1)
            return False
        assert self.host is not None
        op.host_indices, op.sides = reserved
        op.issued_at = time.monotonic()
        op.state = PrefetchState.RUNNING
        op.reserved_pages = op.pages
        self.pages_in_flight += op.pages
        self.metrics.add(prefetch_issued=1)
        if self.storage is None:  # detached meanwhile: nothing will read; release it as revoked
            op.state = PrefetchState.REVOKED
            op.done.set()
        else:
            self._query_thread.put(op)
        return True

    def _fits(self, op: PrefetchOp) -> bool:
        """Whether ``op`` may take host pages now (from state every rank agrees on): it fits the
        capacity beside the reads in flight, or, longer than the capacity, none is in flight.
        While an op longer than the capacity waits to run alone, no other op may take any."""
        alone = self._alone
        if alone is not None and (alone is op or alone.state is not PrefetchState.PLANNED or alone.pages <= self.capacity):
            self._alone = alone = None
        if op.pages > self.capacity:
            if self.pages_in_flight:
                self._alone = op
                return False
            return True
        return alone is None and self.pages_in_flight + op.pages <= self.capacity

    def _reserve(self, op: PrefetchOp) -> tuple[tuple[torch.Tensor, list[SideFetch]] | None, bool]:
        """Host slots for ``op``'s pages and for its components' state, or None, holding
        nothing, where a rank is short of either now; and whether a rank's host pool would be
        short of the FULL pages even once the I/O on its freed pages ends. Agreed by all ranks
        (one collective).

        An op without its components' state would read FULL pages no request can resume at: a
        component short of host slots rate-limits the op as the FULL pool does."""
        slots = sides = None
        skipped = op.sides_short_at == self._side_epoch()
        if not skipped:
            slots = self.alloc_host(op.pages * self.page_size)
            if slots is not None:
                sides = self._reserve_sides(op)
        # The worst shortfall of any rank: 2, the host pool's; 1, a component's, or host pages
        # that are free once their I/O ends (``free_pages``: the same on every rank); 0, none.
        if sides is not None:
            short = 0
        elif skipped or slots is not None or self.host.allocator.free_pages >= op.pages:
            short = 1
        else:
            short = 2
        short = self.tp.scheduler.all_max(short)
        if not short:
            assert slots is not None and sides is not None
            return (slots, sides), False
        if slots is not None:
            self.host.allocator.free(slots)
            if sides is None:
                op.sides_short_at = self._side_epoch()
        for side in sides or ():
            side.component.free_host(side.slots)
        return None, short == 2

    def _shorten(self, op: PrefetchOp, pages: int) -> None:
        """Cut a planned ``op`` to its first ``pages`` pages."""
        op.hashes = op.hashes[:pages]
        op.tokens = _head(op.tokens, op.start + pages * self.page_size)

    def _side_epoch(self) -> tuple[int, ...]:
        """Counts that move whenever components may have host slots for an op they were short
        for: unlocks and host releases in the tree (state becomes evictable), frees in their
        host allocators."""
        return (self.tree.releases, *(c.host_allocator.releases for c in self.components if c.host_allocator is not None))

    def _reserve_sides(self, op: PrefetchOp) -> list[SideFetch] | None:
        """Host slots for each component's trailing pages before any cut of ``op`` (no more
        than the sequence has before its last page); None, holding nothing, if one is short."""
        sides: list[SideFetch] = []
        for component in self.components:
            trailing = min(self._trailing[component.name], op.start // self.page_size + op.pages)
            slots = component.reserve(trailing)
            if slots is None:
                for side in sides:
                    side.component.free_host(side.slots)
                return None
            assert component.host_allocator is not None  # reserve() took the slots from it
            sides.append(SideFetch(component, trailing, slots, component.host_allocator))
        return sides

    def complete(self, op: PrefetchOp) -> bool:
        """Whether every rank's thread is done with ``op`` (agreed: MIN of 'done')."""
        if op.state is PrefetchState.PLANNED:
            return False
        return bool(self.tp.scheduler.all_min(int(op.done.is_set())))

    def ready(self, op: PrefetchOp) -> bool:
        """Whether the request may stop waiting for ``op``, by the stop policy (agreed: MAX of 'keep waiting')."""
        if op.state is PrefetchState.PLANNED:
            return False
        policy = self.config.stop_policy
        by_cost = False
        if op.done.is_set():
            keep_waiting = False
        elif policy is StopPolicy.BEST_EFFORT:
            # Take what has arrived, but not before the first batch (stopping an op the thread
            # has not reached yet would throw away every page the store holds for it) unless
            # that takes longer than the bound: then the op lands on its own (``finish``).
            keep_waiting = not op.first_batch.is_set() and not self.waited_enough(op)
        elif policy is StopPolicy.WAIT_COMPLETE:
            keep_waiting = True
        else:
            started = op.started_at
            keep_waiting = started is None or time.monotonic() - started < self.config.timeout_for(op.pages * self.page_size)
            if keep_waiting and started is not None and not self._worth_waiting(op, started):
                keep_waiting, by_cost = False, True
        stop = not self.tp.scheduler.all_max(int(keep_waiting))
        if stop and by_cost:
            self.metrics.add(prefetch_stopped_by_cost=1)
        return stop

    def _worth_waiting(self, op: PrefetchOp, started: float) -> bool:
        """``timeout`` under the cost model: whether the pages still being read arrive, at the
        read's own pace so far, before computing them would be done (see
        :meth:`~hicache_storage.cost.CostModel.keep_waiting`)."""
        done = op.completed_pages
        left = op.hit_pages - done
        waited = time.monotonic() - started
        pace = waited / done if done else None
        return self.cost.keep_waiting(
            op.request_id, left, page_bytes=self.host.page_bytes, page_tokens=self.page_size, seconds_per_page=pace, waited_s=waited
        )

    def waited_enough(self, op: PrefetchOp) -> bool:
        """``best_effort``: whether ``op``'s request has waited its bound (this rank's clock;
        ``ready`` agrees, and so must a caller deciding by it alone: see ``gives_up``)."""
        if self.config.stop_policy is not StopPolicy.BEST_EFFORT:
            return False
        return time.monotonic() - op.planned_at >= self.config.best_effort_wait_s

    def gives_up(self, op: PrefetchOp, *, running: bool = False) -> bool:
        """Whether the request of a still-planned (rate-limited) ``op`` stops waiting for it
        (agreed by all ranks): a ``best_effort`` request past its bound does, and under the cost
        model a ``timeout`` request that has waited for host slots as long as computing the op's
        pages takes (``_waited_past_compute``), unless requests are ``running`` (agreed): while
        the device serves them, waiting delays this request but not the device, and computing
        its stored pages instead would take device time from them. In the recurrent shape's
        pre-filled L3 run (16 clients) 2-3 reads a run were given up that way, 94.1% hit without
        them against 90.4-91.6% with."""
        bounded = self.waited_enough(op)
        by_cost = not bounded and not running and self._waited_past_compute(op)
        if not self.tp.scheduler.all_max(int(bounded or by_cost)):
            return False
        if by_cost:
            self.metrics.add(prefetch_skipped_by_cost=1)
        return True

    def _waited_past_compute(self, op: PrefetchOp) -> bool:
        """``timeout`` with :attr:`LoadPolicy.COST`: whether ``op``'s request has waited since the
        op was planned as long as computing its pages instead would take to finish: the device
        work queued ahead of it (``device_ahead_s``), then the pages' compute. Host slots come
        back when backups, copies and other requests end, at no pace the engine knows: a queue
        of write-through backups to a store that writes slowly held every host slot of the
        hybrid long-history bench for a second at a time, while four requests waited on 8-page
        reads they could compute in 25 ms on an idle device. Waiting no longer than computing
        takes costs at most twice the better of the two choices (the rent-or-buy bound). Counted
        without the work ahead, sixteen requests queued behind a busy device gave their reads up
        while they could not have started anyway, and the pre-filled L3 run of the recurrent
        shape fell from 96-97% to 86-90% hit. ``wait_complete`` and :attr:`LoadPolicy.ALL` wait
        for as long as reads, backups or requests are in flight."""
        if self.config.stop_policy is not StopPolicy.TIMEOUT or self.cost.config.policy is not LoadPolicy.COST:
            return False
        compute = self.cost.compute_s_per_page(self.page_size)
        if compute is None:
            return False
        return time.monotonic() - op.planned_at >= self.cost.device_ahead_s(op.request_id) + op.pages * compute

    def finish(self, op: PrefetchOp) -> int | None:
        """Stop ``op`` and put the pages every rank completed into the tree; returns tokens inserted,
        or None when the prefix they hang from was evicted meanwhile (the pages are dropped).

        A ``best_effort`` op whose read is under way on every rank with nothing read yet is not
        stopped: it *lands* (``land``: its pages go into the tree when it ends) and this returns
        0. One the read thread has not reached is stopped: it never calls the store, so a hung
        call delays at most the op it belongs to."""
        if self.config.stop_policy is StopPolicy.BEST_EFFORT and op.state is not PrefetchState.PLANNED:
            # Every rank makes the same collectives here: the op's state past PLANNED is not agreed.
            done = self.complete(op)
            under_way = self.tp.scheduler.all_min(int(op.started_at is not None))
            read = self.tp.scheduler.all_max(op.completed_pages)
            if not done and under_way and read == 0:
                self._landing.append(op)
                self.metrics.add(prefetch_left_to_land=1)
                return 0
        inserted: int | None = 0
        if op.state is not PrefetchState.PLANNED:
            assert self.host is not None and op.host_indices is not None
            with op.lock:  # a read not begun now never will: its slots are freed unpinned
                op.terminate.set()
            if not op.done.is_set():
                self.metrics.add(prefetch_terminated_early=1)
            completed = self.tp.scheduler.all_min(op.completed_pages)
            used = completed * self.page_size
            if used:
                result = self.tree.insert_host(_head(op.tokens, op.start + used), op.start, op.host_indices[:used])
                if result is None:
                    self.metrics.add(prefetch_dropped_tokens=used)
                    self.host.allocator.free(op.host_indices[:used])
                    inserted = None
                else:
                    inserted = result.inserted_tokens
                    for unused in result.unused:
                        self.host.allocator.free(unused)
            if used < op.host_indices.numel():
                self.host.allocator.free(op.host_indices[used:])  # pages still being read wait for their pin
            if op.sides:
                self._place_sides(op, completed if inserted is not None else 0)
            self.pages_in_flight -= op.reserved_pages
        op.state = PrefetchState.FINISHED
        return inserted

    def land(self) -> None:
        """Put the pages of every landing op that has ended into the tree (agreed by all ranks)."""
        for op in list(self._landing):
            if self.complete(op):
                self._landing.remove(op)
                self.finish(op)

    def _place_sides(self, op: PrefetchOp, completed: int) -> None:
        """Give the components their state read for the op's cut, if every rank read all of it
        and every FULL page up to the cut; free what is not placed."""
        complete = completed == op.hit_pages > 0 and all(side.complete for side in op.sides)
        node = None
        if not self.tp.scheduler.all_max(int(not complete)):
            end = op.start + completed * self.page_size
            match = self.tree.match_prefix(_head(op.tokens, end))
            node = match.host_node if match.host_node.end == end else None
        for side in op.sides:
            rest = side.slots
            if node is not None:
                side.component.place(node, side.read_slots)
                rest = side.slots[side.read_slots.numel() :]
            if rest.numel():
                side.component.free_host(rest)

    def _serve(
        self, step: Callable[[MultiPoolStore, StorageHealth, PrefetchOp], bool], store: MultiPoolStore, health: StorageHealth, op: PrefetchOp
    ) -> None:
        """Run one thread's ``step`` of ``op``; unless it handed the op on (True), the op ends here:
        its remaining pins are released and the scheduler is told."""
        handed_on = False
        try:
            handed_on = step(store, health, op)
        except Exception:
            log.exception("prefetch for request %s failed", op.request_id)
            self.metrics.add(storage_errors=1)
        finally:
            if not handed_on:
                if op.state is PrefetchState.RUNNING:
                    op.state = PrefetchState.DONE
                op.first_batch.set()
                op.done.set()

    def _query(self, store: MultiPoolStore, health: StorageHealth, op: PrefetchOp) -> bool:
        """Ask the store how much of the op it can restore (every rank agrees on the least); revoke
        the op below the threshold, else hand it to the reading thread (True).

        The store is asked only about the pages the cost model could load were they all stored
        (``_most_worth_loading``), and not at all when that is below the threshold: a lookup
        costs a slow store's time and the machine's CPU (an object store answers one request per
        page), and only from the first page this engine does not know stored
        (``_known_leading``). What the op learns the store holds (``stored_pages``) is then its
        answer, or past what it asked, the pages known stored (``stored``: this engine wrote or
        read them)."""
        assert self.host is not None and op.host_indices is not None
        lead = len(op.lead_hashes)
        # A store given up finds nothing (no call); the op is still reduced and revoked like a miss.
        skip = op.terminate.is_set() or health.failed
        most, saved_s = (0, None) if skip else self._most_worth_loading(op)
        declined = not skip and most * self.page_size < self.config.threshold_tokens
        asked = op.lead_hashes + op.hashes[:most]
        known_lead = 0 if skip or declined else self._known_leading(op, most)
        if skip or declined:
            local_hit = 0
        elif 0 < most == known_lead:
            local_hit = most
            self.metrics.add(prefetch_lookups_known=1)
        elif (others := self._others_pages(op, known_lead)) and not self.cost.lookup_pays(saved_s):
            local_hit = known_lead
            self.metrics.add(prefetch_lookups_unlikely=1)
        else:  # asked from the first page not known stored
            held = lead + known_lead
            began = time.monotonic()
            local_hit = guarded_call(self.metrics, lambda: store.restorable_pages(asked, held=held) - lead, 0, "exists", health=health)
            if others:
                self.cost.record_lookup(time.monotonic() - began, found=local_hit > known_lead)
        known = self.stored.leading(op.hashes) if declined or local_hit == most else 0
        # Every rank reduces every op, in issue order, even a terminated one: collectives must pair up.
        op.hit_pages = hit = self.tp.prefetch.all_min(local_hit)
        op.stored_pages = self.tp.prefetch.all_min(max(local_hit, known))
        if self.tp.prefetch.all_max(int(declined)):
            self.metrics.add(prefetch_lookups_skipped=1, prefetch_declined_by_cost=1, prefetch_declined_pages=op.stored_pages)
            self.cost.note_plan(op.pages, 0)
        if hit * self.page_size >= self.config.threshold_tokens:
            op.hit_pages = hit = self._planned_pages(store, health, op, asked, lead, hit)
            if hit * self.page_size >= self.config.threshold_tokens:
                self.cost.will_load(op.request_id, hit * self.page_size, hit * self.host.page_bytes)
                with self._reads_lock:
                    self._reads_queued += hit
                    op.queued_read_pages = hit
                self._thread.put(op)
                return True
            self.metrics.add(prefetch_declined_by_cost=1)
        op.state = PrefetchState.REVOKED
        self.metrics.add(prefetch_revoked=1)
        return False

    def _known_leading(self, op: PrefetchOp, pages: int) -> int:
        """How many of the first ``pages`` of ``op``, from the first, are known stored without
        asking the store: this engine wrote or read each of them (``stored``), and the store
        drops nothing on its own. Only the pages past them are asked for. A lookup costs an
        object store one request per page: at S3 with L4-class compute, a long-history
        request's lookup of 196 pages took 0.26 s before its read could begin, while this engine
        had written every one of them; and while the backup of its last turn was still being
        written, a lookup of 211 pages that found 203 took 0.46 s where the 8 unknown ones were
        all it needed to ask. A page deleted meanwhile by someone else is found missing by the
        read, which then ends there (the rest is computed) and forgets it. A hybrid model's cuts
        depend on its components' pools, which this record does not cover: it always asks."""
        if not self._keeps_pages or self.components or pages <= 0:
            return 0
        return self.stored.leading(op.hashes[:pages])

    def _others_pages(self, op: PrefetchOp, known_lead: int) -> bool:
        """Whether a lookup from page ``known_lead`` of ``op`` on asks only about pages another
        engine would have written: this one neither stored the first of them nor has it queued
        for a backup (its pages, the last turn's backup still being written, are found by the
        lookup; on a store that may evict, pages it stored are asked about too). Those lookups
        are the ones ``CostModel.lookup_pays`` weighs. A hybrid model's lookup is never one: it
        asks about every pool."""
        if self.components or known_lead >= op.pages:
            return False
        first = op.hashes[known_lead]
        return first not in self.stored and first not in self.writing

    def _most_worth_loading(self, op: PrefetchOp) -> tuple[int, float | None]:
        """The pages of ``op`` the cost model would load if the store held every one (all of them
        for a hybrid model: where its load may stop is known only from the store's answer), and
        how much sooner that plan finishes than computing them (``None``: not known)."""
        if self.components:
            return op.pages, None
        with self._reads_lock:
            queued = self._reads_queued
        plan = self.cost.pages_to_load(
            op.request_id, op.pages, page_bytes=self.host.page_bytes, page_tokens=self.page_size, reads_ahead_bytes=queued * self.host.page_bytes
        )
        return plan.pages, plan.saved_s

    def _planned_pages(self, store: MultiPoolStore, health: StorageHealth, op: PrefetchOp, chain: list[str], lead: int, hit: int) -> int:
        """How many of the ``hit`` pages the store answered for to read: those the cost model
        finds worth loading (:meth:`~hicache_storage.cost.CostModel.pages_to_load`), agreed by
        every rank (MIN); for a hybrid model chosen among the cuts every pool accepts. The rest
        of the op's ``stored_pages`` is computed."""
        with self._reads_lock:
            queued = self._reads_queued
        cuts: list[int] | None = None
        if self.components:
            # A hybrid model's load stops only where every component's stored state allows:
            # planned at any page, the cost model left the last page of a recurrent shape's
            # prefix to the compute (its copy hid that page's compute), and the request resumed
            # at the checkpoint before, recomputing a whole turn (the pre-filled L3 run fell
            # from 96-97% to 83-88% hit). So it chooses among the cuts the store holds.
            found = guarded_call(self.metrics, lambda: store.lookup(chain[: lead + hit], held=lead).cuts, (), "exists", health=health)
            cuts = [cut - lead for cut in found] + [hit]  # (hit is the longest cut the store answered for)
        plan = self.cost.pages_to_load(
            op.request_id,
            hit,
            page_bytes=self.host.page_bytes,
            page_tokens=self.page_size,
            reads_ahead_bytes=queued * self.host.page_bytes,
            cuts=cuts,
        )
        pages = self.tp.prefetch.all_min(plan.pages)
        if cuts is not None:
            # ranks may differ in their plans (MIN): still a cut every component allows
            pages = self.tp.prefetch.all_min(max((cut for cut in cuts if cut <= pages), default=0))
        self.cost.note_plan(op.pages, pages)
        if pages < op.stored_pages:
            self.metrics.add(prefetch_declined_pages=op.stored_pages - pages)
        return pages

    def _reads_left(self, op: PrefetchOp, pages: int) -> None:
        """``pages`` of ``op``'s reads are no longer queued (read, failed or given up)."""
        with self._reads_lock:
            pages = min(pages, op.queued_read_pages)
            op.queued_read_pages -= pages
            self._reads_queued -= pages

    def _read(self, store: MultiPoolStore, health: StorageHealth, op: PrefetchOp) -> bool:
        """Read the op's ``hit_pages`` (see ``_read_pages``); whatever is not read by its end
        leaves the reads queued."""
        try:
            return self._read_pages(store, health, op)
        finally:
            self._reads_left(op, op.queued_read_pages)

    def _read_pages(self, store: MultiPoolStore, health: StorageHealth, op: PrefetchOp) -> bool:
        """Read the op's ``hit_pages`` (and its components' pages before the cut) into its host slots."""
        assert self.scope is not None and self.host is not None and op.host_indices is not None
        host_indices = op.host_indices  # fixed at plan time
        with op.lock:  # against ``finish`` freeing the slots: pinned first, or not read at all
            if op.terminate.is_set():
                return False
            self.host.allocator.pin_io(host_indices)
            for side in op.sides:
                side.allocator.pin_io(side.slots)
        op.started_at = time.monotonic()
        backend = store.store
        keys: list[PageKey] = self.scope.keys(op.hashes)
        lead = len(op.lead_hashes)
        chain = op.lead_hashes + op.hashes
        hit = op.hit_pages
        ps = self.page_size
        allocator = self.host.allocator
        pinned_from = 0  # the op's pins from this slot on are still to release
        side_abandoned: list[StorageTimeoutError] = []  # a components' read that may still land
        try:
            started = time.perf_counter()
            for side in op.sides:
                window = side.window(chain, lead, op.start // ps, hit)
                buffers = side.component.fetch_buffers(side.read_slots)
                got_side = guarded_call(
                    self.metrics,
                    lambda: backend.get_into(store.keys(side.component.name, window), buffers),
                    None,
                    "get",
                    side_abandoned.append,
                    health=health,
                )
                side.complete = got_side is not None and all(got_side)
            segments = self.host.segments_for(host_indices[: hit * ps])
            begin = 0
            while begin < hit and not op.terminate.is_set():
                want = min(self.batch_pages, hit - begin)
                granted = self.pin_cap.acquire(want, least=1)
                want = granted or want
                batch = slice(begin, begin + want)
                abandoned = False
                if granted:

                    def abandon(call: StorageTimeoutError) -> None:
                        nonlocal abandoned
                        abandoned = True  # the call may still land in its pages: they wait for it
                        allocator.unpin_io_when_settled(host_indices[batch.start * ps : batch.stop * ps], call)

                    called = time.perf_counter()
                    try:
                        results = guarded_call(
                            self.metrics, lambda: backend.get_into(keys[batch], segments[batch]), None, "get", abandon, health=health
                        )
                    finally:
                        self.pin_cap.release(granted)
                    if results is not None and all(results):
                        self.cost.record_read(want * self.host.page_bytes, time.perf_counter() - called)
                else:  # pages pinned by abandoned calls are at their cap: read into private buffers
                    self.metrics.add(storage_staged_calls=1)
                    staging = [private_copy(page, fill=False) for page in segments[batch]]
                    results = guarded_call(
                        self.metrics, lambda: backend.get_into(keys[batch], staging), None, "get", lambda call: None, health=health
                    )
                    copy_back(segments[batch][: leading_successes(results)], staging)
                got = leading_successes(results)
                if results is not None:
                    # Every page here was reported present: a failed read means its stored copy is bad or gone.
                    missing = [op.hashes[begin + i] for i, ok in enumerate(results) if not ok]
                    self.suspects.add(missing)
                    self.stored.forget(missing)
                    self.stored.add(op.hashes[begin : begin + got])
                slot_end = batch.stop * ps if abandoned else (begin + got) * ps
                if not abandoned:
                    allocator.unpin_io(host_indices[pinned_from:slot_end])
                pinned_from = slot_end
                op.completed_pages += got
                self._reads_left(op, want)
                op.first_batch.set()
                if self.wakeup is not None:
                    self.wakeup.notify()
                self.metrics.add(prefetch_pages=got, prefetch_bytes=got * self.host.page_bytes)
                if results is None or got < len(results):
                    self.metrics.add(prefetch_failed_batches=1)
                    break
                begin = batch.stop
            self.metrics.add(prefetch_seconds=time.perf_counter() - started)
        finally:
            allocator.unpin_io(host_indices[pinned_from:])
            settling = side_abandoned[0] if side_abandoned else None
            for side in op.sides:
                side.allocator.unpin_io_when_settled(side.slots, settling)
        return False


def _head(tokens: Sequence[int], length: int) -> Sequence[int]:
    """The first ``length`` tokens; an O(1) view of a TokenSequence (which keeps its hashes)."""
    return tokens.prefix(length) if isinstance(tokens, TokenSequence) else tokens[:length]
