"""The hf3fs backend's slot index in this process, and where a published page lives.

A page is written into a free slot of its writer's files and then *published* under its key;
readers find it through the index. Every slot has a generation, incremented each time the slot is
handed out again, so a reader can tell (after reading) whether its slot was reused meanwhile.

The in-process index is shared by the instances of one process with the same root and rank;
another process is kept off that rank's files by a lock file. The Redis index with the same
methods is in ``_hf3fs_redis_index``.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from hicache_storage.errors import ConfigError


@dataclass(frozen=True)
class Location:
    """Where one published page lives, and the generation its slot had when it was written."""

    rank: int
    slot: int  # slot number within the rank: file = slot % numjobs, index = slot // numjobs
    file: int
    offset: int
    length: int
    generation: int

    def encode(self) -> str:
        """The ``|``-separated text the Redis index stores (its Lua scripts parse rank and slot from it)."""
        return f"{self.rank}|{self.slot}|{self.file}|{self.offset}|{self.length}|{self.generation}"

    @classmethod
    def decode(cls, text: str | bytes) -> Location:
        """The location :meth:`encode` wrote."""
        if isinstance(text, bytes):
            text = text.decode()
        return cls(*(int(part) for part in text.split("|")))


class LocalSlotIndex:
    """The slot index in this process: key -> location, LRU order, free slots, generations.

    ``capacity`` (slots) is set by the backend once the page size is known. Thread-safe.
    """

    def __init__(self, rank: int, capacity: int) -> None:
        self.rank = rank
        self.capacity = capacity
        self.page_size: int | None = None
        self._lock = threading.Lock()
        self._pages: OrderedDict[str, Location] = OrderedDict()  # LRU order, oldest first
        self._free: list[int] = []
        self._next = 0
        self._generations: dict[int, int] = {}

    def fix_page_size(self, size: int) -> int:
        """The index's slot size: ``size`` unless one was fixed before, which then wins."""
        with self._lock:
            if self.page_size is None:
                self.page_size = size
            return self.page_size

    def lookup(self, names: list[str]) -> list[Location | None]:
        """Each name's published location, ``None`` for a miss."""
        with self._lock:
            return [self._pages.get(name) for name in names]

    def reserve(self, count: int) -> list[tuple[int, int]]:
        """``count`` (slot, generation) pairs no key points at, evicting LRU pages when full."""
        taken = []
        with self._lock:
            for _ in range(count):
                if self._free:
                    slot = self._free.pop()
                elif self._next < self.capacity:
                    slot, self._next = self._next, self._next + 1
                elif self._pages:
                    slot = self._pages.popitem(last=False)[1].slot  # every page here is this rank's
                else:
                    break
                generation = self._generations.get(slot, 0) + 1
                self._generations[slot] = generation
                taken.append((slot, generation))
        return taken

    def publish(self, pages: list[tuple[str, Location]]) -> None:
        """Point each name at its freshly written slot, in order (the last of a repeated name
        wins); a replaced slot is freed. The pages become the most recently used, the first most
        of all: a prefix is useless without its head, so a later eviction takes its tail first."""
        with self._lock:
            for name, location in pages:
                old = self._pages.pop(name, None)
                self._pages[name] = location
                if old is not None and old.slot != location.slot:
                    self._free.append(old.slot)
            for name, _ in reversed(pages):
                self._pages.move_to_end(name)

    def release(self, slots: list[int]) -> None:
        """Give back reserved slots that were never published (their write failed)."""
        with self._lock:
            self._free.extend(slots)

    def still_valid(self, locations: list[Location], names: list[str]) -> list[bool]:
        """Whether each slot still has the generation it had when read; refreshes LRU order of the valid."""
        with self._lock:
            valid = [self._generations.get(loc.slot) == loc.generation for loc in locations]
            for name, ok in zip(names, valid):
                if ok and name in self._pages:
                    self._pages.move_to_end(name)
            return valid

    def remove(self, names: list[str]) -> list[bool]:
        """Unpublish each name and free its slot; ``True`` where the name was published."""
        with self._lock:
            results = []
            for name in names:
                old = self._pages.pop(name, None)
                if old is not None:
                    self._free.append(old.slot)
                results.append(old is not None)
            return results

    def names_with_prefix(self, prefix: str) -> list[str]:
        """Every published name starting with ``prefix`` (a namespace being cleared)."""
        with self._lock:
            return [name for name in self._pages if name.startswith(prefix)]


# In-process indexes, one per (root, rank), shared by the instances of this process that open
# it, with a count of users. The first opener takes an exclusive flock on the rank's lock file so
# that no other process writes the same slots with an index of its own.
_LOCAL_INDEXES: dict[tuple[Path, int], tuple[LocalSlotIndex, int, int]] = {}
_LOCAL_INDEXES_LOCK = threading.Lock()


def open_local_index(root: Path, rank: int) -> LocalSlotIndex:
    """This process's index of ``rank`` under ``root``, counted as one more user.

    Raises ``ConfigError`` when another process holds the rank's lock file. Pair each call with
    :func:`close_local_index`.
    """
    with _LOCAL_INDEXES_LOCK:
        entry = _LOCAL_INDEXES.get((root, rank))
        if entry is not None:
            index, lock_fd, users = entry
            _LOCAL_INDEXES[(root, rank)] = (index, lock_fd, users + 1)
            return index
        lock_fd = os.open(root / f"rank{rank}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock_fd)
            raise ConfigError(
                f"rank {rank} of {str(root)!r} is in use by another process with its own slot index; "
                "give each process its own rank, or share the index with metadata_url='redis://...'",
                field="metadata_url",
                backend="hf3fs",
            ) from None
        index = LocalSlotIndex(rank, 0)
        _LOCAL_INDEXES[(root, rank)] = (index, lock_fd, 1)
        return index


def close_local_index(root: Path, rank: int) -> None:
    """One user fewer; the last one drops the index (its pages are forgotten) and the lock file's lock."""
    with _LOCAL_INDEXES_LOCK:
        index, lock_fd, users = _LOCAL_INDEXES[(root, rank)]
        if users > 1:
            _LOCAL_INDEXES[(root, rank)] = (index, lock_fd, users - 1)
        else:
            del _LOCAL_INDEXES[(root, rank)]
            os.close(lock_fd)  # releases the flock
