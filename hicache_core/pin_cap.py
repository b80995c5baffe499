"""A cap on the host pages that abandoned storage calls may pin, and the private buffers used at it.

A zero-copy storage call reads or writes host-pool pages directly. One that times out is
*abandoned*: it may still land, so its pages stay pinned until it really returns
(:meth:`~hicache_core.pools.PageAllocator.unpin_io_when_settled`), which for a store that hangs
may be never. :class:`PinCap` bounds those pages: before a call that would pin pages, the backup
and prefetch threads ask it for room, and at most ``cap_pages`` pages are ever pinned by
abandoned calls and calls in flight together. With no room left the call is made through
private buffers instead (a copy, counted in ``storage_staged_calls``): a hung one then holds
only its own buffers, never the pool's pages, so L3 keeps working with the rest of the pool
whatever number of calls hang.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from hicache_core.pools import PageAllocator


class PinCap:
    """Room for pages pinned by storage calls that may be abandoned (see the module docstring).

    Thread-safe. ``acquire(want)`` grants all ``want`` pages or none (``0``), never waiting: a
    write is never cut to the room left, so a batch reaches the store as the caller planned it (a
    backup cut into head-first pieces would make an LRU store evict the prefix's head); a read
    asks with ``least`` and is cut to the room instead (staging a large read through private
    buffers costs more than the call: fresh memory faults in on the first write). The
    caller makes a zero-copy call over the pages granted and calls ``release(granted)`` when it
    has returned, or, if it was abandoned, after its pages were marked abandoned in ``allocator``
    (so they are never counted out of both); with none granted it uses private buffers.
    ``cap_pages=None``: no cap (calls are never abandoned, as when the controller trusts the
    store to bound its calls).
    """

    def __init__(self, allocator: PageAllocator, cap_pages: int | None) -> None:
        if cap_pages is not None and cap_pages < 0:
            raise ValueError(f"the cap on pages pinned by abandoned calls must be >= 0, got {cap_pages}")
        self.allocator = allocator
        self.cap_pages = cap_pages
        self._lock = threading.Lock()
        self._in_flight = 0
        #: The most pages pinned by abandoned calls and calls in flight together, as granted.
        self.peak_pages = 0

    def acquire(self, want: int, *, least: int | None = None) -> int:
        """Room for ``want`` pages, or none. With ``least``, as much room as there is (at most
        ``want``) if that is ``least`` pages or more: for calls that may be cut, such as reads."""
        if self.cap_pages is None:
            return want
        with self._lock:
            pinned = self.allocator.abandoned_pages + self._in_flight
            room = self.cap_pages - pinned
            granted = want if want <= room else min(want, room) if least is not None and room >= least else 0
            self._in_flight += granted
            self.peak_pages = max(self.peak_pages, pinned + granted)
            return granted

    def release(self, granted: int) -> None:
        if self.cap_pages is None:
            return
        with self._lock:
            self._in_flight -= granted


def private_copy(buffer: Any, *, fill: bool) -> Any:
    """A buffer shaped like ``buffer`` (one tensor or a page's list of segment tensors) that no
    pool owns: a copy of it (``fill=True``, for a write) or uninitialized (for a read)."""
    if isinstance(buffer, (list, tuple)):
        return [private_copy(segment, fill=fill) for segment in buffer]
    assert isinstance(buffer, torch.Tensor)
    return buffer.clone() if fill else torch.empty_like(buffer)


def copy_back(targets: list[Any], sources: list[Any]) -> None:
    """Copy private buffers read into (``private_copy(..., fill=False)``) into the pool's pages."""
    for target, source in zip(targets, sources):
        if isinstance(target, (list, tuple)):
            copy_back(list(target), list(source))
        else:
            target.copy_(source)
