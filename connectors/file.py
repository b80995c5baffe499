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
  scanning it, oldest modification time first) evicts least recently used pages after each
  write until the bytes it knows of fit. Reads refresh recency in memory only, so after a
  restart recency is by last write. Within one call the first pages count as the most recent
  (a prefix is useless without its head, so its tail goes first). A page that cannot be
  removed (permission denied, already gone) is skipped, counted (``evictions_failed`` /
  ``evictions_vanished``) and dropped from the index, so eviction never wedges; its bytes then
  stay on disk outside the budget. The budget covers the pages this instance knows: those
  found at start, written by it, or read by it. Several processes writing one capped root each
  enforce their own view.
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
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import socket
import stat
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar

import pydantic

from hicache_storage.backend import StorageBackend
from hicache_storage.buffers import Segments, fill_segments, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.errors import (
    BackendClosedError,
    CapacityError,
    ConfigError,
    InvalidKeyError,
    PermissionDeniedError,
    StorageError,
)
from hicache_storage.keys import Namespace, PageKey
from hicache_storage.vectored_io import preadv_full, pwritev_full

logger = logging.getLogger(__name__)

#: O_DIRECT alignment for addresses, sizes and offsets (the largest common logical block size).
DIRECT_ALIGNMENT = 4096
TMP_DIR = ".tmp"
NAMESPACE_FILE = "namespace.json"
#: A temp file whose writer we cannot prove dead is removed once it is this old.
STALE_TEMP_AGE_S = 3600.0

_COMPONENT_RE = re.compile(r"[0-9a-z][0-9a-z_-]{0,127}")
_PAGE_DEPTH = 5  # namespace / shard / part / fan-out / page
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_TEMP = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)

_COUNTERS = (
    "evictions",
    "evicted_bytes",
    "evictions_failed",
    "evictions_vanished",
    "unremovable_bytes",
    "puts_no_space",
    "puts_lost_to_clear",
    "direct_bounce_ios",
    "stale_temp_removed",
)

T = TypeVar("T")

# What became of one page's write.
STORED, NO_SPACE, CLEARED = "stored", "no space", "cleared"


class _DirectoriesVanished(Exception):
    """A concurrent clear() kept removing a page's directories while it was being written."""


def _default_root() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache, "hicache-storage", "file")


class FileConfig(BackendConfig):
    root: str = pydantic.Field(
        default_factory=_default_root,
        min_length=1,
        description="directory holding the pages (created 0o700 if missing; must not be a symlink); "
        "default $XDG_CACHE_HOME/hicache-storage/file",
    )
    io_threads: int = pydantic.Field(4, ge=1, le=256, description="threads doing page I/O in parallel, 1 to 256")
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


