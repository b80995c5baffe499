"""The base every wrapper builds on: a backend that forwards each hook to another backend.

A wrapper sits between a caller and a backend (a connector or another wrapper) and adds one
concern (timeouts, retries, integrity, metrics, injected faults). It is itself a
:class:`~hicache_storage.backend.StorageBackend`, so callers cannot tell a wrapped backend from a
bare one, and wrappers stack: ``metrics(retry(timeout(integrity(redis))))``.

Forwarding works hook to hook. The wrapper's public method (inherited from ``StorageBackend``)
validates the keys, normalizes the buffers, enforces ``max_value_size`` and splits the batch to
``max_batch``; the wrapper's hook then calls the inner backend's *hook* directly, because that
work is already done and the inner public method would only repeat it. The inner's results are
still checked (one bool per key) and its errors still get the inner's name, exactly as the
inner's own public method would do.

Naming: a wrapper's ``name`` shows the chain, ``"timeout(redis)"``, so an error or a metric label
says which layer it came from. Statistics: each wrapper adds its own counters (``timeouts``,
``retries``, ``integrity_miss_checksum``...) and :meth:`BackendWrapper.stats` merges those of the
wrappers below it, so the outermost ``stats()`` shows every layer's events.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal, TypeVar, get_args

from hicache_storage.backend import _STAT_NAMES, StorageBackend
from hicache_storage.buffers import Segments
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.errors import InvalidArgumentError, StorageError
from hicache_storage.keys import Namespace, PageKey

W = TypeVar("W", bound="BackendWrapper")

#: A backend operation by name: what the retry, metrics and faults wrappers act on, count or break.
Operation = Literal["exists", "get", "put", "delete", "clear", "register_buffer"]
OPERATIONS: tuple[Operation, ...] = get_args(Operation)


class BackendWrapper(StorageBackend):
    """A backend that forwards every hook to ``inner``; subclasses override the hooks they change.

    Construct as ``Wrapper(inner, config=None)``; ``config`` is the wrapper's own small config
    (a :class:`BackendConfig` subclass, a dict, a JSON string or ``@path``). Thread-safe as long
    as the inner backend is. Closing the wrapper closes the inner backend.
    """

    #: The word used in ``wrap()`` specs and in the chain name, e.g. ``"timeout"``.
    kind: ClassVar[str] = "wrapper"
    #: Counters this wrapper adds to ``stats()``, all starting at zero.
    extra_stats: ClassVar[tuple[str, ...]] = ()

    def __init__(self, inner: StorageBackend, config: BackendConfig | dict[str, Any] | str | None = None) -> None:
        if not isinstance(inner, StorageBackend):
            raise InvalidArgumentError(
                f"{type(self).__name__} wraps a StorageBackend instance, got {type(inner).__name__}; "
                "create the backend first (hicache_storage.create_backend) and wrap that"
            )
        self.inner = inner
        self.name = f"{self.kind}({inner.name})"  # type: ignore[misc]  # instance name shows the chain
        super().__init__(config)
        self.capabilities = self.adjust_capabilities(inner.capabilities)
        self._stats.update(dict.fromkeys(self.extra_stats, 0))

    def adjust_capabilities(self, inner: Capabilities) -> Capabilities:
        """The capabilities this wrapper offers, given the inner backend's; by default the same."""
        return inner

    # --- forwarding, with the inner's result checks and error context -------------------------

    def forward(self, operation: str, hook: Callable[..., Any], keys: list[PageKey], *args: Any) -> list[bool]:
        """Call an inner hook for ``keys``, check its results and name the inner in its errors."""
        self.inner._check_open(operation)
        try:
            raw = hook(keys, *args)
        except StorageError as exc:
            raise exc.with_context(backend=self.inner.name, operation=operation)
        return self.inner._checked(operation, keys, raw)

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        return self.forward("exists", self.inner._exists, keys)

    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        return self.forward("get", self.inner._get_into, keys, targets)

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        return self.forward("put", self.inner._put_from, keys, sources)

    def _delete(self, keys: list[PageKey]) -> list[bool]:
        return self.forward("delete", self.inner._delete, keys)

    def _clear(self, namespace: Namespace) -> None:
        self.inner._check_open("clear")
        try:
            self.inner._clear(namespace)
        except StorageError as exc:
            raise exc.with_context(backend=self.inner.name, operation="clear")

    def _register_buffer(self, view: memoryview) -> None:
        self.inner._check_open("register_buffer")
        try:
            self.inner._register_buffer(view)
        except StorageError as exc:
            raise exc.with_context(backend=self.inner.name, operation="register_buffer")

    def _close(self) -> None:
        self.inner.close()

    # --- introspection ------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """This wrapper's counters, plus the wrapper-specific counters of every layer below it.

        Call and byte counters are this layer's; a wrapper-specific counter present in several
        layers (two timeouts stacked) is their sum.
        """
        merged = {name: value for name, value in self.inner.stats().items() if name not in _STAT_NAMES}
        for name, value in super().stats().items():
            merged[name] = value if name in _STAT_NAMES else merged.get(name, 0) + value
        return merged

    def layers(self) -> list[StorageBackend]:
        """Every backend in the chain, this wrapper first and the connector last."""
        chain: list[StorageBackend] = [self]
        backend = self.inner
        while isinstance(backend, BackendWrapper):
            chain.append(backend)
            backend = backend.inner
        chain.append(backend)
        return chain

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.config} inner={self.inner!r}>"


def unwrap(backend: StorageBackend) -> StorageBackend:
    """The connector at the bottom of a chain of wrappers (``backend`` itself if not wrapped)."""
    while isinstance(backend, BackendWrapper):
        backend = backend.inner
    return backend


def find_wrapper(backend: StorageBackend, cls: type[W]) -> W | None:
    """The outermost layer of type ``cls`` in ``backend``'s chain, or ``None`` if there is none."""
    while isinstance(backend, BackendWrapper):
        if isinstance(backend, cls):
            return backend
        backend = backend.inner
    return None
