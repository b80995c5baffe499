"""The file backend's capacity index: the pages under its root, least recently used first.

Built at start by scanning the root (oldest modification time first), then kept in memory only:
reads refresh recency here, never on disk, so after a restart recency is by last write. The
index covers the pages this instance knows (found at start, written or read by it); several
processes writing one capped root each enforce their own view.

Not thread-safe: the file backend calls every method under its lock, and holds that lock across
a page's publication too, so a rename and its index entry change together.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict

from hicache_storage.connectors._file_tree import COMPONENT_RE, PAGE_DEPTH

# The file backend's logger, so one name configures everything that backend does.
logger = logging.getLogger("hicache_storage.connectors.file")

#: The counters eviction increments, in the order ``stats()`` reports them.
EVICTION_COUNTERS = ("evictions", "evicted_bytes", "evictions_failed", "evictions_vanished", "unremovable_bytes")


class LruPageIndex:
    """Page sizes by relative path, in LRU order, and eviction down to ``capacity`` bytes.

    A page that cannot be removed (permission denied, already gone) is skipped, counted and
    dropped from the index, so eviction never wedges; its bytes then stay on disk outside the
    budget. Evictions are counted into ``counters`` (the :data:`EVICTION_COUNTERS` keys), a dict
    the caller owns and guards with the same lock.
    """

    def __init__(self, root: str, capacity: int, counters: dict[str, int]) -> None:
        self.capacity = capacity
        self._root = root
        self._counters = counters
        self._pages, self.total_bytes = scan_pages(root)

    def __len__(self) -> int:
        return len(self._pages)

    def touch(self, pages: list[tuple[str, int]], *, learn: bool) -> None:
        """Make ``pages`` (relative path, size) the most recently used, the first of them most of all.

        A prefix is useless without its head, so within one call the earlier pages are evicted
        last. With ``learn``, a page missing from the index (another process wrote it) is added,
        and pages beyond the capacity are then evicted.
        """
        for rel, size in reversed(pages):
            if rel in self._pages:
                self._pages.move_to_end(rel)
            elif learn:
                self._pages[rel] = size
                self.total_bytes += size
        if learn:
            self.evict()

    def record_write(self, rel: str, size: int) -> None:
        """A page was just published at ``rel``: it is now the most recently used; evict beyond capacity."""
        old = self._pages.pop(rel, None)
        self.total_bytes += size - (old or 0)
        self._pages[rel] = size
        self.evict()

    def forget(self, rel: str) -> None:
        """Drop one page (deleted, or found missing); unknown paths are ignored."""
        self.total_bytes -= self._pages.pop(rel, 0)

    def forget_prefix(self, prefix: str) -> None:
        """Drop every page whose relative path starts with ``prefix`` (a cleared namespace)."""
        for rel in [rel for rel in self._pages if rel.startswith(prefix)]:
            self.total_bytes -= self._pages.pop(rel)

    def evict(self) -> None:
        """Remove least recently used page files until the pages known fit in ``capacity``."""
        while self.total_bytes > self.capacity and self._pages:
            rel, size = self._pages.popitem(last=False)
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
