"""KV memory: the device pool (L1), the host pool (L2) and the page allocator both use.

Both pools hand out whole pages of ``page_size`` token slots; an index tensor always lists every
slot of every page it covers, so slot ``i * page_size`` starts page ``i`` of an allocation.

The device pool is layer-first, ``(halves, layers, slots, heads, head_dim)`` (halves: 2 for MHA
K/V, 1 for MLA's latent), because that is what attention reads. The host pool uses one of the
three host layouts of :mod:`hicache_storage.kernels` and gives storage zero-copy views of a page:
two segments (K half, V half) for MHA ``page_first`` and ``page_first_direct``, one for MLA, and
``halves * layers`` for ``layer_first``, whose pages are scattered one run per layer (that cost
is the point of comparing layouts).

Thread safety: :class:`PageAllocator` is thread-safe (the prefetch thread releases pages). The
pools' tensors are shared; who may touch which slots is decided by the radix tree and the cache
controller.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Protocol
from dataclasses import dataclass

import numpy as np
import torch

from hicache_storage.kernels import KVLayout, host_shape

log = logging.getLogger(__name__)

#: Pinned host memory is registered with CUDA in chunks of this size: one huge registration can
#: take seconds and fail where several smaller ones succeed.
PIN_CHUNK_BYTES = 1 << 30

#: Memory left to the rest of the machine when sizing the host pool.
HOST_MEMORY_HEADROOM_BYTES = 1 << 30


class HostMemoryError(MemoryError):
    """The host pool asked for more RAM than the machine has available."""


@dataclass(frozen=True)
class KVGeometry:
    """Shape and type of one token's KV in one layer: what the pools are made of."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    is_mla: bool = False

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVGeometry.{name} must be a positive int, got {value!r}")
        if self.is_mla and self.kv_heads != 1:
            raise ValueError(f"an MLA cache stores one latent per token: kv_heads must be 1, got {self.kv_heads}")

    @property
    def halves(self) -> int:
        return 1 if self.is_mla else 2

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's KV across all layers and halves."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.halves * self.layers * self.kv_heads * self.head_dim * itemsize

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


class Settling(Protocol):
    """An abandoned call that reports when it has really returned (``StorageTimeoutError``)."""

    def when_settled(self, callback: Callable[[], object]) -> None: ...


