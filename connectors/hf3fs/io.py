"""The hf3fs backend's data path: moving one page between the caller's segments and a slot.

Rank ``r`` owns ``numjobs`` files ``<root>/rank<r>.<j>.data``, each ``file_size`` bytes (created
sparse with ``ftruncate``). Two ways to move bytes: POSIX ``preadv``/``pwritev`` (zero copy), or
3FS's usrbio rings through a registered shared-memory bounce buffer (``hf3fs_fuse.io``, imported
only when used).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from hicache_storage.buffers import Segments, segments_size
from hicache_storage.connectors.hf3fs.index import Location
from hicache_storage.vectored_io import preadv_full, pwritev_full


class PosixFiles:
    """``preadv``/``pwritev`` straight between the caller's segments and the data files.

    Descriptors are opened on first use and kept until :meth:`close`. Thread-safe.
    """

    zero_copy = True

    def __init__(self, root: Path, numjobs: int, file_size: int) -> None:
        self.root = root
        self.numjobs = numjobs
        self.file_size = file_size
        self._fds: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()

    def path(self, rank: int, file: int) -> Path:
        """The data file ``file`` of rank ``rank``."""
        return self.root / f"rank{rank}.{file}.data"

    def create(self, rank: int) -> None:
        """Create (or grow) this rank's files to ``file_size`` bytes, sparse."""
        for file in range(self.numjobs):
            fd = os.open(self.path(rank, file), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size < self.file_size:
                    os.ftruncate(fd, self.file_size)
            finally:
                os.close(fd)

    def fd(self, rank: int, file: int) -> int:
        """An open descriptor of one data file (another rank's file may not exist: ``OSError``)."""
        with self._lock:
            fd = self._fds.get((rank, file))
            if fd is None:
                fd = os.open(self.path(rank, file), os.O_RDWR)
                self._fds[(rank, file)] = fd
            return fd

    def read(self, loc: Location, target: Segments) -> bool:
        """False when the file ends first: not a page we wrote."""
        want = segments_size(target)
        return preadv_full(self.fd(loc.rank, loc.file), list(target), loc.offset, want) == want

    def write(self, loc: Location, source: Segments) -> bool:
        """Write the page into its slot; ``True``, or ``OSError`` as raised."""
        pwritev_full(self.fd(loc.rank, loc.file), list(source), loc.offset)
        return True

    def close(self) -> None:
        """Close every descriptor opened."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class UsrbioFiles(PosixFiles):
    """3FS's usrbio rings (``hf3fs_fuse.io``): I/O through a registered shared-memory bounce buffer.

    Never run against 3FS (no client was available); tested only against a stand-in binding.
    Follows the API as SGLang's
    ``hf3fs_usrbio_client`` uses it: ``register_fd``, ``make_iovec`` over a ``SharedMemory``,
    ``make_ioring(mount, entries, for_read, timeout, numa)``, ``prepare`` / ``submit().wait``.
    One read ring and one write ring, each serialized by a lock.
    """

    zero_copy = False

    def __init__(self, root: Path, numjobs: int, file_size: int, page_size: int, entries: int, timeout_s: float) -> None:
        super().__init__(root, numjobs, file_size)
        import datetime
        from multiprocessing.shared_memory import SharedMemory

        from hf3fs_fuse import io as usrbio

        self._usrbio = usrbio
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self.entries = entries
        mount = usrbio.extract_mount_point(str(root))
        self._rings = {}
        for for_read in (True, False):
            shm = SharedMemory(size=page_size * entries, create=True)
            iov = usrbio.make_iovec(shm, mount)
            ring = usrbio.make_ioring(mount, entries, for_read=for_read, timeout=1, numa=-1)
            shm.unlink()  # the mapping lives on in this process and in the 3FS client
            self._rings[for_read] = (shm, iov, ring, threading.Lock())
        self._registered: set[int] = set()

    def fd(self, rank: int, file: int) -> int:
        """An open descriptor of one data file, registered with usrbio on first use."""
        fd = super().fd(rank, file)
        with self._lock:
            if fd not in self._registered:
                self._usrbio.register_fd(fd)
                self._registered.add(fd)
        return fd

    def batch(self, for_read: bool, items: list[tuple[Location, Segments]]) -> list[bool]:
        """Read into (or write from) each item's segments, ``entries`` pages per submission.

        One result per item: ``True`` when the ring moved the page's whole length. Errors of the
        binding (``OSError``, ``RuntimeError``, ``TimeoutError``) propagate.
        """
        shm, iov, ring, lock = self._rings[for_read]
        buffer = shm.buf
        assert buffer is not None  # None only once closed, and close() drops the rings first
        results = []
        for start in range(0, len(items), self.entries):
            chunk = items[start : start + self.entries]
            with lock:
                starts = []
                position = 0
                for loc, segments in chunk:
                    starts.append(position)
                    size = segments_size(segments)
                    if not for_read:
                        _copy_into(buffer, position, segments)
                    ring.prepare(iov[position : position + size], for_read, self.fd(loc.rank, loc.file), loc.offset)
                    position += size
                done = ring.submit().wait(min_results=len(chunk), timeout=self._timeout)
                for (loc, segments), start, result in zip(chunk, starts, done):
                    ok = result.result == segments_size(segments)
                    if for_read and ok:
                        _copy_out(buffer, start, segments)
                    results.append(ok)
        return results

    def close(self) -> None:
        """Deregister the descriptors, drop the rings and their shared memory, close the files."""
        with self._lock:
            for fd in self._registered:
                self._usrbio.deregister_fd(fd)
            self._registered.clear()
        shms = [shm for shm, *_ in self._rings.values()]
        self._rings.clear()  # drop the rings and iovecs first: they hold views of the shared memory
        for shm in shms:
            shm.close()
        super().close()


def _copy_into(buffer: memoryview, position: int, segments: Segments) -> None:
    for view in segments:
        buffer[position : position + view.nbytes] = view
        position += view.nbytes


def _copy_out(buffer: memoryview, position: int, segments: Segments) -> None:
    for view in segments:
        view[:] = buffer[position : position + view.nbytes]
        position += view.nbytes


def usrbio_available() -> bool:
    """Whether 3FS's usrbio binding (``hf3fs_fuse.io``) can be imported here."""
    try:
        import hf3fs_fuse.io  # noqa: F401
    except ImportError:
        return False
    return True
