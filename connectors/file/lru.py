"""The file backend's capacity index: the pages under its root, least recently used first.

Built at start by scanning the root (oldest modification time first), then kept in memory only:
reads refresh recency here, never on disk, so after a restart recency is by last write. The
index covers the pages this instance knows (found at start, written or read by it); several
processes writing one capped root each enforce their own view.

A put makes room before it writes (:meth:`LruPageIndex.admit`): the pages of one call are
admitted head first while they fit in the capacity together, and only those are written, so a
call larger than the capacity keeps the head of its prefix rather than its tail, and the pages
on disk never exceed the capacity, not even while the call runs. Bytes admitted but not yet
published are *reserved*: concurrent calls admit only what fits beside each other's
reservations, so together they stay within the capacity too.

Not thread-safe: the file backend calls every method under its lock, and holds that lock across
a page's publication too, so a rename and its index entry change together.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Container

from hicache_storage.connectors.file.tree import COMPONENT_RE, PAGE_DEPTH

# The file backend's logger, so one name configures everything that backend does.
logger = logging.getLogger("hicache_storage.connectors.file")

#: The counters eviction increments, in the order ``stats()`` reports them.
EVICTION_COUNTERS = ("evictions", "evicted_bytes", "evictions_failed", "evictions_vanished", "unremovable_bytes")

#: Bytes one put call reserved, by the relative path of each admitted page not yet published.
Reservation = dict[str, int]


class LruPageIndex:
    """Page sizes by relative path, in LRU order, and eviction down to ``capacity`` bytes.

    A page that cannot be removed (permission denied, already gone) is skipped, counted and
    dropped from the index, so eviction never wedges; its bytes then stay on disk outside the
    budget. Evictions are counted into ``counters`` (the :data:`EVICTION_COUNTERS` keys), a dict
    the caller owns and guards with the same lock.
    """

    def __init__(self, root: str, capacity: int, counters: dict[str, int]) -> None:
        self.capacity = capacity
        #: Bytes admitted for writes not yet published (see :meth:`admit`).
        self.reserved = 0
        self._root = root
        self._counters = counters
        self._pages, self.total_bytes = scan_pages(root)

    def __len__(self) -> int:
        return len(self._pages)

    def touch(self, pages: list[tuple[str, int]]) -> None:
        """Pages were read: make ``pages`` (relative path, size) the most recently used, the first
        of them most of all.

        A prefix is useless without its head, so within one call the earlier pages are evicted
        last. A page missing from the index (another process wrote it) is added, and pages beyond
        the capacity are then evicted.
        """
        for rel, size in reversed(pages):
            if rel in self._pages:
                self._pages.move_to_end(rel)
            else:
                self._pages[rel] = size
                self.total_bytes += size
        self.evict()

    def admit(self, pages: list[tuple[str, int]]) -> tuple[int, Reservation]:
        """Make room for one put call's distinct ``pages`` (relative path, size), head of the prefix first.

        Returns how many of them, from the first, fit together in the capacity left beside other
        calls' reservations: the caller writes those and no others (writing the rest would only
        evict the head). Those already stored become the most recently used, the first most of
        all; then least recently used pages of other calls are evicted until the admitted bytes
        fit beside what stays. Pass the reservation to :meth:`publish` for each page written and
        to :meth:`settle` when the call is done.
        """
        room = self.capacity - self.reserved
        count = fitted = 0
        for _, size in pages:
            if fitted + size > room:
                break
            fitted += size
            count += 1
        admitted = pages[:count]
        for rel, _ in reversed(admitted):
            if rel in self._pages:
                self._pages.move_to_end(rel)
        reservation = {rel: max(0, size - self._pages.get(rel, 0)) for rel, size in admitted}
        self.reserved += sum(reservation.values())
        self.evict(keep=reservation)
        return count, reservation

    def publish(self, rel: str, size: int, reservation: Reservation) -> None:
        """An admitted page was just published at ``rel``: its reserved bytes are now stored bytes."""
        old = self._pages.pop(rel, 0)
        self.total_bytes += size - old
        self._pages[rel] = size
        self.reserved -= reservation.pop(rel, 0)

    def settle(self, reservation: Reservation, stored: list[str]) -> None:
        """One put call is done: release what its unwritten pages reserved, make its ``stored``
        pages (head first) the most recently used, the first most of all, and evict any excess
        (left by a concurrent call, or by a page that grew while it was written)."""
        self.reserved -= sum(reservation.values())
        reservation.clear()
        for rel in reversed(stored):
            if rel in self._pages:
                self._pages.move_to_end(rel)
        self.evict()

    def forget(self, rel: str) -> None:
        """Drop one page (deleted, or found missing); unknown paths are ignored."""
        self.total_bytes -= self._pages.pop(rel, 0)

    def forget_prefix(self, prefix: str) -> None:
        """Drop every page whose relative path starts with ``prefix`` (a cleared namespace)."""
        for rel in [rel for rel in self._pages if rel.startswith(prefix)]:
            self.total_bytes -= self._pages.pop(rel)

    def evict(self, keep: Container[str] = ()) -> None:
        """Remove least recently used page files until the pages known and the reserved bytes fit
        in ``capacity``; stop at the first page in ``keep`` rather than remove it."""
        while self.total_bytes + self.reserved > self.capacity and self._pages:
            rel = next(iter(self._pages))
            if rel in keep:
                break
            size = self._pages.pop(rel)
            self.total_bytes -= size
            try:
                os.unlink(f"{self._root}/{rel}")
            except FileNotFoundError:
                self._counters["evictions_vanished"] += 1
            except OSError as exc:
                self._counters["evictions_failed"] += 1
                self._counters["unremovable_bytes"] += size
                logger.warning(
                    "file backend: cannot evict %s/%s (%s); skipped, its %d bytes stay on disk outside the capacity",
                    self._root,
                    rel,
                    exc.strerror or exc,
                    size,
                )
            else:
                self._counters["evictions"] += 1
                self._counters["evicted_bytes"] += size


def scan_pages(root: str) -> tuple[OrderedDict[str, int], int]:
    """Every page file under ``root``, oldest modification first, with the total of their sizes.

    A directory that cannot be read is logged and its pages are not counted.
    """
    found: list[tuple[int, str, int]] = []

    def walk(rel: str, depth: int) -> None:
        try:
            entries = list(os.scandir(f"{root}/{rel}" if rel else root))
        except OSError as exc:
            logger.warning("file backend: cannot scan %s/%s (%s); its pages are not counted", root, rel, exc)
            return
        for entry in entries:
            if not COMPONENT_RE.fullmatch(entry.name):
                continue  # .tmp, namespace.json, or something that is not ours
            child = f"{rel}/{entry.name}" if rel else entry.name
            if depth < PAGE_DEPTH - 1:
                if entry.is_dir(follow_symlinks=False):
                    walk(child, depth + 1)
            elif entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime_ns, child, st.st_size))

    walk("", 0)
    found.sort()
    return OrderedDict((rel, size) for _, rel, size in found), sum(size for _, _, size in found)
