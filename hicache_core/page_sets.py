"""Bounded sets of page hashes the core remembers about its store: pages the store reported yet
could not read back (the backup rewrites them instead of skipping them), and pages the engine's
backups stored (what the store holds, known without asking it)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable


class PageSet:
    """Page hashes, bounded: past ``capacity`` the least recently added are forgotten (their pages
    stay as they are in the store; only this record of them goes). Thread-safe: the prefetch and
    backup threads add, look up and forget."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._hashes: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, hashes: Iterable[str]) -> None:
        with self._lock:
            for page_hash in hashes:
                self._hashes[page_hash] = None
                self._hashes.move_to_end(page_hash)
            while len(self._hashes) > self.capacity:
                self._hashes.popitem(last=False)

    def among(self, hashes: list[str]) -> list[int]:
        """Indices of the suspect pages in ``hashes``."""
        with self._lock:
            return [i for i, page_hash in enumerate(hashes) if page_hash in self._hashes]

    def forget(self, hashes: Iterable[str]) -> None:
        with self._lock:
            for page_hash in hashes:
                self._hashes.pop(page_hash, None)

    def leading(self, hashes: list[str]) -> int:
        """How many of ``hashes``, from the first, are in the set."""
        with self._lock:
            count = 0
            for page_hash in hashes:
                if page_hash not in self._hashes:
                    break
                count += 1
            return count

    def __contains__(self, page_hash: object) -> bool:
        with self._lock:
            return page_hash in self._hashes

    def __len__(self) -> int:
        with self._lock:
            return len(self._hashes)
