"""3FS: pages in pre-sized per-rank files of fixed-size slots on a 3FS mount, plus a slot index.

**Not tested against 3FS.** No 3FS cluster or client could run where this was written (the
usrbio binding does not build there). The POSIX path was tested on a local directory standing
in for the mount. The usrbio path is written against the ``hf3fs_fuse.io`` API as SGLang uses it;
only its glue was tested, against a stand-in binding doing plain file I/O, never against 3FS.
3FS presents itself as a POSIX file system, which is what the POSIX path uses.

Layout: rank ``r`` owns ``numjobs`` files ``<root>/rank<r>.<j>.data``, each ``file_size`` bytes
(created sparse with ``ftruncate``), cut into slots of ``page_size_bytes`` (from the config, or
fixed by the first write, rounded up to 4 KiB). A page is written into a free slot of its
writer's files and then *published* in the slot index under its key; readers find it through
the index, so any rank can read any rank's pages (MLA: rank 0 writes, every rank reads).

The slot index lives

* in this process (``metadata_url`` unset): instances of one process with the same root and
  rank share it; another process is kept off that rank's files by a lock file. Pages are not
  shared with other processes and are forgotten when the last instance closes;
* in Redis (``metadata_url: redis://...``): instances and ranks on any host share pages, and
  pages survive restarts. Every allocation and publication is one Lua script, so it is atomic.
  Standalone Redis only (the scripts touch keys they compute).

Integrity. Writes go to a slot no key points at, and the key is published only after the bytes
are written, so a reader never sees a half-written page. When the rank is full, the least
recently used page's slot is reused; to make that safe without reader reference counts, every
slot has a generation that is incremented when the slot is handed out again, and a read checks
the generation *after* reading: if it changed, the slot was taken while it was being read and
the read is a miss. A read is a hit only if the stored length equals the target's.

Crash behaviour: a slot reserved by a writer that dies before publishing its page is never
handed out again (with a Redis index; an in-process index dies with the writer anyway): one lost
slot per crash, until the rank's index keys are deleted.

Thread safety: every method may be called from several threads.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pydantic

from hicache_storage.backend import StorageBackend
from hicache_storage.buffers import Segments, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.errors import (
    AuthenticationError,
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    MissingDependencyError,
    PermissionDeniedError,
    StorageError,
    StorageTimeoutError,
    ValueTooLargeError,
)
from hicache_storage.keys import Namespace, PageKey
from hicache_storage.vectored_io import preadv_full, pwritev_full

SLOT_ALIGNMENT = 4096


class HF3FSConfig(BackendConfig):
    root: str = pydantic.Field(..., description="directory on the 3FS mount (SGLang: file_path_prefix's directory)")
    file_size: int = pydantic.Field(64 * 2**30, gt=0, description="bytes per data file; slots per file = file_size // page size")
    numjobs: int = pydantic.Field(4, ge=1, le=256, description="data files per rank, and parallel I/O threads")
    rank: int = pydantic.Field(0, ge=0, description="which rank's files this instance writes (the TP rank)")
    page_size_bytes: int | None = pydantic.Field(
        None, gt=0, description="slot size in bytes; omit to fix it at the first write (rounded up to 4 KiB)"
    )
    metadata_url: pydantic.SecretStr | None = pydantic.Field(
        None, description="redis://... to share the slot index between instances and ranks; omit for in-process"
    )
    metadata_prefix: str | None = pydantic.Field(
        None,
        description="Redis key prefix of the index; defaults to one derived from root (set it when hosts mount 3FS at different paths)",
    )
    io: Literal["auto", "usrbio", "posix"] = pydantic.Field(
        "auto", description="usrbio (the hf3fs_fuse.io ring API) or posix reads/writes; auto picks usrbio when importable"
    )
    usrbio_entries: int = pydantic.Field(64, ge=1, description="usrbio ring entries: most pages in one submission")
    usrbio_timeout_s: float = pydantic.Field(30.0, gt=0, description="how long a usrbio submission may take")


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
        return f"{self.rank}|{self.slot}|{self.file}|{self.offset}|{self.length}|{self.generation}"

    @classmethod
    def decode(cls, text: str | bytes) -> Location:
        if isinstance(text, bytes):
            text = text.decode()
        return cls(*(int(part) for part in text.split("|")))


# --- slot indexes -------------------------------------------------------------------------------


class LocalSlotIndex:
    """The slot index in this process: key -> location, LRU order, free slots, generations."""

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
        with self._lock:
            if self.page_size is None:
                self.page_size = size
            return self.page_size

    def lookup(self, names: list[str]) -> list[Location | None]:
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
        """Point each name at its freshly written slot, in order; a replaced slot is freed."""
        with self._lock:
            for name, location in pages:
                old = self._pages.pop(name, None)
                self._pages[name] = location
                if old is not None and old.slot != location.slot:
                    self._free.append(old.slot)

    def release(self, slots: list[int]) -> None:
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
        with self._lock:
            results = []
            for name in names:
                old = self._pages.pop(name, None)
                if old is not None:
                    self._free.append(old.slot)
                results.append(old is not None)
            return results

    def names_with_prefix(self, prefix: str) -> list[str]:
        with self._lock:
            return [name for name in self._pages if name.startswith(prefix)]


# Redis scripts; each runs atomically. A page's LRU member is its rendered key (its "name").
# KEYS: free list, next-slot counter, LRU sorted set, generations hash (all of this rank).
# ARGV: capacity in slots, slots wanted, prefix of page keys.
_RESERVE = """
local taken = {}
for i = 1, tonumber(ARGV[2]) do
  local slot = redis.call('LPOP', KEYS[1])
  if not slot then
    local n = redis.call('INCR', KEYS[2])
    if n <= tonumber(ARGV[1]) then
      slot = tostring(n - 1)
    else
      redis.call('DECR', KEYS[2])
      local victim = redis.call('ZPOPMIN', KEYS[3])
      if #victim == 0 then break end
      local loc = redis.call('GET', ARGV[3] .. victim[1])
      if loc then
        redis.call('DEL', ARGV[3] .. victim[1])
        slot = string.match(loc, '^%d+|(%d+)|')
      end
    end
  end
  if slot then
    local generation = redis.call('HINCRBY', KEYS[4], slot, 1)
    table.insert(taken, {tonumber(slot), generation})
  end
