"""Admission: waiting requests, their prefix match and prefetch, and when each may start.

A submitted request is matched against the tree and, when storage holds enough of the rest, gets
a prefetch (:mod:`hicache_core.prefetch`); the prefix its prefetch hangs from stays locked
while it waits (a *pin*). :meth:`Admission.admit` starts waiting requests in order: one whose
prefetch is not ready by the stop policy is skipped, not waited for; one whose cached prefix
was evicted while it waited fetches it back once; the head of the queue that cannot get device
memory stops admission until running requests, copies or waiting requests' pins give it back.

The queue is tried in the order ``EngineConfig.admission_order`` sets: ``fcfs`` (the default),
arrival order; or ``lpm`` (as SGLang's ``--schedule-policy lpm``): the most prompt tokens cached
on the device first, then arrival. A request whose prefix L1 holds starts before one that would evict that prefix to make
room, and while it waits for memory the requests after it wait too, so they cannot evict it
either. In the long-history bench's late rounds four histories of 13,000-15,000 tokens take turns
in a 32,768-token L1: in arrival order the round's first two requests evicted the two histories L1
still held and all four were recomputed; now those two go first and hit, and the other two wait
for their memory. A request overtaken ``OVERTAKEN_MAX`` times (requests that arrived after it
started before it) goes before every other, so none waits forever behind better-cached ones; a
queue longer than ``LPM_WAITING_MAX`` is tried in arrival order (the order costs a lookup per
waiting request per step). Not the default yet: under ``lpm`` L1 alone got so much better (the
long-history bench at h200-7b: 33% -> 69% hit, 17.8 -> 9.2 s) that L1+L2+L3 on the slower
stores fell behind it (S3 13.0 s; 10.6 s, Redis 9.7 s, once requests stopped waiting for
lookups that found nothing: ``CostModel.lookup_pays``), its device hits lost to the L2/L3
paths (copies' locks, prefetch pins): issue 27's next step.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache_core.controller import CacheController
from hicache_core.prefetch import PrefetchOp, PrefetchState
from hicache_core.radix_tree import RadixTree
from hicache_core.requests import AdmissionOrder, CacheTiers, EngineCapacityError, EngineConfig, Live, Request
from hicache_core.token_sequence import TokenSequence

#: Under ``AdmissionOrder.LPM``: a request overtaken this many times (requests that arrived after
#: it started before it) is tried before every other.
OVERTAKEN_MAX = 16
#: Under ``AdmissionOrder.LPM``: a longer queue is tried in arrival order.
LPM_WAITING_MAX = 128


class Admission:
    """The waiting queue of an engine; ``running`` is the engine's list of running requests."""

    def __init__(self, config: EngineConfig, tree: RadixTree, controller: CacheController, running: list[Live]) -> None:
        self.config = config
        self.tree = tree
        self.controller = controller
        self.running = running
        self.waiting: list[Live] = []
        #: The head of the queue that last failed to get memory, and the memory state then: it
        #: is not tried again (a failed start costs the scheduler a match and two evictions)
        #: until a lock, a host copy or a page is given back.
        self._failed: tuple[Live, tuple[int, ...]] | None = None
        self._arrivals = 0

    def enqueue(self, live: Live) -> None:
        """Queue a submitted request (its prefetch planned)."""
        live.arrival = self._arrivals
        self._arrivals += 1
        self.waiting.append(live)

    def matchable(self, live: Live) -> TokenSequence:
        """The prompt minus its last token: that one is always computed, to produce logits."""
        return live.sequence.prefix(len(live.request.tokens) - 1)

    def plan_prefetch(self, live: Live) -> None:
        """Match and plan the storage prefetch of the rest. The matched prefix stays locked until
        the prefetch is finished, so the fetched pages have something to hang from (waiting
        requests' pins are released if the head of the queue needs the memory: unpin_waiting)."""
        request = live.request
        matchable = self.matchable(live)
        match = self.tree.match_prefix(matchable, count_host=not self.config.controller.buffer_only)
        live.planned_match = match.matched_length
        prefetcher = self.controller.prefetcher
        if prefetcher is None:
            return
        # What the request computes unless storage serves some of it, and copies from host
        # memory: the device work queued ahead of later requests' loads (the cost model's view;
        # see hicache_storage.cost).
        host = self.controller.host
        copy_bytes = (match.matched_length - match.device_hit_length) // self.config.page_size * host.page_bytes if host is not None else 0
        self.controller.cost.enqueue(request.rid, len(request.tokens) - match.matched_length, copy_bytes)
        live.prefetch = prefetcher.plan(request.rid, matchable, match)
        if live.prefetch is not None:
            live.pinned = match.host_node
            self.tree.lock(live.pinned)
            prefetcher.try_issue(live.prefetch)  # if rate-limited, _admit retries it

    def admit(self, start: Callable[[Live], bool], started: Callable[[Live], None], fits: Callable[[Live], bool] | None = None) -> bool:
        """Start waiting requests in order while fewer than ``max_running`` run: each whose
        prefetch is ready by the stop policy (or has none) and for which ``start`` finds device
        memory (``started`` runs right after, before the next is considered); whether any started.
        Once the head of the queue cannot start (or ``max_running`` run), the requests behind it
        only take their completed prefetches into the tree (the host capacity those held goes to
        the reads still planned) and wait.

        ``fits`` tells whether device memory could hold a request now (free and evictable
        pages); with it, a head that cannot start takes the device prefixes pinned by requests
        behind it, when that is enough (``unpin_behind``).

        Raises :class:`EngineCapacityError` if the head of the queue cannot start although
        nothing holds device memory (a leaked lock).
        """
        if self.config.admission_order is AdmissionOrder.LPM:
            self._order()
        admitted = blocked = False
        for live in list(self.waiting):
            blocked = blocked or len(self.running) >= self.config.max_running
            op = live.prefetch
            if op is not None:
                prefetcher = self.controller.prefetcher
                assert prefetcher is not None
                if op.state is PrefetchState.PLANNED:
                    if prefetcher.try_issue(op) or blocked:
                        continue
                    busy = prefetcher.pages_in_flight or self.controller.io_pending or self.running
                    if busy and not prefetcher.gives_up(op, running=bool(self.running)):
                        continue  # host pages come back as those reads, backups and requests end
                    # Nothing in flight will give host pages back (a hung store may hold some for
                    # good): compute rather than wait for a prefetch that cannot start.
                elif not (prefetcher.complete(op) if blocked else prefetcher.ready(op)):
                    continue
                self._take_prefetch(live, op)
            if blocked:
                self._refetch_early(live)
                continue
            if self._failed == (live, self._memory_epoch()):
                blocked = True  # nothing was given back since it last failed
                continue
            if not live.refetched and self.prefix_lost(live):
                # Part of its cached prefix was evicted while it waited: fetch it back, once.
                live.refetched = True
                self.plan_prefetch(live)
                if live.prefetch is not None:
                    continue
            if start(live):
                self._failed = None
                self._move_to_running(live)
                admitted = True
                started(live)
                continue
            if fits is not None and self.unpin_behind(live, fits):
                continue  # its memory epoch moved: it is tried again at the next step
            self._failed = (live, self._memory_epoch())
            if not self.running and not self.controller.io_pending and not self.unpin_waiting():
                # Nothing holds device memory any more (no request runs, no copy is in flight, no
                # waiting request pins a prefix), so everything is evictable: check_fits at
                # submit makes this unreachable unless the tree leaks a lock.
                raise EngineCapacityError(
                    f"request {live.request.rid!r} cannot get device memory although nothing else holds any "
                    f"({self.config.device_pages} pages of {self.config.page_size}): this is a bug, please report it"
                )
            blocked = True
        return admitted

    def _order(self) -> None:
        """Sort the queue for ``AdmissionOrder.LPM`` (see the module): requests overtaken
        ``OVERTAKEN_MAX`` times first, then the most prompt tokens on the device, then arrival.
        The same on every rank (their trees are)."""
        waiting = self.waiting
        if len(waiting) < 2:
            return
        if len(waiting) > LPM_WAITING_MAX:
            waiting.sort(key=lambda live: live.arrival)
            return

        def key(live: Live) -> tuple[int, int, int]:
            if live.overtaken >= OVERTAKEN_MAX:
                return (0, 0, live.arrival)
            return (1, -self.tree.device_hit_length(self.matchable(live)), live.arrival)

        waiting.sort(key=key)

    def _move_to_running(self, live: Live) -> None:
        """A request started: it runs (under ``lpm``, having overtaken every waiting request that
        arrived before it)."""
        self.waiting.remove(live)
        if self.config.admission_order is AdmissionOrder.LPM:
            for other in self.waiting:
                if other.arrival < live.arrival:
                    other.overtaken += 1
        self.running.append(live)

    def _refetch_early(self, live: Live) -> None:
        """A request waiting behind others whose cached prefix was evicted meanwhile fetches it
        back now, not once it reaches the head of the queue: its read then runs while the
        requests before it load and compute (in a long-history round, half the requests wait
        for the memory of the other half, and lose their host copies to those requests' loads).
        Checked once per memory epoch: a match per waiting request per step would cost the
        scheduler more than the rare loss it finds."""
        if live.prefetch is not None or live.refetched or self.controller.storage is None:
            return
        epoch = self._memory_epoch()
        if live.lost_checked_at == epoch:
            return
        live.lost_checked_at = epoch
        if self.prefix_lost(live):
            live.refetched = True
            self.plan_prefetch(live)

    def _memory_epoch(self) -> tuple[int, ...]:
        """Counts that move whenever memory may have become free or evictable: tree unlocks and
        host releases, copies and backups applied, and pages given back to any allocator (the
        tree's pools and components'). The same on every rank (agreed counts, no I/O timing), so
        ranks skip the same retries."""
        allocators = [self.controller.device.allocator]
        if self.controller.host is not None:
            allocators.append(self.controller.host.allocator)
        for component in self.tree.components:
            allocators += [a for a in (getattr(component, "device_allocator", None), getattr(component, "host_allocator", None)) if a]
        return (self.tree.releases, self.controller.completions, *(a.releases for a in allocators))

    def _take_prefetch(self, live: Live, op: PrefetchOp) -> None:
        """Finish ``live``'s prefetch: what it read goes into the tree, pinned until the request starts."""
        prefetcher = self.controller.prefetcher
        assert prefetcher is not None
        live.prefetch = None
        if op.stored_pages:
            live.stored_span = (op.start, op.start + op.stored_pages * prefetcher.page_size)
        live.storage_tokens = prefetcher.finish(op) or 0
        self.unpin(live)
        if live.storage_tokens:
            # Hold what was fetched until the request starts: waiting for device memory,
            # it would otherwise lose the pages to other requests' host allocations.
            match = self.tree.match_prefix(self.matchable(live))
            live.pinned = match.host_node
            self.tree.lock(live.pinned)
            if not self.config.controller.buffer_only:  # (there host copies count as no hit)
                # What it fetched is part of its cached prefix now: lost while it waits (a head
                # short of memory took the pin: unpin_waiting), it is fetched back once, as an
                # evicted prefix is, instead of recomputed.
                live.planned_match = max(live.planned_match, match.matched_length)
        # The host capacity its read held is free now: let the next reads run while this
        # request loads and computes, not after.
        self.issue_planned()

    def issue_planned(self) -> None:
        """Issue waiting requests' rate-limited prefetches, in queue order, while capacity allows."""
        prefetcher = self.controller.prefetcher
        if prefetcher is None:
            return
        for live in self.waiting:
            op = live.prefetch
            if op is not None and op.state is PrefetchState.PLANNED and not prefetcher.try_issue(op):
                return

    def check_fits(self, request: Request) -> None:
        ps = self.config.page_size
        pages = -(-(len(request.tokens) + request.max_new_tokens - 1) // ps)
        if pages > self.config.device_pages:
            raise EngineCapacityError(
                f"request {request.rid!r} needs {pages} device pages ({len(request.tokens)} prompt + "
                f"{request.max_new_tokens} new tokens, {ps} per page) but the device pool has "
                f"{self.config.device_pages}; raise device_pages or shorten the request"
            )

    def unpin_waiting(self) -> bool:
        """Release the prefixes waiting requests pinned (prefetches, fetched pages); whether any was held.

        Called when the head of the queue cannot start and nothing else could free memory: the
        pins are what stands between it and the memory it needs. A request unpinned here may plan
        a refetch again later (its prefetched pages are dropped if the prefix goes meanwhile).
        """
        released = False
        for live in self.waiting:
            if live.pinned is not None:
                self.unpin(live)
                live.refetched = False
                released = True
        return released

    def unpin_behind(self, head: Live, fits: Callable[[Live], bool]) -> bool:
        """Release device prefixes pinned by requests queued behind ``head``, which could not
        get device memory, the last queued first, as far as ``head`` then fits; whether it does.
        They cannot start before it, and their pins keep their device prefixes from eviction:
        in the long-history bench's late rounds two waiting requests pinned 20,000 of L1's
        32,768 tokens while the head, needing 13,000, waited for a running request's whole
        decode, and a round ran in three waves where two fit. A request unpinned here whose
        prefix is then evicted loads it from the host or fetches it back once (as after
        ``unpin_waiting``). When even every such pin would not make room, all are kept: their
        requests' host pages would be evicted for nothing.

        A request whose read is still in flight is unpinned too: its read's pages hang from the
        prefix, which normally keeps its host copy (they are dropped, counted, if it goes). Kept,
        such pins held up the head for a slow store's lookup and read: in the long-history bench
        three requests' device prefixes filled L1 while two of them read their last turn, and the
        third, its whole prefix on the device, waited with nothing running. FULL + SWA + recurrent
        long history, four runs each side by side: 4.88 s -> 4.76 s (0.83 -> 0.85 of the
        reachable bound); file at h200-7b 5.10 s -> 4.82 s."""
        released: list[Live] = []
        for live in reversed(self.waiting[self.waiting.index(head) + 1 :]):
            if live.pinned is None or not self.tree.on_device(live.pinned):
                continue
            self.tree.unlock(live.pinned)
            released.append(live)
            if fits(head):
                for unpinned in released:
                    unpinned.pinned = None
                    unpinned.refetched = False
                return True
        for kept in released:
            assert kept.pinned is not None
            self.tree.lock(kept.pinned)
        return False

    def unpin(self, live: Live) -> None:
        if live.pinned is not None:
            self.tree.unlock(live.pinned)
            live.pinned = None

    def prefix_lost(self, live: Live) -> bool:
        if self.controller.storage is None or self.config.tiers is CacheTiers.OFF:
            return False
        match = self.tree.match_prefix(self.matchable(live), count_host=not self.config.controller.buffer_only)
        return match.matched_length < live.planned_match
