"""The StorageBackend contract: what a connector implements, and the layer interface.

Three faces, kept apart:

* **Connector authors** implement the hooks :meth:`_exists`, :meth:`_get_into`,
  :meth:`_put_from` (required), and :meth:`_delete`, :meth:`_clear`, :meth:`_register_buffer`,
  :meth:`_close` (optional), plus a ``capabilities`` declaration and a ``Config`` class. Hooks
  receive validated keys, normalized buffers and batches no larger than ``max_batch``. That is
  all a connector is.
* **The layer interface** is what the level above calls, a layer
  (:mod:`hicache_storage.wrappers`) or the store facade (:mod:`hicache_storage.store`), and
  nothing else: the public hooks :meth:`hook_exists`, :meth:`hook_get_into`,
  :meth:`hook_put_from`, :meth:`hook_delete`, :meth:`hook_clear`, :meth:`hook_register_buffer`,
  and ``name``, ``capabilities`` (read on every call: live), :meth:`event_counts`, :meth:`close`,
  ``closed`` and ``inner`` (the level below a layer; ``None`` for a connector). Each public hook
  checks that this level is open, calls this level's own underscore hook, names this level in
  the errors it raises, and checks its results (one ``bool`` per key,
  :func:`~hicache_storage.store.check_results`). No level calls another object's underscore
  methods.
* **Callers** use a :class:`~hicache_storage.store.Store`: validation, buffers, batch splitting,
  statistics. Every backend has one over itself as :attr:`facade`, and the caller methods here
  (:meth:`exists`, :meth:`get_into`, :meth:`put_from`, :meth:`prefix_exists`, :meth:`get`,
  :meth:`put`, :meth:`delete`, :meth:`clear`, :meth:`register_buffer`, :meth:`stats`) are that
  facade's, so a connector used directly is a store without layers.

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

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from hicache_storage.buffers import BufferLike, Segments
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.counters import EventCounters
from hicache_storage.errors import BackendClosedError, StorageError, UnsupportedOperationError
from hicache_storage.keys import Namespace, PageKey
from hicache_storage.store import Store, check_results


class StorageBackend(ABC):
    """Base class of every connector and layer. See the module docstring for the contract."""

    #: Registry name; also used in error messages and metrics.
    name: ClassVar[str] = "unnamed"
    #: The connector's config class.
    Config: ClassVar[type[BackendConfig]] = BackendConfig
    #: Class-level declaration; an instance may refine it whenever it learns more (at connect,
    #: after its first put): every level above reads it on each call.
    capabilities: Capabilities = Capabilities()
    #: Event counters this level keeps, all starting at zero (see :meth:`event_counts`).
    extra_stats: ClassVar[tuple[str, ...]] = ()
    #: The level below; ``None`` for a connector (a layer sets it).
    inner: StorageBackend | None = None

    def __init__(self, config: BackendConfig | dict[str, Any] | str | None = None) -> None:
        self.config = self.Config.parse(config, backend=self.name)
        self._closed = False
        self._event_counts = EventCounters(self.extra_stats)
        #: The caller's facade over this level (and everything below it).
        self.facade = Store(self)

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
        """Release connections, threads and files. Called once, never while a hook of this level runs
        (the timeout layer defers it past the calls it abandoned)."""

    # --- the layer interface: what the level above calls --------------------------------------

    def hook_exists(self, keys: list[PageKey]) -> list[bool]:
        """:meth:`_exists` of this level, checked (see the module docstring)."""
        return self._hooked("exists", self._exists, keys)

    def hook_get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        return self._hooked("get", self._get_into, keys, targets)

    def hook_put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        return self._hooked("put", self._put_from, keys, sources)

    def hook_delete(self, keys: list[PageKey]) -> list[bool]:
        return self._hooked("delete", self._delete, keys)

    def hook_clear(self, namespace: Namespace) -> None:
        self._unchecked("clear", self._clear, namespace)

    def hook_register_buffer(self, view: memoryview) -> None:
        self._unchecked("register_buffer", self._register_buffer, view)

    def event_counts(self) -> dict[str, int]:
        """This level's own event counters (a layer's timeouts or retries, a connector's evictions)."""
        return self._event_counts.snapshot()

    def close(self) -> None:
        """Release resources (a layer closes the level below too). Idempotent; later calls raise ``BackendClosedError``."""
        if not self._closed:
            self._closed = True
            self._close()

    @property
    def closed(self) -> bool:
        return self._closed

    # --- the caller's API: this level's store facade ------------------------------------------

    def exists(self, keys: Sequence[PageKey]) -> list[bool]:
        """See :meth:`Store.exists <hicache_storage.store.Store.exists>`."""
        return self.facade.exists(keys)

    def prefix_exists(self, keys: Sequence[PageKey]) -> int:
        """See :meth:`Store.prefix_exists <hicache_storage.store.Store.prefix_exists>`."""
        return self.facade.prefix_exists(keys)

    def get_into(self, keys: Sequence[PageKey], targets: Sequence[BufferLike | Sequence[BufferLike]]) -> list[bool]:
        """See :meth:`Store.get_into <hicache_storage.store.Store.get_into>`."""
        return self.facade.get_into(keys, targets)

    def put_from(self, keys: Sequence[PageKey], sources: Sequence[BufferLike | Sequence[BufferLike]]) -> list[bool]:
        """See :meth:`Store.put_from <hicache_storage.store.Store.put_from>` (the last write of a key wins)."""
        return self.facade.put_from(keys, sources)

    def delete(self, keys: Sequence[PageKey]) -> list[bool]:
        return self.facade.delete(keys)

    def clear(self, namespace: Namespace) -> None:
        self.facade.clear(namespace)

    def get(self, keys: Sequence[PageKey], size: int) -> list[bytes | None]:
        return self.facade.get(keys, size)

    def put(self, keys: Sequence[PageKey], values: Sequence[bytes | bytearray | memoryview]) -> list[bool]:
        return self.facade.put(keys, values)

    def register_buffer(self, buffer: BufferLike) -> None:
        self.facade.register_buffer(buffer)

    def stats(self) -> dict[str, int]:
        """See :meth:`Store.stats <hicache_storage.store.Store.stats>`: this facade's counters and every level's events."""
        return self.facade.stats()

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} {self.config}>"

    # --- internals ----------------------------------------------------------------------------

    def _count(self, **deltas: int) -> int:
        """Add to this level's event counters; returns the new value of the last one named."""
        return self._event_counts.add(**deltas)

    def _check_open(self, operation: str) -> None:
        if self._closed:
            raise BackendClosedError("backend is closed", backend=self.name, operation=operation)

    def _hooked(self, operation: str, hook: Callable[..., Any], keys: list[PageKey], *args: Any) -> list[bool]:
        self._check_open(operation)
        try:
            raw = hook(keys, *args)
        except StorageError as exc:
            raise exc.with_context(backend=self.name, operation=operation)
        return check_results(self.name, operation, keys, raw)

    def _unchecked(self, operation: str, hook: Callable[[Any], None], arg: Any) -> None:
        self._check_open(operation)
        try:
            hook(arg)
        except StorageError as exc:
            raise exc.with_context(backend=self.name, operation=operation)
