"""3FS: pages in pre-sized per-rank files of fixed-size slots on a 3FS mount, plus a slot index.

**Not tested against 3FS.** No 3FS cluster or client could run where this was written (the
usrbio binding does not build there). The POSIX path was tested on a local directory standing
in for the mount. The usrbio path is written against the ``hf3fs_fuse.io`` API as SGLang uses it;
only its glue was tested, against a stand-in binding doing plain file I/O, never against 3FS.
3FS presents itself as a POSIX file system, which is what the POSIX path uses.

Layout: rank ``r`` owns ``numjobs`` files ``<root>/rank<r>.<j>.data``, each ``file_size`` bytes
(created sparse with ``ftruncate``), cut into slots of ``page_size_bytes`` (from the config, or
fixed by the first write, rounded up to 4 KiB). A page is written into a free slot of its
writer's files and then *published* in the slot index under its key (``key.render("/")``); readers
find it through the index, so any rank can read any rank's pages (MLA: rank 0 writes, every rank
reads). Slot ``s`` is file ``s % numjobs`` at offset ``(s // numjobs) * slot size``.

The slot index lives

* in this process (``metadata_url`` unset): instances of one process with the same root and
  rank share it; another process is kept off that rank's files by a lock file. Pages are not
  shared with other processes and are forgotten when the last instance closes;
* in Redis (``metadata_url: redis://...``): instances and ranks on any host share pages, and
  pages survive restarts. Every allocation and publication is one Lua script, so it is atomic.
  Standalone Redis only (the scripts touch keys they compute). The index's keys start with
  ``metadata_prefix``, by default ``hicache:hf3fs:<first 16 hex digits of sha256(resolved root)>:``
  (their layout: :class:`~hicache_storage.connectors.hf3fs.redis_index.RedisSlotIndex`).

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

The package's modules are listed in its docstring (:mod:`hicache_storage.connectors.hf3fs`).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import pydantic

from hicache_storage.connector import Connector
from hicache_storage.buffers import Segments, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.connectors.hf3fs.index import Location, LocalSlotIndex, close_local_index, open_local_index
from hicache_storage.connectors.hf3fs.io import PosixFiles, UsrbioFiles, usrbio_available
from hicache_storage.connectors.hf3fs.redis_index import (
    RedisSlotIndex,
    redacted_url,
    redis_error_base,
    typed_redis_error,
)
from hicache_storage.errors import (
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    MissingDependencyError,
    ValueTooLargeError,
)
from hicache_storage.keys import Namespace, PageKey

#: Slot sizes are rounded up to a multiple of this.
SLOT_ALIGNMENT = 4096


class HF3FSConfig(BackendConfig):
    """Settings of the hf3fs backend: the mount, the rank's files, the slot index, the I/O path."""

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


class HF3FSBackend(Connector):
    """Pages in slot files on a 3FS mount. See the module docstring; untested against real 3FS."""

    name = "hf3fs"
    Config = HF3FSConfig
    config: HF3FSConfig
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
        self._index_error = redis_error_base() if cfg.metadata_url is not None else None
        #: This instance's slot size, once it and the index's capacity are set (``_set_page_size``).
        self._slot_size: int | None = None
        if cfg.metadata_url is None:
            self._index: LocalSlotIndex | RedisSlotIndex = open_local_index(self._root, cfg.rank)
        else:
            prefix = cfg.metadata_prefix or f"hicache:hf3fs:{hashlib.sha256(str(self._root).encode()).hexdigest()[:16]}:"
            self._index = self._guard(lambda: RedisSlotIndex(cfg.metadata_url.get_secret_value(), prefix, cfg.rank, 0), "connect")
            self.capabilities = self.capabilities.replace(
                persistent=True, shared_across_processes=True, outlives_writer=True, shared_across_hosts=True
            )
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
        if page_size is not None:
            self._set_page_size(page_size)
        self._files: PosixFiles
        if not use_usrbio:
            self._files = PosixFiles(self._root, cfg.numjobs, cfg.file_size)
        elif page_size is not None:
            self._files = UsrbioFiles(self._root, cfg.numjobs, cfg.file_size, _aligned(page_size), cfg.usrbio_entries, cfg.usrbio_timeout_s)
        else:
            raise ConfigError(
                "the usrbio path needs page_size_bytes to size its buffers", field="page_size_bytes", backend=self.name
            )
        self._files.create(cfg.rank)
        self.capabilities = self.capabilities.replace(zero_copy_read=self._files.zero_copy, zero_copy_write=self._files.zero_copy)
        self._pool = ThreadPoolExecutor(max_workers=cfg.numjobs, thread_name_prefix="hf3fs-io")

    def _release_index(self) -> None:
        if isinstance(self._index, LocalSlotIndex):
            close_local_index(self._root, self.config.rank)
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
        if not keys:
            return []  # no page to write, and none to learn the slot size from
        sizes = [segments_size(s) for s in sources]
        # Without page_size_bytes the first put fixes the slot size: its largest page, and at
        # least one aligned block (a put of zero-byte pages still needs slots of some size).
        page_size = self._slot_size or self._set_page_size(max(*sizes, 1))
        too_big = [s for s in sizes if s > page_size]
        if too_big:
            raise ValueTooLargeError(
                f"a page of {too_big[0]} bytes does not fit in this store's {page_size}-byte slots; set page_size_bytes "
                "to the largest page (without it, the first put fixes the slot size from its largest page)"
            )
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
        """Fix the slot size (``size``, unless the index has one) and the index's capacity from
        it. ``_slot_size`` is set last: a put that finds it set finds the capacity set too. (Two
        first puts at once: the second, seeing the index's slot size before the first had set
        the capacity, reserved from a capacity of 0 and failed "no free slot".)"""
        cfg: HF3FSConfig = self.config
        page_size = self._index.fix_page_size(_aligned(size))
        slots_per_file = cfg.file_size // page_size
        if slots_per_file < 1:
            raise ConfigError(
                f"file_size={cfg.file_size} is smaller than one {page_size}-byte slot", field="file_size", backend=self.name
            )
        self._index.capacity = slots_per_file * cfg.numjobs
        self.capabilities = self.capabilities.replace(max_value_size=page_size)
        self._slot_size = page_size
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
            raise typed_redis_error(exc, redacted_url(self.config.metadata_url), operation) from None


def _aligned(size: int) -> int:
    return -(-size // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
