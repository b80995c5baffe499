"""Local-disk (NVMe) connector: one file per page under a root directory.

Layout (every name below the root is ``[0-9a-z_-]``, so nothing can climb out of it)::

    <root>/                                       created 0o700 if missing; never a symlink
      .tmp/                                       temp files being written, trash of cleared namespaces
      <namespace fingerprint>/namespace.json      the namespace's fields, for operators
      <namespace fingerprint>/<shard>/<part>/<hash[:2]>/<hash>

The ``<hash[:2]>`` fan-out directory keeps each directory at 1/256 of a part's pages.

Contracts:

* **Atomic publication.** A page is written to a temp file in ``<root>/.tmp`` (same filesystem)
  and renamed over its final path with ``os.replace``. A reader opens one inode and reads it
  whole, so it sees a complete old page, a complete new page, or nothing: never a torn page,
  even across processes. With ``fsync`` the file and its directory are flushed before ``put``
  returns. Temp files of a killed writer are removed when a backend next starts on the root.
* **Exact bytes or a miss.** A read first checks that the file's size equals the target's total
  size; any other size is a miss and the target is left unspecified, never reported as a hit.
* **Zero copy.** Reads and writes use ``os.preadv`` / ``os.pwritev`` straight into and out of
  the caller's segments, in parallel on a pool of ``io_threads`` threads. With ``direct_io``
  (``O_DIRECT``) the kernel needs 4096-aligned addresses and sizes: segments that are not
  aligned (or are read-only) go through an mmap-backed aligned bounce buffer (one per I/O
  thread, as large as the largest page seen), which costs one memory copy; aligned segments
  (a page-aligned host pool with 4 KiB-multiple pages) stay zero-copy.
  ``stats()["direct_bounce_ios"]`` counts the bounced pages.
* **Persistence and sharing.** Pages survive closing the backend and are visible to any
  process that opens the same root; other hosts see them only if the root is a shared mount
  (``shared_mount``).
* **Capacity.** With ``capacity_bytes``, an in-memory LRU index of the root (built at start by
  scanning it, oldest modification time first) makes room before each put: it evicts least
  recently used pages until the call's pages fit beside the bytes it knows of, so the pages on
  disk stay within the capacity. Reads refresh recency in memory only, so after a restart recency
  is by last write. Within one call the first pages count as the most recent (a prefix is useless
  without its head, so its tail goes first); a call larger than the capacity stores its head, as
  many pages as fit, and returns ``False`` for the rest without writing them
  (``puts_beyond_capacity``). A page that cannot be removed (permission denied, already gone) is
  skipped, counted (``evictions_failed`` / ``evictions_vanished``) and dropped from the index, so
  eviction never wedges; its bytes then stay on disk outside the budget. The budget covers the
  pages this instance knows: those found at start, written by it, or read by it. Several processes
  writing one capped root each enforce their own view.
* **Duplicate keys in one call.** Each distinct key is written once, with the bytes of its last
  occurrence (the last write wins), and every occurrence gets that write's result.
* **Full disk.** ``ENOSPC`` / ``EDQUOT`` while writing a page is that page's ``False`` (not
  stored) with one logged warning per call and a ``puts_no_space`` count: a full cache disk is a
  normal state for a cache, and the other pages of the batch keep their own results. Permission
  errors raise ``PermissionDeniedError``; other OS errors raise ``StorageError``; both name the
  operation, the key and the path. A page whose namespace is cleared while it is being written
  may come back ``False`` (``puts_lost_to_clear``): it was not stored, which a clear allows.
* **Symlinks.** The root, ``.tmp`` and every directory below the root must be real
  directories; a symlink in their place is refused (it could lead out of the root), and page
  files are opened with ``O_NOFOLLOW``.
* **Thread safety.** Every method may be called from several threads; ``close()`` waits for
  in-flight I/O and shuts the pool down.

The package's modules are listed in its docstring (:mod:`hicache_storage.connectors.file`).
"""

from __future__ import annotations

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pydantic

from hicache_storage.connector import Connector
from hicache_storage.batching import map_all
from hicache_storage.buffers import Segments, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.connectors.file.direct import PageIO, probe_direct_io
from hicache_storage.connectors.file.lru import EVICTION_COUNTERS, LruPageIndex, Reservation
from hicache_storage.connectors.file.temp import TMP_DIR, TempNames, prepare_tmp_dir, remove_stale_temp, unlink_quietly
from hicache_storage.connectors.file.tree import (
    COMPONENT_RE,
    DirectoriesVanished,
    PageDirectories,
    fsync_dir,
    locate,
    prepare_root,
    remove_tree,
)
from hicache_storage.errors import (
    CapacityError,
    ErrorStatus,
    InvalidKeyError,
    PermissionDeniedError,
    StorageError,
)
from hicache_storage.keys import Namespace, PageKey
from hicache_storage.vectored_io import pwritev_full

