"""What a storage vendor writes (:class:`Connector`), and the interface every level of a stack offers (:class:`Level`).

A store is a stack: a connector at the bottom, the layers an operator asks for above it
(:mod:`hicache_storage.layers`: timeout, retry, integrity, metrics, fault injection), and on top
the :class:`~hicache_storage.store.Store` every caller holds. Three types, one job each:

* **A connector** implements the hooks :meth:`~Level._exists`, :meth:`~Level._get_into`,
  :meth:`~Level._put_from` (required), and :meth:`~Level._delete`, :meth:`~Level._clear`,
  :meth:`~Level._register_buffer`, :meth:`~Level._close` (optional), plus a ``capabilities``
  declaration and a ``Config`` class. Hooks receive validated keys, normalized buffers and
  batches of at least one key and at most ``max_batch``. That is all a connector is.
* **A layer** (:class:`~hicache_storage.layers.Layer`) wraps the level below it and adds one
  concern.
* **The store** validates, normalizes buffers, splits batches, counts, describes.

Connectors and layers are both *levels*. The **level interface** is what the level above calls (a
layer or the store) and nothing else: the public hooks :meth:`~Level.hook_exists`,
:meth:`~Level.hook_get_into`, :meth:`~Level.hook_put_from`, :meth:`~Level.hook_delete`,
:meth:`~Level.hook_clear`, :meth:`~Level.hook_register_buffer`, and ``name``, ``capabilities``
(read on every call: live), :meth:`~Level.event_counts`, :meth:`~Level.close`, ``closed`` and
``inner`` (the level below a layer; ``None`` for a connector). Each public hook checks that this
level is open, calls this level's own underscore hook, names this level in the errors it raises,
and checks its results (one ``bool`` per key, :func:`check_results`). No level calls another
object's underscore methods.

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
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from hicache_storage.buffers import Segments
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.counters import EventCounters
from hicache_storage.errors import BackendClosedError, BackendContractError, StorageError, UnsupportedOperationError
from hicache_storage.keys import Namespace, PageKey


class Level(ABC):
    """One level of a stack, a connector or a layer: its hooks and the level interface (module docstring)."""

    #: A connector's registry name (a class attribute); a layer's shows the chain, ``"timeout(redis)"``.
    #: Used in error messages and metrics.
    name: str = "unnamed"
    #: This level's config class.
    Config: ClassVar[type[BackendConfig]] = BackendConfig
    #: Event counters this level keeps, all starting at zero (see :meth:`event_counts`).
    extra_stats: ClassVar[tuple[str, ...]] = ()
    #: The level below; ``None`` for a connector.
    inner: Level | None = None

    def __init__(self, config: BackendConfig | Mapping[str, Any] | str | None = None) -> None:
        self.config = self.Config.parse(config, backend=self.name)
        self._closed = False
        self._event_counts = EventCounters(self.extra_stats)

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What this level can do, read on every call by the level above."""

    # --- the hooks: what this level does --------------------------------------------------------

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

    # --- the level interface: what the level above calls -----------------------------------------

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

    def levels(self) -> list[Level]:
        """This level and every level below it, the connector last."""
        chain: list[Level] = [self]
        while (below := chain[-1].inner) is not None:
            chain.append(below)
        return chain

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


class Connector(Level):
    """Base class of every connector: subclass it, implement the hooks, declare ``capabilities``.

    ``capabilities`` is a class-level declaration; an instance may refine it whenever it learns
    more (at connect, after its first put): every level above reads it on each call. Keep your
    own state out of the names the base class uses: ``name``, ``config``, ``capabilities``,
    ``inner``, ``_closed``, ``_event_counts``. Open it in a store to use it
    (:func:`~hicache_storage.spec.open_store`, or :class:`~hicache_storage.store.Store` over an
    instance).
    """

    capabilities: Capabilities = Capabilities()
    inner: None = None


def check_results(name: str, operation: str, keys: list[PageKey], results: Any) -> list[bool]:
    """``results`` if it is a list of one ``bool`` per key; else ``BackendContractError`` naming ``name``."""
    if not isinstance(results, list) or len(results) != len(keys):
        count = len(results) if isinstance(results, (list, tuple)) else type(results).__name__
        raise BackendContractError(
            f"{operation} returned {count} results for {len(keys)} keys; a connector must return a list with one bool per key",
            backend=name,
            operation=operation,
        )
    for result in results:
        if result is not True and result is not False:
            raise BackendContractError(
                f"{operation} returned a {type(result).__name__}; results must be True or False",
                backend=name,
                operation=operation,
            )
    return results
