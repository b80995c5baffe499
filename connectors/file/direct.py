"""Whole-page file I/O for the file backend, and the alignment O_DIRECT asks of it.

Reads and writes use ``os.preadv`` / ``os.pwritev`` straight into and out of the caller's
segments. With ``O_DIRECT`` the kernel needs 4096-aligned addresses and sizes: segments that are
not aligned (or are read-only) go through an mmap-backed aligned bounce buffer (one per thread,
as large as the largest page seen), which costs one memory copy; aligned segments (a
page-aligned host pool with 4 KiB-multiple pages) stay zero-copy.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Callable

from hicache_storage.buffers import Segments, fill_segments
from hicache_storage.connectors.file.temp import unlink_quietly
from hicache_storage.errors import ConfigError
from hicache_storage.vectored_io import preadv_full, pwritev_full

#: O_DIRECT alignment for addresses, sizes and offsets (the largest common logical block size).
DIRECT_ALIGNMENT = 4096


class PageIO:
    """Reads and writes one whole page at offset 0 of an open page file.

    ``direct`` says the files are opened with ``O_DIRECT``: unaligned segments then bounce
    through this thread's aligned buffer, and ``on_bounce`` is called once per bounced page.
    Thread-safe: each thread has its own bounce buffer.
    """

    def __init__(self, *, direct: bool, on_bounce: Callable[[], None]) -> None:
        self._direct = direct
        self._on_bounce = on_bounce
        self._thread_local = threading.local()

    def read(self, fd: int, target: Segments, size: int) -> bool:
        """Fill ``target`` (``size`` bytes in all) from the file; ``False`` if the file ended first."""
        segments = [view for view in target if view.nbytes]
        if not segments:
            return True
        if self._direct and not is_aligned(segments):
            bounce = self._bounce(size)
            if preadv_full(fd, [bounce[: round_up(size)]], 0, size) != size:
                return False
            fill_segments(segments, bounce[:size])
            self._on_bounce()
            return True
        return preadv_full(fd, segments, 0, size) == size

    def write(self, fd: int, source: Segments, size: int) -> None:
        """Write ``source`` (``size`` bytes in all) as the file's whole content; ``OSError`` as raised."""
        segments = [view for view in source if view.nbytes]
        if self._direct and not is_aligned(segments):
            padded = round_up(size)
            bounce = self._bounce(padded)
            offset = 0
            for view in segments:
                bounce[offset : offset + view.nbytes] = view
                offset += view.nbytes
            bounce[size:padded] = bytes(padded - size)
            pwritev_full(fd, [bounce[:padded]], 0)
            if padded != size:
                os.ftruncate(fd, size)
            self._on_bounce()
        elif segments:
            pwritev_full(fd, segments, 0)

    def _bounce(self, size: int) -> memoryview:
        """This thread's aligned (mmap-backed) buffer, at least ``size`` bytes, grown on demand."""
        buffer = getattr(self._thread_local, "bounce", None)
        if buffer is None or len(buffer) < size:
            buffer = mmap.mmap(-1, round_up(max(size, DIRECT_ALIGNMENT)))
            self._thread_local.bounce = buffer
        return memoryview(buffer)


def probe_direct_io(probe_path: str, root: str) -> int:
    """``os.O_DIRECT`` once a 4 KiB write and read through it worked at ``probe_path`` (removed after).

    Raises ``ConfigError`` (field ``direct_io``) when the platform lacks O_DIRECT or the filesystem
    under ``root`` refuses it.
    """
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        raise ConfigError(
            "direct_io needs O_DIRECT, which this platform lacks (Linux only); set direct_io=false",
            field="direct_io",
            backend="file",
        )
    block = mmap.mmap(-1, DIRECT_ALIGNMENT)
    try:
        fd = os.open(probe_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | flag, 0o600)
        try:
            os.pwritev(fd, [block], 0)
            os.preadv(fd, [block], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ConfigError(
            f"the filesystem under root {root!r} refuses O_DIRECT ({exc.strerror}); set direct_io=false "
            "or put root on a local disk filesystem such as ext4 or xfs",
            field="direct_io",
            backend="file",
        ) from None
    finally:
        block.close()
        unlink_quietly(probe_path)
    return flag


def is_aligned(segments: Segments) -> bool:
    """Whether O_DIRECT can use these segments as they are: writable, address and size 4 KiB-aligned."""
    for view in segments:
        if view.readonly or view.nbytes % DIRECT_ALIGNMENT:
            return False
        if ctypes.addressof(ctypes.c_char.from_buffer(view)) % DIRECT_ALIGNMENT:
            return False
    return True


def round_up(size: int) -> int:
    """``size`` rounded up to a multiple of :data:`DIRECT_ALIGNMENT`."""
    return -(-size // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT
