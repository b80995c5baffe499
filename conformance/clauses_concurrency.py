"""Concurrency clauses: whole pages under real contention, and every reader gets its own key's bytes.

Every page written here encodes its key and version (:mod:`hicache_storage.conformance.pages`),
and every read is checked for both, so a torn page, a page of another key and a stale version
are told apart. The clauses shrink the interpreter's thread switch interval while they run, so
threads interleave inside a connector's Python code instead of taking turns.

Their power is measured, not assumed: a race can only show when the calls really overlap, and
how often they do depends on the machine's load. So each clause uses pages of a few MiB (one
copy spans many scheduling steps) and runs until it has *observed* ``concurrent_overlaps`` calls
overlapping the calls they race with (a read during a write of the same key, two reads or two
writes at once; timed around the calls, :class:`OverlapMeter`), within ``concurrent_budget_s``.
A run that cannot reach that many in its budget fails and says so, rather than passing with
less power than stated. ``docs/reports/conformance/mutation-study.md`` publishes the detection rate per
seeded race, measured with both cores busy.

Mixed into :class:`~hicache_storage.conformance.suite.ConformanceTests`.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator

import pytest

from hicache_storage.store import Store
from hicache_storage.conformance.clauses import Clauses
from hicache_storage.conformance.pages import check_page, key_digest, page_for, random_hash
from hicache_storage.keys import KeyScope, PageKey

#: The switch interval while a concurrent clause runs (CPython's default is 5 ms).
SWITCH_INTERVAL_S = 1e-6
#: How long a clause waits for its threads before reporting a hang.
JOIN_TIMEOUT_S = 300


@contextlib.contextmanager
def forced_interleaving() -> Iterator[None]:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def run_threads(*groups: tuple[int, Callable[[int], None]], stop: threading.Event | None = None) -> list[str]:
    """Run ``count`` threads of each ``(count, target)``; the first group's end sets ``stop``.

    Returns the problems the threads reported (an exception in a thread is a problem).
    """
    problems: list[str] = []

    def guarded(target: Callable[[int], None], index: int) -> None:
        try:
            target(index)
        except BaseException as exc:  # reported by the clause, with the thread's message
            problems.append(f"{type(exc).__name__}: {exc}")
            if stop is not None:
                stop.set()

    threads = [[threading.Thread(target=guarded, args=(target, i), daemon=True) for i in range(count)] for count, target in groups]
    with forced_interleaving():
        for group in threads:
            for thread in group:
                thread.start()
        for thread in threads[0]:
            thread.join(JOIN_TIMEOUT_S)
        if stop is not None:
            stop.set()
        for group in threads[1:]:
            for thread in group:
                thread.join(JOIN_TIMEOUT_S)
    hung = sum(thread.is_alive() for group in threads for thread in group)
    if hung:
        problems.append(f"{hung} thread(s) still running after {JOIN_TIMEOUT_S} s: a call hung")
    return problems


class OverlapMeter:
    """Counts calls that overlapped, at any moment, another call on the channel they watch.

    A call occupies channels (such as ``("write", key)``) while it runs and watches one; it
    overlapped if another call occupied that channel when it began or began on it before it
    ended. Thread-safe. ``done`` says whether ``target`` overlaps were seen or ``budget_s``
    has passed since the meter was made.
    """

    def __init__(self, target: int, budget_s: float) -> None:
        self.target = target
        self.budget_s = budget_s
        self.overlaps = 0
        self._deadline = time.monotonic() + budget_s
        self._lock = threading.Lock()
        self._active: Counter[Hashable] = Counter()
        self._started: Counter[Hashable] = Counter()
        #: Set when a thread failed: the others stop at once.
        self.stopped = threading.Event()

    @contextlib.contextmanager
    def call(self, occupies: Iterable[Hashable], watches: Hashable) -> Iterator[None]:
        channels = list(occupies)
        with self._lock:
            for channel in channels:
                self._active[channel] += 1
                self._started[channel] += 1
            others = self._active[watches] - channels.count(watches)
            started = self._started[watches]
        try:
            yield
        finally:
            with self._lock:
                for channel in channels:
                    self._active[channel] -= 1
                if others > 0 or self._started[watches] != started:
                    self.overlaps += 1

    def done(self) -> bool:
        return self.stopped.is_set() or self.overlaps >= self.target or time.monotonic() >= self._deadline

    def shortfall(self, what: str) -> list[str]:
        """The problem to report when the budget ran out before ``target`` overlaps."""
        if self.overlaps >= self.target:
            return []
        return [
            f"only {self.overlaps} of the {self.target} {what} this clause needs were observed in its "
            f"{self.budget_s:g} s budget, so it cannot claim its stated power: the store serializes these "
            "calls or is too slow for the budget (raise concurrent_budget_s in the suite's subclass)"
        ]


def report(problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        pytest.fail(problems[0] + more, pytrace=False)


class ConcurrencyClauses(Clauses):
    """Atomic publication and per-key identity while writers and readers overlap."""

    #: Bytes of one page in the concurrent clauses: a few MiB, so one copy takes many steps.
    concurrent_page_bytes = 2 * 1024 * 1024
    #: Overlapping calls each clause observes before it stops (its power; see the module docstring).
    concurrent_overlaps = 100
    #: The most seconds a clause runs to observe them; falling short fails the clause.
    concurrent_budget_s = 120.0
    #: Pages a thread of :meth:`test_concurrent_distinct_keys` has checked before it deletes them.
    concurrent_delete_pages = 16

    def overlap_meter(self) -> OverlapMeter:
        return OverlapMeter(self.concurrent_overlaps, self.concurrent_budget_s)

    def concurrent_page_size(self, store: Store) -> int:
        """``concurrent_page_bytes``, or the store's declared ``max_value_size`` if that is smaller
        (a store of 1 MiB slots gets 1 MiB pages: still many scheduling steps per copy)."""
        limit = store.capabilities.max_value_size
        return self.concurrent_page_bytes if limit is None else min(self.concurrent_page_bytes, limit)

    @pytest.mark.slow
    def test_publication_is_atomic_under_contention(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """Readers calling exists and get while writers publish new pages and overwrite old ones see,
        for each key, a whole page of the latest version or of one being written, or a miss; a key
        that exists reads whole, and a key whose put returned reads whole. Runs until
        ``concurrent_overlaps`` reads overlapped a write of their key."""
        size = self.concurrent_page_size(store)
        writers = 2
        may_miss = store.capabilities.evicts or store.capabilities.ttl
        salt = rng.getrandbits(64)
        hot = [scope.key(random_hash(rng)) for _ in range(2 * writers)]

        def fresh(writer: int, round_: int) -> PageKey:
            """The new page ``writer`` publishes in ``round_`` (known to readers before it is written)."""
            return scope.key(hashlib.sha256(f"{salt}-{writer}-{round_}".encode()).hexdigest())

        known = {key_digest(k): k for k in hot}
        assert store.put(hot, [page_for(k, size, 0) for k in hot]) == [True] * len(hot)
        completed = dict.fromkeys(hot, 0)  # version whose put returned
        started = dict.fromkeys(hot, 0)  # version whose put began
        published = [0] * writers  # rounds whose new page's put returned, per writer
        writing: list[PageKey] = hot[:writers]  # the hot key each writer overwrites now
        meter = self.overlap_meter()

        def writer(index: int) -> None:
            mine = hot[index::writers]
            round_ = 0
            while not meter.done():
                round_ += 1
                key = mine[round_ % len(mine)]
                writing[index] = key
                started[key] = round_
                with meter.call([("write", key)], ("read", key)):
                    assert store.put([key], [page_for(key, size, round_)]) == [True], "put of an overwrite failed"
                completed[key] = round_
                new = fresh(index, round_ - 1)
                known[key_digest(new)] = new
                with meter.call([("write", new)], ("read", new)):
                    assert store.put([new], [page_for(new, size)]) == [True], "put of a new page failed"
                published[index] = round_

        def reader(index: int) -> None:
            target = bytearray(size)
            local = random.Random(index)
            while not meter.done():
                key = local.choice(writing) if local.random() < 0.75 else local.choice(hot)
                floor = completed[key]
                with meter.call([("read", key)], ("write", key)):
                    hit = store.get_into([key], [target]) == [True]
                if hit:
                    check_page(target, key, versions=range(floor, started[key] + 1), known=known)
                elif not may_miss:
                    raise AssertionError(f"a page that was stored (version {floor} done) read as a miss during an overwrite")
                writer_index = local.randrange(writers)
                done_rounds = published[writer_index]
                candidates = [fresh(writer_index, done_rounds - 1)] if done_rounds else []
                candidates += [fresh(writer_index, done_rounds), fresh(writer_index, done_rounds + 1)]
                done_before = set(candidates[:1]) if done_rounds else set()
                with meter.call([("read", candidates[-2])], ("write", candidates[-2])):
                    present_all = store.exists(candidates)
                for new, present in zip(candidates, present_all):
                    if not present and new in done_before and not may_miss:
                        raise AssertionError("exists is False for a page whose put had returned")
                    if present:
                        with meter.call([("read", new)], ("write", new)):
                            hit = store.get_into([new], [target]) == [True]
                        assert hit or may_miss, "exists was True, then get missed: a page was announced before it was whole"
                        if hit:
                            check_page(target, new, versions=(0,), known=known)

        problems = run_threads((writers, writer), (2, reader), stop=meter.stopped)
        report(problems or meter.shortfall("reads overlapping a write of their key"))
        for key, value in zip(hot, store.get(hot, size)):
            if value is not None or not may_miss:
                check_page(value, key, versions=(completed[key],), known=known)

    @pytest.mark.slow
    def test_concurrent_writers_and_readers_never_see_a_torn_page(
        self, store: Store, scope: KeyScope, rng: random.Random
    ) -> None:
        """Several writers overwrite the same keys; a reader only ever sees one whole version of its
        key. Runs until ``concurrent_overlaps`` reads overlapped a write of their key."""
        size = self.concurrent_page_size(store)
        writers = 3
        keys = [scope.key(random_hash(rng)) for _ in range(4)]
        known = {key_digest(k): k for k in keys}
        assert store.put(keys, [page_for(k, size, 0) for k in keys]) == [True] * len(keys)
        written: dict[PageKey, set[int]] = {k: {0} for k in keys}
        meter = self.overlap_meter()

        def writer(index: int) -> None:
            local = random.Random(index)
            round_ = 0
            while not meter.done():
                key = local.choice(keys)
                version = round_ * writers + index + 1
                round_ += 1
                written[key].add(version)
                with meter.call([("write", key)], ("read", key)):
                    store.put([key], [page_for(key, size, version)])

        def reader(index: int) -> None:
            target = bytearray(size)
            while not meter.done():
                for key in keys:
                    with meter.call([("read", key)], ("write", key)):
                        hit = store.get_into([key], [target]) == [True]
                    if hit:
                        check_page(target, key, versions=set(written[key]), known=known)

        problems = run_threads((writers, writer), (2, reader), stop=meter.stopped)
        report(problems or meter.shortfall("reads overlapping a write of their key"))

    @pytest.mark.slow
    def test_concurrent_readers_get_their_own_pages(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """Threads reading different keys at once each get their own key's bytes (no shared
        staging). Runs until ``concurrent_overlaps`` reads overlapped another read."""
        size = self.concurrent_page_size(store)
        readers, per_reader = 4, 3
        keys = [scope.key(random_hash(rng)) for _ in range(readers * per_reader)]
        known = {key_digest(k): k for k in keys}
        assert store.put(keys, [page_for(k, size) for k in keys]) == [True] * len(keys)
        may_miss = store.capabilities.evicts
        meter = self.overlap_meter()

        def reader(index: int) -> None:
            mine = keys[index * per_reader : (index + 1) * per_reader]
            targets = [bytearray(size) for _ in mine]
            round_ = 0
            while not meter.done():
                batch = mine if round_ % 2 else mine[:1]
                round_ += 1
                with meter.call([("read",)], ("read",)):
                    hits = store.get_into(batch, targets[: len(batch)])
                for key, target, hit in zip(batch, targets, hits):
                    if hit:
                        check_page(target, key, known=known)
                    else:
                        assert may_miss, "a stored page read as a miss"

        problems = run_threads((readers, reader), stop=meter.stopped)
        report(problems or meter.shortfall("reads overlapping another read"))

    def test_concurrent_distinct_keys(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """Writers of different keys at once: every page is stored, and reads back as its own.
        Runs until ``concurrent_overlaps`` puts overlapped another put; a store that can delete
        gets its checked pages deleted every ``concurrent_delete_pages`` pages, so the run's
        footprint stays a few pages per thread. (Deleting each page right after its read would
        make a store whose reads hold a lease, such as Mooncake, spend each round waiting the
        lease out: the puts would rarely overlap, and the clause would run out of budget.)"""
        seeds = [rng.getrandbits(32) for _ in range(4)]
        size = self.concurrent_page_size(store)
        may_miss = store.capabilities.evicts
        deletes = store.capabilities.delete
        meter = self.overlap_meter()

        def worker(index: int) -> None:
            local = random.Random(seeds[index])
            round_ = 0
            checked: list[PageKey] = []
            while not meter.done():
                keys = [scope.key(random_hash(local)) for _ in range(2)]
                with meter.call([("put",)], ("put",)):
                    assert store.put(keys, [page_for(k, size, round_) for k in keys]) == [True] * 2, "put of a batch failed"
                for key, value in zip(keys, store.get(keys, size)):
                    if value is None:
                        assert may_miss, "a page this thread had just stored read as a miss (a lost update?)"
                    else:
                        check_page(value, key, versions=(round_,))
                if deletes:
                    checked += keys
                    if len(checked) >= self.concurrent_delete_pages:
                        store.delete(checked)
                        checked.clear()
                round_ += 1
            if checked:
                store.delete(checked)

        problems = run_threads((len(seeds), worker), stop=meter.stopped)
        report(problems or meter.shortfall("puts overlapping another put"))