end
return taken
"""

# KEYS: page key. ARGV: location, lru score, key-name (LRU member), prefix for rank keys.
_PUBLISH = """
local old = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1])
local rank = string.match(ARGV[1], '^(%d+)|')
redis.call('ZADD', ARGV[4] .. 'lru:' .. rank, ARGV[2], ARGV[3])
if old and old ~= ARGV[1] then
  local old_rank, old_slot = string.match(old, '^(%d+)|(%d+)|')
  if old_rank ~= rank then redis.call('ZREM', ARGV[4] .. 'lru:' .. old_rank, ARGV[3]) end
  redis.call('RPUSH', ARGV[4] .. 'free:' .. old_rank, old_slot)
end
return 1
"""

# KEYS: page key. ARGV: key-name (LRU member), prefix for rank keys.
_REMOVE = """
local old = redis.call('GET', KEYS[1])
if not old then return 0 end
redis.call('DEL', KEYS[1])
local rank, slot = string.match(old, '^(%d+)|(%d+)|')
redis.call('ZREM', ARGV[2] .. 'lru:' .. rank, ARGV[1])
redis.call('RPUSH', ARGV[2] .. 'free:' .. rank, slot)
return 1
"""


class RedisSlotIndex:
    """The slot index in Redis, shared by every instance and rank configured with the same prefix.

    Keys: ``<prefix>k:<page>`` -> encoded :class:`Location`; ``<prefix>lru:<rank>`` sorted set of
    page names by last use; ``<prefix>free:<rank>`` list of released slots; ``<prefix>next:<rank>``
    count of slots ever handed out; ``<prefix>gen:<rank>`` hash slot -> generation;
    ``<prefix>page_size``.
    """

    def __init__(self, url: str, prefix: str, rank: int, capacity: int) -> None:
        try:
            import redis
        except ImportError as exc:
            raise MissingDependencyError("hf3fs", "redis", "hf3fs") from exc
        self.client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=3, health_check_interval=30)
        self.prefix = prefix
        self.rank = rank
        self.capacity = capacity
        self.page_size: int | None = None
        self._reserve = self.client.register_script(_RESERVE)
        self._publish = self.client.register_script(_PUBLISH)
        self._remove = self.client.register_script(_REMOVE)
        stored = self.client.get(prefix + "page_size")
        self.page_size = int(stored) if stored is not None else None

    def _key(self, name: str) -> str:
        return f"{self.prefix}k:{name}"

    def fix_page_size(self, size: int) -> int:
        self.client.set(self.prefix + "page_size", size, nx=True)
        self.page_size = int(self.client.get(self.prefix + "page_size"))
        return self.page_size

    def lookup(self, names: list[str]) -> list[Location | None]:
        values = self.client.mget([self._key(n) for n in names]) if names else []
        return [Location.decode(v) if v is not None else None for v in values]

    def reserve(self, count: int) -> list[tuple[int, int]]:
        r = self.rank
        keys = [f"{self.prefix}free:{r}", f"{self.prefix}next:{r}", f"{self.prefix}lru:{r}", f"{self.prefix}gen:{r}"]
        taken = self._reserve(keys=keys, args=[self.capacity, count, self.prefix + "k:"])
        return [(int(slot), int(generation)) for slot, generation in taken]

    def publish(self, pages: list[tuple[str, Location]]) -> None:
        """One pipelined round trip; each page's script is atomic, and they run in order."""
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        for name, location in pages:
            self._publish(keys=[self._key(name)], args=[location.encode(), now, name, self.prefix], client=pipe)
        pipe.execute()

    def release(self, slots: list[int]) -> None:
        if slots:
            self.client.rpush(f"{self.prefix}free:{self.rank}", *slots)

    def still_valid(self, locations: list[Location], names: list[str]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for loc in locations:
            pipe.hget(f"{self.prefix}gen:{loc.rank}", loc.slot)
        generations = pipe.execute()
        valid = [g is not None and int(g) == loc.generation for g, loc in zip(generations, locations)]
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        for name, loc, ok in zip(names, locations, valid):
            if ok:
                pipe.zadd(f"{self.prefix}lru:{loc.rank}", {name: now}, xx=True)
        pipe.execute()
        return valid

    def remove(self, names: list[str]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            self._remove(keys=[self._key(name)], args=[name, self.prefix], client=pipe)
        return [bool(r) for r in pipe.execute()]

    def names_with_prefix(self, prefix: str) -> list[str]:
        start = len(self.prefix) + 2
        return [k.decode()[start:] for k in self.client.scan_iter(match=f"{self.prefix}k:{prefix}*", count=1000)]


# --- file I/O -----------------------------------------------------------------------------------


class PosixFiles:
    """``preadv``/``pwritev`` straight between the caller's segments and the data files."""

    zero_copy = True

    def __init__(self, root: Path, numjobs: int, file_size: int) -> None:
        self.root = root
        self.numjobs = numjobs
        self.file_size = file_size
        self._fds: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()

    def path(self, rank: int, file: int) -> Path:
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
        pwritev_full(self.fd(loc.rank, loc.file), list(source), loc.offset)
        return True

    def close(self) -> None:
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
        fd = super().fd(rank, file)
        with self._lock:
            if fd not in self._registered:
                self._usrbio.register_fd(fd)
                self._registered.add(fd)
        return fd

    def batch(self, for_read: bool, items: list[tuple[Location, Segments]]) -> list[bool]:
        shm, iov, ring, lock = self._rings[for_read]
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
                        _copy_into(shm.buf, position, segments)
                    ring.prepare(iov[position : position + size], for_read, self.fd(loc.rank, loc.file), loc.offset)
                    position += size
                done = ring.submit().wait(min_results=len(chunk), timeout=self._timeout)
                for (loc, segments), start, result in zip(chunk, starts, done):
                    ok = result.result == segments_size(segments)
                    if for_read and ok:
                        _copy_out(shm.buf, start, segments)
                    results.append(ok)
        return results

    def close(self) -> None:
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
    try:
        import hf3fs_fuse.io  # noqa: F401
    except ImportError:
        return False
    return True


# --- the connector ------------------------------------------------------------------------------


class HF3FSBackend(StorageBackend):
    """Pages in slot files on a 3FS mount. See the module docstring; untested against real 3FS."""

    name = "hf3fs"
    Config = HF3FSConfig
    capabilities = Capabilities(native_batch_exists=True, delete=True, clear=True, evicts=True)

    def __init__(self, config: HF3FSConfig | dict | str | None = None) -> None:
        super().__init__(config)
        cfg: HF3FSConfig = self.config
        self._root = Path(cfg.root).expanduser().resolve()
        try:
            self._root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot create the hf3fs root {str(self._root)!r}: {exc.strerror}", field="root", backend=self.name
            ) from None
        use_usrbio = cfg.io == "usrbio" or (cfg.io == "auto" and usrbio_available())
        if cfg.io == "usrbio" and not usrbio_available():
            raise MissingDependencyError(self.name, "hf3fs_fuse (3FS usrbio binding)", None)
        self._index_error = _redis_error_base() if cfg.metadata_url is not None else None
        if cfg.metadata_url is None:
            self._index: LocalSlotIndex | RedisSlotIndex = _open_local_index(self._root, cfg.rank)
        else:
            prefix = cfg.metadata_prefix or f"hicache:hf3fs:{hashlib.sha256(str(self._root).encode()).hexdigest()[:16]}:"
            self._index = self._guard(lambda: RedisSlotIndex(cfg.metadata_url.get_secret_value(), prefix, cfg.rank, 0), "connect")
            self.capabilities = self.capabilities.replace(persistent=True, shared_across_processes=True, shared_across_hosts=True)
        try:
            self._open_files(use_usrbio)
        except BaseException:
            self._release_index()
            raise

    def _open_files(self, use_usrbio: bool) -> None:
        cfg: HF3FSConfig = self.config
        page_size = cfg.page_size_bytes or self._index.page_size
        if cfg.page_size_bytes and self._index.page_size and _aligned(cfg.page_size_bytes) != self._index.page_size:
            raise ConfigError(
                f"page_size_bytes={cfg.page_size_bytes} but the shared index already uses slots of {self._index.page_size} bytes",
                field="page_size_bytes",
                backend=self.name,
            )
        if use_usrbio and page_size is None:
            raise ConfigError(
                "the usrbio path needs page_size_bytes to size its buffers", field="page_size_bytes", backend=self.name
            )
        if page_size is not None:
            self._set_page_size(page_size)
        self._files = (
            UsrbioFiles(self._root, cfg.numjobs, cfg.file_size, _aligned(page_size), cfg.usrbio_entries, cfg.usrbio_timeout_s)
            if use_usrbio
            else PosixFiles(self._root, cfg.numjobs, cfg.file_size)
        )
        self._files.create(cfg.rank)
        self.capabilities = self.capabilities.replace(zero_copy_read=self._files.zero_copy, zero_copy_write=self._files.zero_copy)
        self._pool = ThreadPoolExecutor(max_workers=cfg.numjobs, thread_name_prefix="hf3fs-io")

    def _release_index(self) -> None:
        if isinstance(self._index, LocalSlotIndex):
            _close_local_index(self._root, self.config.rank)
        else:
            self._index.client.close()

    # --- hooks --------------------------------------------------------------------------------

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        locations = self._guard(lambda: self._index.lookup([k.render("/") for k in keys]), "exists")
        return [loc is not None for loc in locations]

    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        names = [k.render("/") for k in keys]
        locations = self._guard(lambda: self._index.lookup(names), "get")
        todo = [
            i for i, loc in enumerate(locations) if loc is not None and loc.length == segments_size(targets[i])
        ]
        read = self._transfer(True, [(locations[i], targets[i]) for i in todo])
        done = [i for i, ok in zip(todo, read) if ok]
        valid = self._guard(lambda: self._index.still_valid([locations[i] for i in done], [names[i] for i in done]), "get")
        results = [False] * len(keys)
        for i, ok in zip(done, valid):
            results[i] = ok  # a changed generation: the slot was reused while we read it
        return results

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        cfg: HF3FSConfig = self.config
        sizes = [segments_size(s) for s in sources]
        page_size = self._index.page_size or self._set_page_size(max(sizes))
        too_big = [s for s in sizes if s > page_size]
        if too_big:
            raise ValueTooLargeError(f"a page of {too_big[0]} bytes does not fit in this store's {page_size}-byte slots")
        slots = self._guard(lambda: self._index.reserve(len(keys)), "put")
        if not slots and keys:
            raise CapacityError(f"no free slot in rank {cfg.rank}'s files and none to evict; raise file_size or numjobs")
        locations = [
            Location(cfg.rank, slot, slot % cfg.numjobs, (slot // cfg.numjobs) * page_size, size, generation)
            for (slot, generation), size in zip(slots, sizes)
        ]
        written = self._transfer(False, list(zip(locations, sources)))
        stored = [(keys[i].render("/"), loc) for i, (loc, ok) in enumerate(zip(locations, written)) if ok]
        self._guard(lambda: self._index.publish(stored), "put")
        failed = [loc.slot for loc, ok in zip(locations, written) if not ok]
        if failed:
            self._guard(lambda: self._index.release(failed), "put")
        # keys beyond the slots we got (every other slot is being written) stay False
        return [i < len(written) and written[i] for i in range(len(keys))]

    def _delete(self, keys: list[PageKey]) -> list[bool]:
        return self._guard(lambda: self._index.remove([k.render("/") for k in keys]), "delete")

    def _clear(self, namespace: Namespace) -> None:
        names = self._guard(lambda: self._index.names_with_prefix(namespace.fingerprint + "/"), "clear")
        for start in range(0, len(names), 512):
            self._guard(lambda: self._index.remove(names[start : start + 512]), "clear")

    def _close(self) -> None:
        self._pool.shutdown(wait=True)
        self._files.close()
        self._release_index()

    # --- internals ----------------------------------------------------------------------------

    def _set_page_size(self, size: int) -> int:
        cfg: HF3FSConfig = self.config
        page_size = self._index.fix_page_size(_aligned(size))
        slots_per_file = cfg.file_size // page_size
        if slots_per_file < 1:
            raise ConfigError(
                f"file_size={cfg.file_size} is smaller than one {page_size}-byte slot", field="file_size", backend=self.name
            )
        self._index.capacity = slots_per_file * cfg.numjobs
        self.capabilities = self.capabilities.replace(max_value_size=page_size)
        return page_size

    def _transfer(self, for_read: bool, items: list[tuple[Location, Segments]]) -> list[bool]:
        if not items:
            return []
        if isinstance(self._files, UsrbioFiles):
            try:
                return self._files.batch(for_read, items)
            except (OSError, RuntimeError, TimeoutError) as exc:
                raise BackendUnavailableError(
                    f"3FS usrbio I/O under {str(self._root)!r} failed: {exc}", backend=self.name
                ) from exc
        move = self._files.read if for_read else self._files.write

        def one(item: tuple[Location, Segments]) -> bool:
            try:
                return move(*item)
            except OSError:
                return False  # confined to this page: reported as a miss / not stored

        if len(items) == 1:
            return [one(items[0])]
        return list(self._pool.map(one, items))

    def _guard(self, call: Any, operation: str) -> Any:
        """Run a slot-index call, turning Redis errors into typed errors that name the server, never its password."""
        if self._index_error is None:
            return call()
        try:
            return call()
        except self._index_error as exc:
            raise _typed_redis_error(exc, _redacted(self.config.metadata_url), operation) from None


# In-process indexes, one per (root, rank), shared by the instances of this process that open
# it, with a count of users. The first opener takes an exclusive flock on the rank's lock file so
# that no other process writes the same slots with an index of its own.
_LOCAL_INDEXES: dict[tuple[Path, int], tuple[LocalSlotIndex, int, int]] = {}
_LOCAL_INDEXES_LOCK = threading.Lock()


def _open_local_index(root: Path, rank: int) -> LocalSlotIndex:
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


def _close_local_index(root: Path, rank: int) -> None:
    with _LOCAL_INDEXES_LOCK:
        index, lock_fd, users = _LOCAL_INDEXES[(root, rank)]
        if users > 1:
            _LOCAL_INDEXES[(root, rank)] = (index, lock_fd, users - 1)
        else:
            del _LOCAL_INDEXES[(root, rank)]
            os.close(lock_fd)  # releases the flock


def _aligned(size: int) -> int:
    return -(-size // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


def _redis_error_base() -> type[BaseException]:
    try:
        import redis
    except ImportError as exc:
        raise MissingDependencyError("hf3fs", "redis", "hf3fs") from exc
    return redis.RedisError


def _typed_redis_error(exc: BaseException, where: str, operation: str) -> StorageError:
    import redis

    what = f"the hf3fs slot index in Redis at {where}"
    if isinstance(exc, redis.AuthenticationError):  # a subclass of ConnectionError: test it first
        kind, message = AuthenticationError, f"{what} rejected the credentials in metadata_url"
    elif isinstance(exc, redis.exceptions.NoPermissionError):
        kind, message = PermissionDeniedError, f"{what} refused a command to this user (ACL): {type(exc).__name__}"
    elif isinstance(exc, redis.TimeoutError):
        kind, message = StorageTimeoutError, f"{what} did not answer in time"
    elif isinstance(exc, redis.ConnectionError):
        kind, message = BackendUnavailableError, f"{what} is unreachable: {type(exc).__name__}"
    else:
        kind, message = StorageError, f"{what} failed: {type(exc).__name__}"
    return kind(message, backend="hf3fs", operation=operation)


def _redacted(url: pydantic.SecretStr | None) -> str:
    if url is None:
        return "(none)"
    from urllib.parse import urlparse

    parsed = urlparse(url.get_secret_value())
    return f"{parsed.scheme}://{parsed.hostname or ''}{':' + str(parsed.port) if parsed.port else ''}"
