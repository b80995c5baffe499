"""The StorageBackend contract.

Two faces, kept apart:

* **Callers** (the HiCache core, the SGLang adapter, the benchmark) use the public methods:
  :meth:`~StorageBackend.exists`, :meth:`~StorageBackend.get_into`,
  :meth:`~StorageBackend.put_from`, :meth:`~StorageBackend.delete`, :meth:`~StorageBackend.clear`,
  and the helpers built on them (:meth:`~StorageBackend.prefix_exists`,
  :meth:`~StorageBackend.get`, :meth:`~StorageBackend.put`). These validate input, normalize
  buffers, split batches to the declared ``max_batch``, enforce ``max_value_size``, refuse
  undeclared operations, and check what the connector returned.
* **Connector authors** implement the hooks :meth:`_exists`, :meth:`_get_into`,
  :meth:`_put_from` (required), and :meth:`_delete`, :meth:`_clear`, :meth:`_register_buffer`,
  :meth:`_close` (optional), plus a ``capabilities`` declaration and a ``Config`` class. Hooks
  receive validated keys, normalized buffers and batches no larger than ``max_batch``.

Semantics every connector keeps (the conformance suite checks them):

* **Per-key results.** Each batch method returns one result per key, in order. A miss is
  ``False``, never an exception. An error that affects the whole call raises a
  :class:`~hicache_storage.errors.StorageError`; an error confined to one key may be reported as
  ``False`` for that key.
* **Exact bytes or a miss.** ``get_into`` returns ``True`` for a key only if the target now holds
  exactly the bytes last stored under that key, and the stored value's length equals the
  target's total length (a value of another length is a miss: it belongs to another layout).
  For a ``False`` result the target's contents are unspecified.
* **Atomic publication.** A concurrent or later reader sees a page whole or not at all: never a
  mix of two writes, never a truncated value.
* **Thread safety.** Every method may be called from several threads at once.
* **Duplicates.** A batch may name the same key twice; each position gets its own result.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from hicache_storage.batching import write_last_positions
from hicache_storage.buffers import BufferLike, Segments, as_segments, as_view, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.errors import (
    BackendClosedError,
    BackendContractError,
    InvalidArgumentError,
    InvalidKeyError,
    StorageError,
    UnsupportedOperationError,
    ValueTooLargeError,
)
from hicache_storage.keys import Namespace, PageKey


class StorageBackend(ABC):
    """Base class of every connector and wrapper. See the module docstring for the contract."""

    #: Registry name; also used in error messages and metrics.
    name: ClassVar[str] = "unnamed"
    #: The connector's config class.
    Config: ClassVar[type[BackendConfig]] = BackendConfig
    #: Class-level declaration; an instance may refine it in ``__init__`` from its config.
    capabilities: Capabilities = Capabilities()

    def __init__(self, config: BackendConfig | dict[str, Any] | str | None = None) -> None:
        self.config = self.Config.parse(config, backend=self.name)
        self._closed = False
        self._stats_lock = threading.Lock()
        self._stats: dict[str, int] = dict.fromkeys(_STAT_NAMES, 0)

    # --- connector hooks ----------------------------------------------------------------------

    @abstractmethod
    def _exists(self, keys: list[PageKey]) -> list[bool]:
        """Whether each key holds a complete page."""

    @abstractmethod
    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        """Fill each target with its key's page; ``False`` for a miss or a stored length that differs."""

    @abstractmethod
    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        """Store each source's bytes (the concatenation of its segments) under its key, atomically."""

    def _delete(self, keys: list[PageKey]) -> list[bool]:
        """Remove each key; ``True`` if it was there. Declare ``capabilities.delete`` when overriding."""
        raise UnsupportedOperationError("this backend cannot delete pages", backend=self.name, operation="delete")

    def _clear(self, namespace: Namespace) -> None:
        """Remove every page of ``namespace`` (all shards and parts) and nothing else."""
        raise UnsupportedOperationError("this backend cannot clear a namespace", backend=self.name, operation="clear")

    def _register_buffer(self, view: memoryview) -> None:
        """Make later I/O on ``view`` faster (RDMA or pinned registration). Default: nothing to do."""

    def _close(self) -> None:
        """Release connections, threads and files. Called once."""

    # --- the caller's API ---------------------------------------------------------------------

    def exists(self, keys: Sequence[PageKey]) -> list[bool]:
        """Whether each key holds a complete page (one result per key, in order)."""
        keys = self._prepare_keys(keys, "exists")
        results = self._run_batches("exists", keys, None, self._exists)
        self._count(exists_calls=1, exists_keys=len(keys), exists_hits=sum(results))
        return results

    def prefix_exists(self, keys: Sequence[PageKey]) -> int:
        """How many keys, from the first, exist without a gap (SGLang's ``batch_exists``).

        Stops asking as soon as a batch has a miss, so a short hit costs one round trip.
        """
        keys = self._prepare_keys(keys, "exists")
        step = self.capabilities.max_batch or len(keys) or 1
        found = 0
        for start in range(0, len(keys), step):
            chunk = keys[start : start + step]
            results = self._checked("exists", chunk, self._exists(chunk))
            self._count(exists_calls=1, exists_keys=len(chunk), exists_hits=sum(results))
            for hit in results:
                if not hit:
                    return found
                found += 1
        return found

    def get_into(self, keys: Sequence[PageKey], targets: Sequence[BufferLike | Sequence[BufferLike]]) -> list[bool]:
        """Read each key's page into the caller's buffer(s); ``True`` where the target now holds it."""
        keys = self._prepare_keys(keys, "get")
        views = self._prepare_buffers(keys, targets, "get", writable=True)
        results = self._run_batches("get", keys, views, self._get_into)
        self._count(
            get_calls=1,
            get_keys=len(keys),
            get_hits=sum(results),
            bytes_read=sum(segments_size(v) for v, hit in zip(views, results) if hit),
        )
        return results

    def put_from(self, keys: Sequence[PageKey], sources: Sequence[BufferLike | Sequence[BufferLike]]) -> list[bool]:
        """Store each page from the caller's buffer(s); ``True`` where it is now stored.

        A key named more than once in one batch gets a result at each position, and the **last
        write wins**: afterwards the key holds the value of its last position (as in SGLang and in
        every KV store), also when the SDK splits the batch to ``max_batch``. The caller may reuse
        its buffers as soon as this returns: a stored page never follows later changes to them.
        """
        keys = self._prepare_keys(keys, "put")
        views = self._prepare_buffers(keys, sources, "put", writable=False)
        limit = self.capabilities.max_value_size
        if limit is not None:
            for key, segments in zip(keys, views):
                size = segments_size(segments)
                if size > limit:
                    raise ValueTooLargeError(
                        f"page of {size} bytes exceeds this backend's max_value_size of {limit} bytes; "
                        "use a smaller page size or split parts (k/v)",
                        backend=self.name,
                        operation="put",
                        key=key,
                    )
        results = self._put_batches(keys, views)
        self._count(
            put_calls=1,
            put_keys=len(keys),
            put_stored=sum(results),
            bytes_written=sum(segments_size(v) for v, ok in zip(views, results) if ok),
        )
        return results

    def delete(self, keys: Sequence[PageKey]) -> list[bool]:
        """Remove each key; ``True`` where a page was removed, ``False`` where there was none."""
        self._require("delete")
        keys = self._prepare_keys(keys, "delete")
        results = self._run_batches("delete", keys, None, self._delete)
        self._count(delete_calls=1, delete_keys=len(keys))
        return results

    def clear(self, namespace: Namespace) -> None:
        """Remove every page of ``namespace`` (all shards and parts); other namespaces are untouched."""
        self._require("clear")
        self._check_open("clear")
        if not isinstance(namespace, Namespace):
            raise InvalidArgumentError(
                f"clear() takes the Namespace to remove, got {type(namespace).__name__}",
                backend=self.name,
                operation="clear",
            )
        self._clear(namespace)

    def get(self, keys: Sequence[PageKey], size: int) -> list[bytes | None]:
        """Each key's page as ``bytes`` (``None`` on a miss); ``size`` is the page's length in bytes."""
        if not isinstance(size, int) or size < 0:
            raise InvalidArgumentError(f"size must be a non-negative int, got {size!r}", backend=self.name, operation="get")
        buffers = [bytearray(size) for _ in keys]
        hits = self.get_into(keys, buffers)
        return [bytes(buf) if hit else None for buf, hit in zip(buffers, hits)]

    def put(self, keys: Sequence[PageKey], values: Sequence[bytes | bytearray | memoryview]) -> list[bool]:
        """Store byte strings; the copying counterpart of :meth:`put_from`."""
        return self.put_from(keys, values)

    def register_buffer(self, buffer: BufferLike) -> None:
        """Announce long-lived memory (a host KV pool) that later calls will read into and write from."""
        self._check_open("register_buffer")
        self._register_buffer(as_view(buffer, writable=False))

    def stats(self) -> dict[str, int]:
        """Counters since creation: calls, keys, hits and bytes per operation."""
        with self._stats_lock:
            return dict(self._stats)

    def close(self) -> None:
        """Release resources. Idempotent; later calls raise ``BackendClosedError``."""
        if not self._closed:
            self._closed = True
            self._close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} {self.config}>"

    # --- internals ----------------------------------------------------------------------------

    def _check_open(self, operation: str) -> None:
        if self._closed:
            raise BackendClosedError("backend is closed", backend=self.name, operation=operation)

    def _require(self, capability: str) -> None:
        if not getattr(self.capabilities, capability):
            raise UnsupportedOperationError(
                f"{self.name!r} does not support {capability}; check backend.capabilities.{capability} first",
                backend=self.name,
                operation=capability,
            )

    def _prepare_keys(self, keys: Sequence[PageKey], operation: str) -> list[PageKey]:
        self._check_open(operation)
        if isinstance(keys, (str, bytes, PageKey)):
            raise InvalidArgumentError(
                "keys must be a sequence of PageKey (wrap a single key in a list)", backend=self.name, operation=operation
            )
        keys = list(keys)
        for key in keys:
            if type(key) is not PageKey:
                raise InvalidKeyError(
                    f"keys must be PageKey objects (see hicache_storage.keys), got {type(key).__name__}: {key!r}",
                    backend=self.name,
                    operation=operation,
                )
        return keys

    def _prepare_buffers(self, keys: list[PageKey], buffers: Sequence[Any], operation: str, *, writable: bool) -> list[Segments]:
        buffers = list(buffers)
        if len(buffers) != len(keys):
            raise InvalidArgumentError(
                f"got {len(keys)} keys but {len(buffers)} buffers; pass one buffer (or list of segments) per key",
                backend=self.name,
                operation=operation,
            )
        return [as_segments(buffer, writable=writable) for buffer in buffers]

    def _run_batches(self, operation: str, keys: list[PageKey], buffers: list[Segments] | None, hook: Any) -> list[bool]:
        step = self.capabilities.max_batch or len(keys) or 1
        results: list[bool] = []
        for start in range(0, len(keys), step):
            chunk = keys[start : start + step]
            results.extend(self._call_hook(operation, hook, chunk, None if buffers is None else buffers[start : start + step]))
        return results

    def _put_batches(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        """Put a batch larger than ``max_batch`` in chunks, the last chunk first.

        Within one put the first pages count as the most recent (``capacity_bytes``), so the
        chunk holding the head is written last and a store that evicts the least recent writes
        drops a prefix's tail, not its head. In that order a key named in two chunks would end
        with its earlier value, so only each key's last position is written, and every position
        gets its key's result. A batch within ``max_batch`` reaches the connector as given.
        """
        step = self.capabilities.max_batch
        if not step or len(keys) <= step:
            return self._call_hook("put", self._put_from, keys, sources)

        def write(written: list[int]) -> list[bool]:
            stored: dict[int, bool] = {}
            for start in reversed(range(0, len(written), step)):
                chunk = written[start : start + step]
                results = self._call_hook("put", self._put_from, [keys[i] for i in chunk], [sources[i] for i in chunk])
                stored.update(zip(chunk, results))
            return [stored[p] for p in written]

        return write_last_positions(keys, write)

    def _call_hook(self, operation: str, hook: Any, keys: list[PageKey], buffers: list[Segments] | None) -> list[bool]:
        """One hook call on a batch within ``max_batch``: its errors name this backend, its results are checked."""
        try:
            raw = hook(keys) if buffers is None else hook(keys, buffers)
        except StorageError as exc:
            raise exc.with_context(backend=self.name, operation=operation)
        return self._checked(operation, keys, raw)

    def _checked(self, operation: str, keys: list[PageKey], results: Any) -> list[bool]:
        if not isinstance(results, list) or len(results) != len(keys):
            count = len(results) if isinstance(results, (list, tuple)) else type(results).__name__
            raise BackendContractError(
                f"{operation} returned {count} results for {len(keys)} keys; a connector must return a list with one bool per key",
                backend=self.name,
                operation=operation,
            )
        for result in results:
            if result is not True and result is not False:
                raise BackendContractError(
                    f"{operation} returned a {type(result).__name__}; results must be True or False",
                    backend=self.name,
                    operation=operation,
                )
        return results

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                self._stats[name] += delta


_STAT_NAMES = (
    "exists_calls",
    "exists_keys",
    "exists_hits",
    "get_calls",
    "get_keys",
    "get_hits",
    "put_calls",
    "put_keys",
    "put_stored",
    "delete_calls",
    "delete_keys",
    "bytes_read",
    "bytes_written",
)