class FileBackend(StorageBackend):
    """Pages as files under ``config.root``. See the module docstring for every contract."""

    name = "file"
    Config = FileConfig
    capabilities = Capabilities(
        zero_copy_read=True,
        zero_copy_write=True,
        native_batch_exists=True,
        delete=True,
        clear=True,
        persistent=True,
        shared_across_processes=True,
    )

    def __init__(self, config: FileConfig | dict[str, Any] | str | None = None) -> None:
        super().__init__(config)
        self._root = _prepare_root(self.config.root)
        self._tmp = f"{self._root}/{TMP_DIR}"
        self._lock = threading.Lock()  # guards the LRU index and the counters
        self._verified_dirs: set[str] = set()  # relative dirs known to be real directories
        self._described: set[str] = set()  # namespace dirs whose namespace.json exists
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._thread_local = threading.local()
        self._writer = (0, "")  # (pid, tag) naming our temp files; recomputed after a fork
        self._prepare_tmp_dir()
        self._counters["stale_temp_removed"] = self._remove_stale_temp()
        self._direct_flag = self._probe_direct_io() if self.config.direct_io else 0
        self._index: OrderedDict[str, int] | None = None
        self._index_bytes = 0
        capabilities = self.capabilities
        if self.config.capacity_bytes is not None:
            self._index, self._index_bytes = self._scan_pages()
            with self._lock:
                self._evict_locked()
            capabilities = capabilities.replace(evicts=True, max_value_size=self.config.capacity_bytes)
        if self.config.shared_mount:
            capabilities = capabilities.replace(shared_across_hosts=True)
        self.capabilities = capabilities
        self._pool = ThreadPoolExecutor(max_workers=self.config.io_threads, thread_name_prefix="hicache-file-io")

    # --- hooks --------------------------------------------------------------------------------

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        calls = [(key, *self._locate(key)) for key in keys]
        # A stat is cheap: one pool task per slice of the batch rather than one per key.
        step = -(-len(calls) // self.config.io_threads) or 1
        slices = [(calls[start : start + step],) for start in range(0, len(calls), step)]
        return [hit for part in self._parallel(self._exists_slice, slices) for hit in part]

    def _exists_slice(self, calls: list[tuple[PageKey, str, str]]) -> list[bool]:
        return [self._exists_one(*call) for call in calls]

    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        located = [self._locate(key) for key in keys]
        results = self._parallel(self._read_one, [(key, *loc, t) for key, loc, t in zip(keys, located, targets)])
        hits = [(rel, segments_size(target)) for (_, rel), target, hit in zip(located, targets, results) if hit]
        self._mark_used(hits, learn=True)
        return results

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        located = [self._locate(key) for key in keys]
        outcomes = self._parallel(self._write_one, [(key, *loc, s) for key, loc, s in zip(keys, located, sources)])
        results = [outcome == STORED for outcome in outcomes]
        self._mark_used([(rel, 0) for (_, rel), stored in zip(located, results) if stored], learn=False)
        refused = outcomes.count(NO_SPACE)
        if refused:
            logger.warning(
                "file backend: %d of %d pages not stored: no space left (or quota reached) under %s; "
                "free disk space or set capacity_bytes below the free space",
                refused,
                len(keys),
                self._root,
            )
        return results

    def _delete(self, keys: list[PageKey]) -> list[bool]:
        located = [self._locate(key) for key in keys]
        results = []
        for key, (rel_dir, rel) in zip(keys, located):
            if not self._verify_dirs(rel_dir, create=False):
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
                self._forget_locked(rel)
            results.append(removed)
        return results

    def _clear(self, namespace: Namespace) -> None:
        top = namespace.fingerprint
        if not _COMPONENT_RE.fullmatch(top):
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
            self._forget_namespace_locked(top)
        if moved:
            _remove_tree(trash)

    def _close(self) -> None:
        self._pool.shutdown(wait=True)

    def stats(self) -> dict[str, int]:
        """The base counters plus eviction, full-disk, bounce-buffer and temp-cleanup counts."""
        merged = super().stats()
        with self._lock:
            merged.update(self._counters)
            if self._index is not None:
                merged["stored_pages"] = len(self._index)
                merged["stored_bytes"] = self._index_bytes
        return merged

    # --- one page -----------------------------------------------------------------------------

    def _exists_one(self, key: PageKey, rel_dir: str, rel: str) -> bool:
        if not self._verify_dirs(rel_dir, create=False):
            return False
        try:
            st = os.lstat(f"{self._root}/{rel}")
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise self._error(exc, "exists", key, rel) from exc
        return stat.S_ISREG(st.st_mode)

    def _read_one(self, key: PageKey, rel_dir: str, rel: str, target: Segments) -> bool:
        if not self._verify_dirs(rel_dir, create=False):
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
            hit = stat.S_ISREG(st.st_mode) and st.st_size == size and self._read_fd(fd, target, size)
        except OSError as exc:
            raise self._error(exc, "get", key, rel) from exc
        finally:
            os.close(fd)
        return hit

    def _write_one(self, key: PageKey, rel_dir: str, rel: str, source: Segments) -> str:
        """``STORED`` once published, ``NO_SPACE`` on a full disk, ``CLEARED`` when a concurrent
        ``clear()`` kept removing the page's directories. Other failures raise."""
        size = segments_size(source)
        temp = self._temp_path("tmp")
        try:
            self._verify_dirs(rel_dir, create=True)
            self._describe_namespace(rel_dir.partition("/")[0], key.scope.namespace)
            fd = os.open(temp, _OPEN_TEMP | self._direct_flag, 0o600)
            try:
                self._write_fd(fd, source, size)
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self._publish(temp, rel_dir, rel, size)
        except OSError as exc:
            _unlink_quietly(temp)
            if exc.errno in _NO_SPACE:
                with self._lock:
                    self._counters["puts_no_space"] += 1
                return NO_SPACE
            raise self._error(exc, "put", key, rel) from exc
        except _DirectoriesVanished:
            _unlink_quietly(temp)
            with self._lock:
                self._counters["puts_lost_to_clear"] += 1
            return CLEARED
        except BaseException:
            _unlink_quietly(temp)
            raise
        return STORED

    def _publish(self, temp: str, rel_dir: str, rel: str, size: int) -> None:
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
                        raise _DirectoriesVanished(rel_dir) from None
                    self._forget_dirs(rel_dir)
                    self._verify_dirs(rel_dir, create=True)
            if self._index is not None:
                old = self._index.pop(rel, None)
                self._index_bytes += size - (old or 0)
                self._index[rel] = size
                self._evict_locked()
        if self.config.fsync:
            _fsync_dir(f"{self._root}/{rel_dir}")

    # --- byte movement ------------------------------------------------------------------------

    def _read_fd(self, fd: int, target: Segments, size: int) -> bool:
        segments = [view for view in target if view.nbytes]
        if not segments:
            return True
        if self._direct_flag and not _aligned(segments):
            bounce = self._bounce(size)
            if preadv_full(fd, [bounce[: _round_up(size)]], 0, size) != size:
                return False
            fill_segments(segments, bounce[:size])
            self._count_bounce()
            return True
        return preadv_full(fd, segments, 0, size) == size

    def _write_fd(self, fd: int, source: Segments, size: int) -> None:
        segments = [view for view in source if view.nbytes]
        if self._direct_flag and not _aligned(segments):
            padded = _round_up(size)
            bounce = self._bounce(padded)
            offset = 0
            for view in segments:
                bounce[offset : offset + view.nbytes] = view
                offset += view.nbytes
            bounce[size:padded] = bytes(padded - size)
            pwritev_full(fd, [bounce[:padded]], 0)
            if padded != size:
                os.ftruncate(fd, size)
            self._count_bounce()
        elif segments:
            pwritev_full(fd, segments, 0)

    def _bounce(self, size: int) -> memoryview:
        """This thread's aligned (mmap-backed) buffer, at least ``size`` bytes, grown on demand."""
        buffer = getattr(self._thread_local, "bounce", None)
        if buffer is None or len(buffer) < size:
            buffer = mmap.mmap(-1, _round_up(max(size, DIRECT_ALIGNMENT)))
            self._thread_local.bounce = buffer
        return memoryview(buffer)

    def _count_bounce(self) -> None:
        with self._lock:
            self._counters["direct_bounce_ios"] += 1

    # --- paths and directories ----------------------------------------------------------------

    def _locate(self, key: PageKey) -> tuple[str, str]:
        """(relative directory, relative file path) for ``key``; refuses anything but 4 safe names."""
        rendered = key.render("/")
        parts = rendered.split("/")
        if len(parts) != 4 or not all(_COMPONENT_RE.fullmatch(part) for part in parts):
            raise InvalidKeyError(
                f"key renders to {rendered!r}; the file backend needs 4 '/'-separated names of [0-9a-z_-] "
                "starting with a letter or digit (build keys with KeyScope.key)",
                backend=self.name,
            )
        page_hash = parts[3]
        rel_dir = f"{parts[0]}/{parts[1]}/{parts[2]}/{page_hash[:2]}"
        return rel_dir, f"{rel_dir}/{page_hash}"

    def _verify_dirs(self, rel_dir: str, *, create: bool) -> bool:
        """Check each directory from the root down to ``rel_dir``, making missing ones with ``create``.

        Returns ``False`` if one is missing (never with ``create``; if a concurrent ``clear()``
        keeps removing them, raises ``_DirectoriesVanished``). Raises ``PermissionDeniedError``
        for a symlink in place of a directory. Checked directories are
        remembered, so a page's directories cost system calls only the first time.
        """
        if rel_dir in self._verified_dirs:
            return True
        if not create:
            return self._walk_dirs(rel_dir, create=False)
        for _ in range(3):  # a concurrent clear() can remove a parent while we descend
            if self._walk_dirs(rel_dir, create=True):
                return True
            self._forget_dirs(rel_dir)
        raise _DirectoriesVanished(rel_dir)

    def _walk_dirs(self, rel_dir: str, *, create: bool) -> bool:
        names = rel_dir.split("/")
        for depth in range(1, len(names) + 1):
            rel = "/".join(names[:depth])
            if rel in self._verified_dirs:
                continue
            path = f"{self._root}/{rel}"
            if create:
                try:
                    os.mkdir(path, 0o700)
                    os.chmod(path, 0o700)  # mkdir's mode is narrowed by the umask; make it exactly owner-only
                    if self.config.fsync:
                        _fsync_dir(os.path.dirname(path))
                    self._verified_dirs.add(rel)
                    continue
                except FileExistsError:
                    pass
                except FileNotFoundError:
                    return False
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return False
            if stat.S_ISLNK(st.st_mode):
                raise PermissionDeniedError(
                    f"{path!r} is a symlink; the file backend never follows symlinks under its root "
                    "(one could lead out of it). Remove the link or use a root without links inside.",
                    backend=self.name,
                )
            if not stat.S_ISDIR(st.st_mode):
                raise StorageError(f"{path!r} should be a directory of pages but is not; remove it", backend=self.name)
            self._verified_dirs.add(rel)
        return True

    def _forget_dirs(self, rel_dir: str) -> None:
        names = rel_dir.split("/")
        for depth in range(1, len(names) + 1):
            self._verified_dirs.discard("/".join(names[:depth]))
        self._described.discard(names[0])

    def _describe_namespace(self, top: str, namespace: Namespace) -> None:
        """Write ``<top>/namespace.json`` once, atomically, so an operator can tell namespaces apart."""
        if top in self._described:
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
                _unlink_quietly(temp)
                return  # the namespace was just cleared; the next write describes it again
            except BaseException:
                _unlink_quietly(temp)
                raise
        self._described.add(top)

    def _temp_path(self, suffix: str) -> str:
        pid, tag = self._writer
        if pid != os.getpid():  # first use, or a forked child: name temp files after this process
            pid = os.getpid()
            tag = f"{_host_tag()}.{pid}.{_process_start(pid)}"
            self._writer = (pid, tag)
        return f"{self._tmp}/{tag}.{secrets.token_hex(8)}.{suffix}"

    # --- the LRU index ------------------------------------------------------------------------

    def _index_guard(self) -> contextlib.AbstractContextManager[Any]:
        """The index lock when there is an index; publication needs no lock otherwise."""
        return self._lock if self._index is not None else contextlib.nullcontext()

    def _mark_used(self, pages: list[tuple[str, int]], *, learn: bool) -> None:
        """Make ``pages`` (relative path, size) the most recently used, the first of them most of all.

        A prefix is useless without its head, so within one call the earlier pages are evicted
        last. With ``learn``, a page missing from the index (another process wrote it) is added.
        """
        if self._index is None or not pages:
            return
        with self._lock:
            for rel, size in reversed(pages):
                if rel in self._index:
                    self._index.move_to_end(rel)
                elif learn:
                    self._index[rel] = size
                    self._index_bytes += size
            if learn:
                self._evict_locked()

    def _forget(self, rel: str) -> None:
        if self._index is not None:
            with self._lock:
                self._forget_locked(rel)

    def _forget_locked(self, rel: str) -> None:
        if self._index is not None:
            self._index_bytes -= self._index.pop(rel, 0)

    def _forget_namespace_locked(self, top: str) -> None:
        prefix = top + "/"
        if self._index is not None:
            for rel in [rel for rel in self._index if rel.startswith(prefix)]:
                self._index_bytes -= self._index.pop(rel)
        known = self._verified_dirs.copy()
        self._verified_dirs = {rel for rel in known if rel != top and not rel.startswith(prefix)}
        self._described.discard(top)

    def _evict_locked(self) -> None:
        capacity = self.config.capacity_bytes
        assert self._index is not None and capacity is not None
        while self._index_bytes > capacity and self._index:
            rel, size = self._index.popitem(last=False)
            self._index_bytes -= size
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

    def _scan_pages(self) -> tuple[OrderedDict[str, int], int]:
        """Every page file under the root, oldest modification first, with the total of their sizes."""
        found: list[tuple[int, str, int]] = []

        def walk(rel: str, depth: int) -> None:
            try:
                entries = list(os.scandir(f"{self._root}/{rel}" if rel else self._root))
            except OSError as exc:
                logger.warning("file backend: cannot scan %s/%s (%s); its pages are not counted", self._root, rel, exc)
                return
            for entry in entries:
                if not _COMPONENT_RE.fullmatch(entry.name):
                    continue  # .tmp, namespace.json, or something that is not ours
                child = f"{rel}/{entry.name}" if rel else entry.name
                if depth < _PAGE_DEPTH - 1:
                    if entry.is_dir(follow_symlinks=False):
                        walk(child, depth + 1)
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    found.append((st.st_mtime_ns, child, st.st_size))

        walk("", 0)
        found.sort()
        return OrderedDict((rel, size) for _, rel, size in found), sum(size for _, _, size in found)

    # --- setup --------------------------------------------------------------------------------

    def _prepare_tmp_dir(self) -> None:
        try:
            os.mkdir(self._tmp, 0o700)
            os.chmod(self._tmp, 0o700)
        except FileExistsError:
            st = os.lstat(self._tmp)
            if not stat.S_ISDIR(st.st_mode):
                raise ConfigError(
                    f"{self._tmp!r} must be a real directory (it is a symlink or a file); remove it",
                    field="root",
                    backend=self.name,
                ) from None
        except OSError as exc:
            raise ConfigError(
                f"cannot create {self._tmp!r} ({exc.strerror}); root must be a directory this process can write",
                field="root",
                backend=self.name,
            ) from None

    def _remove_stale_temp(self) -> int:
        """Remove temp files and trash left by dead writers; returns how many were removed."""
        removed = 0
        now = time.time()
        host = _host_tag()
        with os.scandir(self._tmp) as entries:
            leftovers = list(entries)
        for entry in leftovers:
            try:
                age = now - entry.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue  # its writer just published or removed it
            if not _writer_is_gone(entry.name, host) and age < STALE_TEMP_AGE_S:
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed += 1
            except FileNotFoundError:
                continue
            except OSError as exc:
                logger.warning("file backend: cannot remove stale temp %s (%s)", entry.path, exc.strerror or exc)
        if removed:
            logger.info("file backend: removed %d stale temp files under %s", removed, self._tmp)
        return removed

    def _probe_direct_io(self) -> int:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            raise ConfigError(
                "direct_io needs O_DIRECT, which this platform lacks (Linux only); set direct_io=false",
                field="direct_io",
                backend=self.name,
            )
        probe = self._temp_path("probe")
        block = mmap.mmap(-1, DIRECT_ALIGNMENT)
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | flag, 0o600)
            try:
                os.pwritev(fd, [block], 0)
                os.preadv(fd, [block], 0)
            finally:
                os.close(fd)
        except OSError as exc:
            raise ConfigError(
                f"the filesystem under root {self._root!r} refuses O_DIRECT ({exc.strerror}); set direct_io=false "
                "or put root on a local disk filesystem such as ext4 or xfs",
                field="direct_io",
                backend=self.name,
            ) from None
        finally:
            block.close()
            _unlink_quietly(probe)
        return flag

    # --- plumbing -----------------------------------------------------------------------------

    def _parallel(self, work: Callable[..., T], calls: Sequence[tuple[Any, ...]]) -> list[T]:
        """Run ``work(*call)`` for each call on the pool; re-raise the first error once all are done.

        Waiting for every call before raising matters: a read must never still be writing into a
        caller's buffer after the caller got an exception back.
        """
        if len(calls) <= 1 or self.config.io_threads == 1:
            return [work(*call) for call in calls]
        futures = []
        try:
            for call in calls:
                futures.append(self._pool.submit(work, *call))
        except RuntimeError:  # the pool was shut down by a concurrent close()
            for future in futures:
                future.cancel()
            wait(futures)
            raise BackendClosedError("backend was closed during the call", backend=self.name) from None
        results: list[T] = []
        first_error: BaseException | None = None
        for future in futures:
            try:
                results.append(future.result())
            except BaseException as exc:  # noqa: BLE001 - re-raised below after the others finish
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return results

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
        return StorageError(where, backend=self.name, operation=operation, key=key)


