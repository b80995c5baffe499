"""The base every layer builds on: a level of the stack that calls the level below through the
layer interface.

A layer sits between a caller and a backend (a connector or another layer) and adds one concern
(timeouts, retries, integrity, metrics, injected faults), as OpenDAL's layers wrap an accessor.
It is itself a :class:`~hicache_storage.backend.StorageBackend`: it implements the underscore
hooks for itself, and reaches the level below (``inner``) only through the documented layer
interface, ``inner.hook_exists(...)``, ``inner.hook_get_into(...)``, ``inner.capabilities``,
``inner.event_counts()``, ``inner.close()`` (see :mod:`hicache_storage.backend`), never through
another object's underscore methods. Layers stack: ``metrics(retry(timeout(integrity(redis))))``.

The store facade above the stack (:class:`~hicache_storage.store.Store`) validates keys,
normalizes buffers, enforces ``max_value_size`` and splits batches to ``max_batch`` once, for the
whole stack; each level's public hooks check that level's results (one bool per key) and name it
in its errors.

Capabilities are **live**: a layer does not copy them, it computes them from the level below on
every read (:meth:`Layer.adjust_capabilities`), so a connector that refines its capabilities
after opening is seen through every layer at once.

Naming: a layer's ``name`` shows the chain, ``"timeout(redis)"``, so an error or a metric label
says which level it came from. Statistics: each layer counts its own events (``timeouts``,
``retries``, ``integrity_miss_checksum``...) with ``_count``; a facade's ``stats()`` sums the
events of every level below it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, TypeVar, get_args

from hicache_storage.backend import StorageBackend
from hicache_storage.buffers import Segments
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.errors import InvalidArgumentError
from hicache_storage.keys import Namespace, PageKey

W = TypeVar("W", bound="Layer")

#: A backend operation by name: what the retry, metrics and faults layers act on, count or break.
Operation = Literal["exists", "get", "put", "delete", "clear", "register_buffer"]
OPERATIONS: tuple[Operation, ...] = get_args(Operation)


class Layer(StorageBackend):
    """A level that forwards every hook to ``inner``; subclasses override the hooks they change.

    Construct as ``Layer(inner, config=None)``; ``config`` is the layer's own small config (a
    :class:`BackendConfig` subclass, a dict, a JSON string or ``@path``). Thread-safe as long as
    the level below is. Closing the layer closes the level below.
    """

    #: The word used in layer specs and in the chain name, e.g. ``"timeout"``.
    kind: ClassVar[str] = "layer"
    inner: StorageBackend

    def __init__(self, inner: StorageBackend, config: BackendConfig | dict[str, Any] | str | None = None) -> None:
        if not isinstance(inner, StorageBackend):
            raise InvalidArgumentError(
                f"{type(self).__name__} wraps a StorageBackend instance, got {type(inner).__name__}; "
                "open the backend first (hicache_storage.open_store or create_backend) and wrap that"
            )
        self.inner = inner
        self.name = f"{self.kind}({inner.name})"  # type: ignore[misc]  # instance name shows the chain
        super().__init__(config)

    @property  # type: ignore[override]
    def capabilities(self) -> Capabilities:
        """This layer's capabilities, computed from the level below's on every read."""
        return self.adjust_capabilities(self.inner.capabilities)

    def adjust_capabilities(self, inner: Capabilities) -> Capabilities:
        """The capabilities this layer offers, given the level below's; by default the same."""
        return inner

    # --- forwarding through the layer interface -----------------------------------------------

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        return self.inner.hook_exists(keys)

    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        return self.inner.hook_get_into(keys, targets)

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        return self.inner.hook_put_from(keys, sources)

    def _delete(self, keys: list[PageKey]) -> list[bool]:
        return self.inner.hook_delete(keys)

    def _clear(self, namespace: Namespace) -> None:
        self.inner.hook_clear(namespace)

    def _register_buffer(self, view: memoryview) -> None:
        self.inner.hook_register_buffer(view)

    def _close(self) -> None:
        self.inner.close()

    # --- introspection ------------------------------------------------------------------------

    def layers(self) -> list[StorageBackend]:
        """Every level of the stack, this layer first and the connector last."""
        return self.facade.levels()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.config} inner={self.inner!r}>"


#: The name layers had before they were layers; the same class.
BackendWrapper = Layer


def unwrap(backend: StorageBackend) -> StorageBackend:
    """The connector at the bottom of a stack (``backend`` itself if it is a connector)."""
    return backend.facade.levels()[-1]


def find_wrapper(backend: StorageBackend, cls: type[W]) -> W | None:
    """The outermost layer of type ``cls`` in ``backend``'s stack, or ``None`` if there is none."""
    for level in backend.facade.levels():
        if isinstance(level, cls):
            return level
    return None