class PageAllocator:
    """Whole-page allocation of ``num_pages * page_size`` slots, with I/O pins.

    ``alloc`` returns the slot indices of the pages it took, or ``None`` when there are not enough
    free pages (never a partial allocation). A page with I/O in flight is *pinned*
    (:meth:`pin_io`); freeing it only marks it, and it returns to the free list when the last pin
    is released, so no page is reused while a transfer may still read or write it.

    A freed page still under I/O counts as free (``free_pages``): when ``alloc`` needs it, it
    waits for the I/O to end (storage calls are bounded by the controller's timeout). Counting
    it keeps every decision that depends on free space independent of I/O timing, which is what
    keeps tensor-parallel ranks' trees identical. (``alloc_evicting`` with ``agree`` evicts
    rather than wait, with the count agreed between ranks.)

    Except for I/O its caller *abandoned* (:meth:`unpin_io_when_settled`: a zero-copy storage call that timed
    out and may never return): its pages stop counting as free until that pin is released, so a
    hung store costs the pages it holds, never a wait. That one case depends on timing.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 0 or page_size <= 0:
            raise ValueError(f"need num_pages >= 0 and page_size > 0, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._lock = threading.Condition()
        #: Free pages as a heap: ``alloc`` takes the lowest, so pages freed together come back
        #: together and a transfer's slots form long runs (one copy call each) instead of scattering.
        self._free: list[int] = list(range(num_pages))
        self._allocated = bytearray(num_pages)
        self._pins: dict[int, int] = {}
        self._free_when_unpinned: set[int] = set()
        self._abandoned: dict[int, int] = {}
        self._offsets = np.arange(page_size, dtype=np.int64)
        #: How many ``free`` calls there were: a caller that failed to allocate may skip retrying
        #: until this moves. (A page freed under I/O counts as free at once, see ``free_pages``,
        #: so the end of the I/O, which differs between ranks, need not move it.)
        self.releases = 0
        #: Callers of ``alloc`` waiting now for the I/O on freed pages to end (``awaited``).
        self._waiting = 0

    @property
    def awaited(self) -> bool:
        """Whether an ``alloc`` waits now for the I/O on freed pages to end: whoever holds such a
        pin should not linger (a storage backup resting between its puts,
        :meth:`hicache_core.backup.StorageBackup._rest`). A hint for I/O threads' pacing; it
        changes nothing an allocation gets."""
        return self._waiting > 0

    @property
    def free_pages(self) -> int:
        """Pages free now or as soon as their in-flight I/O ends."""
        with self._lock:
            return len(self._free) + self._waitable()

    def _waitable(self) -> int:
        """Freed pages whose I/O will end (bounded): those an abandoned call pins are not."""
        if not self._abandoned:
            return len(self._free_when_unpinned)
        return sum(1 for page in self._free_when_unpinned if page not in self._abandoned)

    @property
    def abandoned_pages(self) -> int:
        """Pages pinned by I/O its caller abandoned (``unpin_io_when_settled``) that has not returned."""
        with self._lock:
            return len(self._abandoned)

    @property
    def idle_pages(self) -> int:
        """Pages that can be handed out without waiting."""
        with self._lock:
            return len(self._free)

    def alloc(self, num_tokens: int, *, wait: bool = True) -> torch.Tensor | None:
        """Slots of ``ceil(num_tokens / page_size)`` fresh pages, or ``None`` if that many are not
        free (``wait=False``: not free now, without waiting for pages freed under I/O)."""
        count = -(-num_tokens // self.page_size)
        with self._lock:
            if count > len(self._free) + (self._waitable() if wait else 0):
                return None
            if count > len(self._free):
                self._waiting += 1
                try:
                    self._lock.wait_for(lambda: count <= len(self._free) or count > len(self._free) + self._waitable())
                finally:
                    self._waiting -= 1
            if count > len(self._free):
                return None  # a call pinning the pages was abandoned while we waited
            pages = [heapq.heappop(self._free) for _ in range(count)]
            for page in pages:
                self._allocated[page] = 1
        return self.slots_of(pages)

    def alloc_evicting(
        self, num_tokens: int, evict: Callable[[int], object], agree: Callable[[int], int] | None = None, *, wait: bool = True
    ) -> torch.Tensor | None:
        """``alloc``; when too few pages are free, ``evict(tokens)`` the shortfall (whole pages of
        tokens) and try once more. ``None`` if eviction could not free enough.

        With ``agree`` (a reduction every TP rank calls here: the ranks' MAX), the shortfall is
        counted against the pages free now, not those freed under I/O, and every rank evicts the
        agreed count: the caller waits for I/O only where eviction cannot free the pages. Waiting
        instead for the storage backups that pin freed pages (the newest turns of conversations
        evicted from the device, still being written through) held the scheduler thread up to
        0.9 s at a time, 2.0 s of a 7.4 s run, in the long-history bench's file store at the H200
        point (5.2-6.2 s -> 4.7-5.3 s a run, three pairs)."""
        count = -(-num_tokens // self.page_size)
        if agree is not None:
            missing = agree(max(0, count - self.idle_pages))
            if missing:
                evict(missing * self.page_size)
            return self.alloc(num_tokens, wait=wait)
        slots = self.alloc(num_tokens)
        if slots is None:
            evict((count - self.free_pages) * self.page_size)
            slots = self.alloc(num_tokens)
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Return the pages covering ``slots`` (whole pages, as ``alloc`` gave them)."""
        pages = self.pages_of(slots)
        with self._lock:
            self.releases += 1
            for page in pages:
                if not self._allocated[page]:
                    raise ValueError(f"page {page} freed twice or never allocated")
                if page in self._pins:
                    self._free_when_unpinned.add(page)
                else:
                    self._allocated[page] = 0
                    heapq.heappush(self._free, page)

    def pin_io(self, slots: torch.Tensor) -> None:
        """Mark the pages covering ``slots`` as having I/O in flight."""
        pages = self.pages_of(slots)  # outside the lock: a tensor call may give the GIL away
        with self._lock:
            for page in pages:
                self._pins[page] = self._pins.get(page, 0) + 1

    def unpin_io_when_settled(self, slots: torch.Tensor, abandoned: Settling | None) -> None:
        """Release one pin now, or, for I/O its caller abandoned (a call that timed out but may
        still use the pages: ``abandoned.when_settled``), once that call returns; until then the
        pages do not count as free and no alloc waits for them."""
        if abandoned is None:
            self.unpin_io(slots)
            return
        pages = self.pages_of(slots)
        with self._lock:
            for page in pages:
                self._abandoned[page] = self._abandoned.get(page, 0) + 1
            self._lock.notify_all()
        abandoned.when_settled(lambda: self.unpin_io(slots, abandoned=True))

    def unpin_io(self, slots: torch.Tensor, *, abandoned: bool = False) -> None:
        """Release one pin (an abandoned one, see ``unpin_io_when_settled``); a page freed
        meanwhile goes back to the free list now."""
        pages = self.pages_of(slots)
        with self._lock:
            for page in pages:
                if abandoned:
                    if self._abandoned[page] == 1:
                        del self._abandoned[page]
                    else:
                        self._abandoned[page] -= 1
                left = self._pins[page] - 1
                if left:
                    self._pins[page] = left
                    continue
                del self._pins[page]
                if page in self._free_when_unpinned:
                    self._free_when_unpinned.discard(page)
                    self._allocated[page] = 0
                    heapq.heappush(self._free, page)
                    self._lock.notify_all()

    def pages_of(self, slots: torch.Tensor) -> list[int]:
        page_size = self.page_size
        if slots.numel() % page_size:
            raise ValueError(f"{slots.numel()} slots is not a whole number of {page_size}-slot pages")
        # One tensor call, then plain Python: on the scheduler thread each tensor call is a
        # chance for the GIL to go to an I/O thread, which cost more than the arithmetic.
        firsts = slots[::page_size].tolist()
        if any(first % page_size for first in firsts):
            raise ValueError("slot lists must start each page at a page boundary")
        return [first // page_size for first in firsts]

    def slots_of(self, pages: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The slots of ``pages`` (a list or a CPU tensor), page by page.

        Built with numpy, wrapped as a tensor: the scheduler thread allocates on every start and
        finish, and each torch call is a chance to lose the GIL to an I/O thread (0.4 ms each at
        the long-history shape, five per allocation when this was tensor arithmetic)."""
        firsts = np.asarray(pages, dtype=np.int64)[:, None] * self.page_size
        return torch.from_numpy((firsts + self._offsets).reshape(-1))


class DevicePool:
    """L1: the layer-first KV tensor on the accelerator (CUDA when present, else the CPU)."""

    def __init__(self, geometry: KVGeometry, num_pages: int, page_size: int, device: torch.device | str | None = None) -> None:
        self.geometry = geometry
        self.page_size = page_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        slots = num_pages * page_size
        self.kv = torch.zeros(
            (geometry.halves, geometry.layers, slots, geometry.kv_heads, geometry.head_dim),
            dtype=geometry.dtype,
            device=self.device,
        )
        self.allocator = PageAllocator(num_pages, page_size)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages


def available_memory_bytes() -> int | None:
    """RAM the kernel reports as available (MemAvailable), or free pages via sysconf; None if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class HostPool:
    """L2: host KV in one of the host layouts, pinned when CUDA is present.

    Size it with exactly one of ``num_pages``, ``ratio`` (times the device pool's pages) or
    ``size_bytes``. Raises :class:`HostMemoryError` naming the sizes when the machine lacks the
    RAM (available memory minus a 1 GiB headroom).
    """

    def __init__(
        self,
        geometry: KVGeometry,
        page_size: int,
        layout: KVLayout | str = KVLayout.PAGE_FIRST,
        *,
        num_pages: int | None = None,
        ratio: float | None = None,
        size_bytes: int | None = None,
        device_pool: DevicePool | None = None,
        pin: bool | None = None,
    ) -> None:
        self.geometry = geometry
        self.page_size = page_size
        self.layout = KVLayout(layout)
        self.page_bytes = geometry.token_bytes * page_size
        pages = self._size_in_pages(num_pages, ratio, size_bytes, device_pool)
        self._check_ram(pages, ratio, size_bytes)
        shape = host_shape(
            self.layout,
            halves=geometry.halves,
            layers=geometry.layers,
            slots=max(pages, 1) * page_size,
            heads=geometry.kv_heads,
            head_dim=geometry.head_dim,
            page_size=page_size,
        )
        self.kv = torch.empty(shape, dtype=geometry.dtype)
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self._registered: list[int] = []
        if self.pinned:
            self._register_pinned()
        else:
            # Resident from the start, as pinned memory is: a page the kernel maps on its first
            # write costs several times its copy, and faulting in threads that copy, read from
            # storage and write to it at once contend on the process's memory map (a first-touch
            # backup ran 25x slower than a copy into touched pages).
            self.kv.zero_()
        self.allocator = PageAllocator(pages, page_size)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def _size_in_pages(self, num_pages: int | None, ratio: float | None, size_bytes: int | None, device_pool: DevicePool | None) -> int:
        given = [name for name, value in (("num_pages", num_pages), ("ratio", ratio), ("size_bytes", size_bytes)) if value is not None]
        if len(given) != 1:
            raise ValueError(f"size the host pool with exactly one of num_pages, ratio, size_bytes; got {given or 'none'}")
        if num_pages is not None:
            pages = num_pages
        elif ratio is not None:
            if device_pool is None:
                raise ValueError("ratio sizes the host pool relative to the device pool: pass device_pool")
            pages = int(device_pool.num_pages * ratio)
        else:
            assert size_bytes is not None  # exactly one of the three was given (checked above)
            pages = int(size_bytes) // self.page_bytes
        if pages <= 0:
            raise ValueError(
                f"the host pool would hold {pages} pages (page = {self.page_bytes} bytes); raise its size or ratio"
            )
        return pages

    def _check_ram(self, pages: int, ratio: float | None, size_bytes: int | None) -> None:
        needed = pages * self.page_bytes
        available = available_memory_bytes()
        if available is None or needed <= available - HOST_MEMORY_HEADROOM_BYTES:
            return
        asked = f"ratio={ratio}" if ratio is not None else f"size_bytes={size_bytes}" if size_bytes is not None else f"{pages} pages"
        raise HostMemoryError(
            f"the host KV pool needs {needed / 2**30:.2f} GiB ({asked}, {pages} pages of {self.page_bytes} bytes) "
            f"but only {available / 2**30:.2f} GiB of RAM is available (keeping {HOST_MEMORY_HEADROOM_BYTES / 2**30:.0f} GiB "
            "for the rest of the machine); lower the host ratio or size, or free memory"
        )

    def _register_pinned(self) -> None:
        cudart = torch.cuda.cudart()
        base, total = self.kv.data_ptr(), self.kv.numel() * self.kv.element_size()
        for offset in range(0, total, PIN_CHUNK_BYTES):
            size = min(PIN_CHUNK_BYTES, total - offset)
            status = cudart.cudaHostRegister(base + offset, size, 0)
            if int(status) != 0:
                raise HostMemoryError(f"cudaHostRegister failed ({status}) pinning {size} bytes of the host KV pool")
            self._registered.append(base + offset)

    def close(self) -> None:
        """Unregister pinned memory; the pool must not be used afterwards."""
        if self._registered:
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
            self._registered.clear()

    def as_buffer(self) -> memoryview:
        """The whole pool as one flat byte view (for ``Store.register_buffer``)."""
        return self.kv.view(-1).view(torch.uint8).numpy().data.cast("B")

    def page_segments(self, first_slot: int) -> list[torch.Tensor]:
        """Zero-copy views of the page starting at ``first_slot``; their concatenation is the stored value."""
        ps = self.page_size
        kv = self.kv
        if self.layout is KVLayout.PAGE_FIRST:
            return [kv[h, first_slot : first_slot + ps] for h in range(kv.shape[0])]
        if self.layout is KVLayout.PAGE_FIRST_DIRECT:
            return [kv[h, first_slot // ps] for h in range(kv.shape[0])]
        return [kv[h, layer, first_slot : first_slot + ps] for h in range(kv.shape[0]) for layer in range(kv.shape[1])]

    def segments_for(self, slots: torch.Tensor) -> list[list[torch.Tensor]]:
        """Segments of every page covered by ``slots`` (whole pages), in order."""
        return [self.page_segments(int(first)) for first in slots[:: self.page_size].tolist()]