# --- module helpers ---------------------------------------------------------------------------


def _prepare_root(root: str) -> str:
    """The absolute root, created 0o700 if missing; refuses a symlink or a non-directory."""
    path = os.path.abspath(os.path.expanduser(root))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        try:
            os.makedirs(path, mode=0o700)
            os.chmod(path, 0o700)
        except FileExistsError:
            return _prepare_root(path)  # another process made it first: check what it made
        except OSError as exc:
            raise ConfigError(f"cannot create root {path!r}: {exc.strerror}", field="root", backend="file") from None
        return path
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(
            f"root {path!r} is a symlink (to {os.readlink(path)!r}); pass the real directory "
            f"({os.path.realpath(path)!r}) so nothing under the root is reached through a link",
            field="root",
            backend="file",
        )
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"root {path!r} exists and is not a directory", field="root", backend="file")
    return path


def _aligned(segments: Segments) -> bool:
    """Whether O_DIRECT can use these segments as they are: writable, address and size 4 KiB-aligned."""
    for view in segments:
        if view.readonly or view.nbytes % DIRECT_ALIGNMENT:
            return False
        if ctypes.addressof(ctypes.c_char.from_buffer(view)) % DIRECT_ALIGNMENT:
            return False
    return True


def _round_up(size: int) -> int:
    return -(-size // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _remove_tree(path: str) -> None:
    """Remove a cleared namespace's tree; what cannot be removed is logged, not raised."""
    if os.path.islink(path):
        os.unlink(path)
        return

    def report(_function: object, failed: str, error: Any) -> None:
        # onexc passes the exception, the older onerror an exc_info tuple.
        reason = error[1] if isinstance(error, tuple) else error
        logger.warning("file backend: cannot remove %s while clearing (%s)", failed, reason)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=report)
    else:
        shutil.rmtree(path, onerror=report)


def _host_tag() -> str:
    return re.sub(r"[^0-9a-z-]", "-", socket.gethostname().lower())[:63] or "host"


def _process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux), so a reused pid is told apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()
    except (OSError, IndexError):
        return "0"


def _writer_is_gone(temp_name: str, host: str) -> bool:
    """Whether the writer named in a temp file's name (host.pid.start.token.kind) is certainly dead."""
    fields = temp_name.split(".")
    if len(fields) != 5 or fields[0] != host or not fields[1].isdigit():
        return False
    pid, start = int(fields[1]), fields[2]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, owned by someone else
    return start != "0" and _process_start(pid) != start
