"""Concurrency clauses: whole pages under real contention, and every reader gets its own key's bytes.

Every page written here encodes its key and version (:mod:`hicache_storage.conformance.pages`),
and every read is checked for both, so a torn page, a page of another key and a stale version
are told apart. The clauses shrink the interpreter's thread switch interval while they run, so
threads interleave inside a connector's Python code instead of taking turns.

Mixed into :class:`~hicache_storage.conformance.suite.ConformanceTests`.
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from hicache_storage.backend import StorageBackend
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


def report(problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        pytest.fail(problems[0] + more, pytrace=False)


class ConcurrencyClauses:
    """Atomic publication and per-key identity while writers and readers overlap."""

    #: Bytes of one page in the concurrent clauses: large enough that a copy takes many steps.
    concurrent_page_bytes = 256 * 1024

    @pytest.mark.slow
    def test_publication_is_atomic_under_contention(self, store: StorageBackend, scope: KeyScope, rng: random.Random) -> None:
        """Readers calling exists and get while writers publish new pages and overwrite old ones see,
        for each key, a whole page of the latest version or of one being written, or a miss; a key
        that exists reads whole, and a key whose put returned reads whole."""
        size = self.concurrent_page_bytes
        writers, rounds = 2, 80
        may_miss = store.capabilities.evicts or store.capabilities.ttl
        hot = [scope.key(random_hash(rng)) for _ in range(2 * writers)]
        fresh = [[scope.key(random_hash(rng)) for _ in range(rounds)] for _ in range(writers)]
        known = {key_digest(k): k for k in hot + [k for keys in fresh for k in keys]}
        assert store.put(hot, [page_for(k, size, 0) for k in hot]) == [True] * len(hot)
        completed = dict.fromkeys(hot, 0)  # version whose put returned
        started = dict.fromkeys(hot, 0)  # version whose put began
        published: set[PageKey] = set()
        writing: list[PageKey] = hot[:writers]  # the hot key each writer overwrites now
        stop = threading.Event()

        def writer(index: int) -> None:
            mine = hot[index::writers]
            for round_ in range(1, rounds + 1):
                key = mine[round_ % len(mine)]
                writing[index] = key
                started[key] = round_
                assert store.put([key], [page_for(key, size, round_)]) == [True], "put of an overwrite failed"
                completed[key] = round_
                new = fresh[index][round_ - 1]
                assert store.put([new], [page_for(new, size)]) == [True], "put of a new page failed"
                published.add(new)

        def reader(index: int) -> None:
            target = bytearray(size)
            local = random.Random(index)
            while not stop.is_set():
                key = local.choice(writing) if local.random() < 0.75 else local.choice(hot)
                floor = completed[key]
                hit = store.get_into([key], [target]) == [True]
                if hit:
                    check_page(target, key, versions=range(floor, started[key] + 1), known=known)
                elif not may_miss:
                    raise AssertionError(f"a page that was stored (version {floor} done) read as a miss during an overwrite")
                writer_index = local.randrange(writers)
                upcoming = fresh[writer_index]
                candidates = [k for k in upcoming if k not in published][:2] or upcoming[-1:]
                done_before = {k for k in candidates if k in published}
                for new, present in zip(candidates, store.exists(candidates)):
                    if not present and new in done_before and not may_miss:
                        raise AssertionError("exists is False for a page whose put had returned")
                    if present:
                        hit = store.get_into([new], [target]) == [True]
                        assert hit or may_miss, "exists was True, then get missed: a page was announced before it was whole"
                        if hit:
                            check_page(target, new, versions=(0,), known=known)

        problems = run_threads((writers, writer), (2, reader), stop=stop)
        report(problems)
        for key, value in zip(hot, store.get(hot, size)):
            if value is not None or not may_miss:
                check_page(value, key, versions=(completed[key],), known=known)

    @pytest.mark.slow
    def test_concurrent_writers_and_readers_never_see_a_torn_page(
        self, store: StorageBackend, scope: KeyScope, rng: random.Random
    ) -> None:
        """Several writers overwrite the same keys; a reader only ever sees one whole version of its key."""
        size = self.concurrent_page_bytes
        keys = [scope.key(random_hash(rng)) for _ in range(4)]
        known = {key_digest(k): k for k in keys}
        assert store.put(keys, [page_for(k, size, 0) for k in keys]) == [True] * len(keys)
        written: dict[PageKey, set[int]] = {k: {0} for k in keys}
        stop = threading.Event()

        def writer(index: int) -> None:
            local = random.Random(index)
            for round_ in range(30):
                key = local.choice(keys)
                version = (index + 1) * 1000 + round_
                written[key].add(version)
                store.put([key], [page_for(key, size, version)])

        def reader(index: int) -> None:
            target = bytearray(size)
            while not stop.is_set():
                for key in keys:
                    if store.get_into([key], [target]) == [True]:
                        check_page(target, key, versions=set(written[key]), known=known)

        problems = run_threads((3, writer), (2, reader), stop=stop)
        report(problems)

    @pytest.mark.slow
    def test_concurrent_readers_get_their_own_pages(self, store: StorageBackend, scope: KeyScope, rng: random.Random) -> None:
        """Threads reading different keys at once each get their own key's bytes (no shared staging)."""
        size = self.concurrent_page_bytes
        readers, per_reader = 4, 3
        keys = [scope.key(random_hash(rng)) for _ in range(readers * per_reader)]
        known = {key_digest(k): k for k in keys}
        assert store.put(keys, [page_for(k, size) for k in keys]) == [True] * len(keys)
        may_miss = store.capabilities.evicts

        def reader(index: int) -> None:
            mine = keys[index * per_reader : (index + 1) * per_reader]
            targets = [bytearray(size) for _ in mine]
            for round_ in range(25):
                batch = mine if round_ % 2 else mine[:1]
                for key, target, hit in zip(batch, targets, store.get_into(batch, targets[: len(batch)])):
                    if hit:
                        check_page(target, key, known=known)
                    else:
                        assert may_miss, "a stored page read as a miss"

        problems = run_threads((readers, reader))
        report(problems)

    def test_concurrent_distinct_keys(self, store: StorageBackend, scope: KeyScope, rng: random.Random) -> None:
        """Writers of different keys at once: every page is stored, and reads back as its own."""
        seeds = [rng.getrandbits(32) for _ in range(4)]
        may_miss = store.capabilities.evicts

        def worker(index: int) -> None:
            local = random.Random(seeds[index])
            for round_ in range(8):
                keys = [scope.key(random_hash(local)) for _ in range(8)]
                assert store.put(keys, [page_for(k, 2048, round_) for k in keys]) == [True] * 8, "put of a batch failed"
                for key, value in zip(keys, store.get(keys, 2048)):
                    if value is None:
                        assert may_miss, "a page this thread had just stored read as a miss (a lost update?)"
                    else:
                        check_page(value, key, versions=(round_,))

        problems = run_threads((len(seeds), worker))
        report(problems)