logger = logging.getLogger(__name__)

#: The file in each namespace directory that describes its namespace, for operators.
NAMESPACE_FILE = "namespace.json"

_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_TEMP = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)
#: OS errors that may pass: a busy or flaky device, a stale network mount, exhausted descriptors
#: or memory. Any other errno (a name too long, a file where a directory belongs) needs a fix.
_TRANSIENT = frozenset(
    {errno.EIO, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ETIMEDOUT, errno.ESTALE, errno.ENOLCK}
)

_COUNTERS = (
    *EVICTION_COUNTERS,
    "puts_beyond_capacity",
    "puts_no_space",
    "puts_lost_to_clear",
    "direct_bounce_ios",
    "stale_temp_removed",
)

T = TypeVar("T")

# What became of one page's write.
STORED, NO_SPACE, CLEARED = "stored", "no space", "cleared"


def _default_io_threads() -> int:
    """Half the CPUs this process may run on, 1 to 4. From the page cache a read or write is a
    memory copy on a CPU, so threads past the cores compete with the engine they serve: on 2
    cores, 4 threads read 2.3-2.6 GB/s at twice the CPU time of 1 thread's 3.7 GB/s, and made
    the hybrid long-history bench ~10% slower."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus // 2))


def _default_root() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache, "hicache-storage", "file")


class FileConfig(BackendConfig):
    """Settings of the file backend: where the pages live, how they are written, how many may stay."""

    root: str = pydantic.Field(
        default_factory=_default_root,
        min_length=1,
        description="directory holding the pages (created 0o700 if missing; must not be a symlink); "
        "default $XDG_CACHE_HOME/hicache-storage/file",
    )
    io_threads: int = pydantic.Field(
        default_factory=_default_io_threads,
        ge=1,
        le=256,
        description="threads doing page I/O in parallel, 1 to 256; default half the CPUs, at most 4 (1: on the calling thread)",
    )
    fsync: bool = pydantic.Field(False, description="flush each page file and its directory before put returns")
    direct_io: bool = pydantic.Field(
        False, description="bypass the page cache with O_DIRECT; the filesystem under root must support it"
    )
    capacity_bytes: int | None = pydantic.Field(
        None, gt=0, description="evict least recently used pages beyond this many bytes; omit for no limit"
    )
    shared_mount: bool = pydantic.Field(
        False, description="root is a mount other hosts also see (NFS, Lustre...): declares shared_across_hosts"
    )


class FileBackend(Connector):
    """Pages as files under ``config.root``. See the module docstring for every contract."""

    name = "file"
    Config = FileConfig
    config: FileConfig
    capabilities = Capabilities(
        zero_copy_read=True,
        zero_copy_write=True,
        native_batch_exists=True,
        delete=True,
        clear=True,
        persistent=True,
        shared_across_processes=True,
        outlives_writer=True,
    )

    def __init__(self, config: FileConfig | dict[str, Any] | str | None = None) -> None:
        super().__init__(config)
        self._root = prepare_root(self.config.root)
        self._tmp = f"{self._root}/{TMP_DIR}"
        self._lock = threading.Lock()  # guards the LRU index and the counters
        self._dirs = PageDirectories(self._root, fsync=self.config.fsync)
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._temp_names = TempNames(self._tmp)
        prepare_tmp_dir(self._tmp)
        self._counters["stale_temp_removed"] = remove_stale_temp(self._tmp)
        self._direct_flag = probe_direct_io(self._temp_path("probe"), self._root) if self.config.direct_io else 0
        self._io = PageIO(direct=bool(self._direct_flag), on_bounce=self._count_bounce)
        self._index: LruPageIndex | None = None
        capabilities = self.capabilities
        if self.config.capacity_bytes is not None:
            self._index = LruPageIndex(self._root, self.config.capacity_bytes, self._counters)
            with self._lock:
                self._index.evict()
            capabilities = capabilities.replace(
                evicts=True, max_value_size=self.config.capacity_bytes, capacity_bytes=self.config.capacity_bytes
            )
        if self.config.shared_mount:
            capabilities = capabilities.replace(shared_across_hosts=True)
        self.capabilities = capabilities
        self._pool = ThreadPoolExecutor(max_workers=self.config.io_threads, thread_name_prefix="hicache-file-io")

    # --- hooks --------------------------------------------------------------------------------

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        calls = [(key, *locate(key)) for key in keys]
        # A stat is cheap: one pool task per slice of the batch rather than one per key.
        step = -(-len(calls) // self.config.io_threads) or 1
        slices = [(calls[start : start + step],) for start in range(0, len(calls), step)]
        return [hit for part in self._parallel(self._exists_slice, slices) for hit in part]

    def _exists_slice(self, calls: list[tuple[PageKey, str, str]]) -> list[bool]:
        return [self._exists_one(*call) for call in calls]

    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        located = [locate(key) for key in keys]
        results = self._parallel(self._read_one, [(key, *loc, t) for key, loc, t in zip(keys, located, targets)])
        hits = [(rel, segments_size(target)) for (_, rel), target, hit in zip(located, targets, results) if hit]
        self._mark_read(hits)
        return results

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        located = [locate(key) for key in keys]
        # One write per distinct page, in the order of first occurrence (the head of the prefix
        # first), with the bytes of its last occurrence (the last write wins).
        last: dict[str, int] = {}
        for i, (_, rel) in enumerate(located):
            last[rel] = i
        writes = list(last.items())
        index = self._index
        reservation: Reservation | None = None
        if index is not None:
            with self._lock:
                admitted, reservation = index.admit([(rel, segments_size(sources[i])) for rel, i in writes])
                self._counters["puts_beyond_capacity"] += len(writes) - admitted
            writes = writes[:admitted]
        stored: list[str] = []
        try:
            outcomes = self._parallel(
                self._write_one, [(keys[i], located[i][0], rel, sources[i], reservation) for rel, i in writes]
            )
            stored = [rel for (rel, _), outcome in zip(writes, outcomes) if outcome == STORED]
        finally:
            if index is not None and reservation is not None:
                with self._lock:
                    index.settle(reservation, stored)
        refused = outcomes.count(NO_SPACE)
        if refused:
            logger.warning(
                "file backend: %d of %d pages not stored: no space left (or quota reached) under %s; "
                "free disk space or set capacity_bytes below the free space",
                refused,
                len(keys),
                self._root,
            )
        published = set(stored)
        return [rel in published for _, rel in located]

    def _delete(self, keys: list[PageKey]) -> list[bool]:
        located = [locate(key) for key in keys]
        results = []
        for key, (rel_dir, rel) in zip(keys, located):
            if not self._dirs.verify(rel_dir, create=False):
                results.append(False)
                continue
            with self._index_guard():
                try:
                    os.unlink(f"{self._root}/{rel}")
                    removed = True
                except FileNotFoundError:
                    removed = False
                except OSError as exc:
                    raise self._error(exc, "delete", key, rel) from exc
                if self._index is not None:
                    self._index.forget(rel)
            results.append(removed)
        return results

    def _clear(self, namespace: Namespace) -> None:
        top = namespace.fingerprint
        if not COMPONENT_RE.fullmatch(top):
            raise InvalidKeyError(f"namespace fingerprint {top!r} is not a valid directory name", backend=self.name)
        trash = self._temp_path("trash")
        with self._index_guard():
            try:
                # One rename makes the whole namespace vanish at once; a symlink is moved, never followed.
                os.rename(f"{self._root}/{top}", trash)
                moved = True
            except FileNotFoundError:
                moved = False
            except OSError as exc:
                raise self._error(exc, "clear", None, top) from exc
            if self._index is not None:
                self._index.forget_prefix(top + "/")
            self._dirs.forget_namespace(top)
        if moved:
            remove_tree(trash)

    def _close(self) -> None:
        self._pool.shutdown(wait=True)

    def event_counts(self) -> dict[str, int]:
        """Eviction, full-disk, bounce-buffer and temp-cleanup counts, and what the index holds."""
        merged = super().event_counts()
        with self._lock:
            merged.update(self._counters)
            if self._index is not None:
                merged["stored_pages"] = len(self._index)
                merged["stored_bytes"] = self._index.total_bytes
        return merged

    # --- one page -----------------------------------------------------------------------------

    def _exists_one(self, key: PageKey, rel_dir: str, rel: str) -> bool:
        if not self._dirs.verify(rel_dir, create=False):
            return False
        try:
            st = os.lstat(f"{self._root}/{rel}")
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise self._error(exc, "exists", key, rel) from exc
        return stat.S_ISREG(st.st_mode)

    def _read_one(self, key: PageKey, rel_dir: str, rel: str, target: Segments) -> bool:
        if not self._dirs.verify(rel_dir, create=False):
            return False
        size = segments_size(target)
        try:
            fd = os.open(f"{self._root}/{rel}", _OPEN_READ | self._direct_flag)
        except (FileNotFoundError, NotADirectoryError):
            self._forget(rel)
            return False
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                logger.warning("file backend: %s/%s is a symlink, not a page; treated as a miss", self._root, rel)
                return False
            raise self._error(exc, "get", key, rel) from exc
        try:
            st = os.fstat(fd)
            hit = stat.S_ISREG(st.st_mode) and st.st_size == size and self._io.read(fd, target, size)
        except OSError as exc:
            raise self._error(exc, "get", key, rel) from exc
        finally:
            os.close(fd)
        return hit

    def _write_one(self, key: PageKey, rel_dir: str, rel: str, source: Segments, reservation: Reservation | None) -> str:
        """``STORED`` once published, ``NO_SPACE`` on a full disk, ``CLEARED`` when a concurrent
        ``clear()`` kept removing the page's directories. Other failures raise."""
        size = segments_size(source)
        temp = self._temp_path("tmp")
        try:
            self._dirs.verify(rel_dir, create=True)
            self._describe_namespace(rel_dir.partition("/")[0], key.scope.namespace)
            fd = os.open(temp, _OPEN_TEMP | self._direct_flag, 0o600)
            try:
                self._io.write(fd, source, size)
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self._publish(temp, rel_dir, rel, size, reservation)
        except OSError as exc:
            unlink_quietly(temp)
            if exc.errno in _NO_SPACE:
                with self._lock:
                    self._counters["puts_no_space"] += 1
                return NO_SPACE
            raise self._error(exc, "put", key, rel) from exc
        except DirectoriesVanished:
            unlink_quietly(temp)
            with self._lock:
                self._counters["puts_lost_to_clear"] += 1
            return CLEARED
        except BaseException:
            unlink_quietly(temp)
            raise
        return STORED

    def _publish(self, temp: str, rel_dir: str, rel: str, size: int, reservation: Reservation | None) -> None:
        with self._index_guard():
            for attempt in range(3):
                try:
                    os.replace(temp, f"{self._root}/{rel}")
                    break
                except FileNotFoundError:
                    # The page's directories vanished since we checked them (a clear() here or
                    # in another process): make them again and retry.
                    if not os.path.lexists(temp):
                        raise
                    if attempt == 2:
                        raise DirectoriesVanished(rel_dir) from None
                    self._dirs.forget(rel_dir)
                    self._dirs.verify(rel_dir, create=True)
            if self._index is not None and reservation is not None:
                self._index.publish(rel, size, reservation)
        if self.config.fsync:
            fsync_dir(f"{self._root}/{rel_dir}")

    def _count_bounce(self) -> None:
        with self._lock:
            self._counters["direct_bounce_ios"] += 1

    def _describe_namespace(self, top: str, namespace: Namespace) -> None:
        """Write ``<top>/namespace.json`` once, atomically, so an operator can tell namespaces apart."""
        if self._dirs.is_described(top):
            return
        path = f"{self._root}/{top}/{NAMESPACE_FILE}"
        if not os.path.lexists(path):
            temp = self._temp_path("tmp")
            try:
                fd = os.open(temp, _OPEN_TEMP, 0o600)
                try:
                    pwritev_full(fd, [memoryview(json.dumps(namespace.describe(), indent=2, sort_keys=True).encode())], 0)
                    if self.config.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(temp, path)
            except FileNotFoundError:
                unlink_quietly(temp)
                return  # the namespace was just cleared; the next write describes it again
            except BaseException:
                unlink_quietly(temp)
                raise
        self._dirs.mark_described(top)

    def _temp_path(self, suffix: str) -> str:
        return self._temp_names.path(suffix)

    # --- the LRU index ------------------------------------------------------------------------

    def _index_guard(self) -> contextlib.AbstractContextManager[Any]:
        """The index lock when there is an index; publication needs no lock otherwise."""
        return self._lock if self._index is not None else contextlib.nullcontext()

    def _mark_read(self, pages: list[tuple[str, int]]) -> None:
        """Refresh the recency of pages just read (see :meth:`LruPageIndex.touch`) when there is an index."""
        if self._index is None or not pages:
            return
        with self._lock:
            self._index.touch(pages)

    def _forget(self, rel: str) -> None:
        if self._index is not None:
            with self._lock:
                self._index.forget(rel)

    # --- plumbing -----------------------------------------------------------------------------

    def _parallel(self, work: Callable[..., T], calls: Sequence[tuple[Any, ...]]) -> list[T]:
        """Run ``work(*call)`` for each call on the pool; re-raise the first error once all are done (see map_all)."""
        if len(calls) <= 1 or self.config.io_threads == 1:
            return [work(*call) for call in calls]
        return map_all(self._pool, lambda call: work(*call), calls)

    def _error(self, exc: OSError, operation: str, key: PageKey | None, rel: str) -> StorageError:
        where = f"{operation} on {self._root}/{rel} failed: {exc.strerror or exc}"
        if exc.errno in _DENIED:
            return PermissionDeniedError(
                where + "; this process needs read and write access to the whole root directory tree",
                backend=self.name,
                operation=operation,
                key=key,
            )
        if exc.errno in _NO_SPACE:
            return CapacityError(where + "; free disk space", backend=self.name, operation=operation, key=key)
        status = ErrorStatus.TEMPORARY if exc.errno in _TRANSIENT else ErrorStatus.PERMANENT
        return StorageError(where, backend=self.name, operation=operation, key=key, status=status)
