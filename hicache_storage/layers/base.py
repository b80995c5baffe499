"""The base every layer builds on: a level of the stack that calls the level below through the
level interface.

A layer sits between the store and a connector (or another layer) and adds one concern
(timeouts, retries, integrity, metrics, injected faults), as OpenDAL's layers wrap an accessor.
It is a :class:`~hicache_storage.connector.Level`: it implements the underscore hooks for itself,
and reaches the level below (``inner``) only through the documented level interface,
``inner.hook_exists(...)``, ``inner.hook_get_into(...)``, ``inner.capabilities``,
``inner.event_counts()``, ``inner.close()`` (see :mod:`hicache_storage.connector`), never through
another object's underscore methods. Layers stack: ``metrics(retry(timeout(integrity(redis))))``.

The store above the stack (:class:`~hicache_storage.store.Store`) validates keys, normalizes
buffers, enforces ``max_value_size`` and splits batches to ``max_batch`` once, for the whole
stack; each level's public hooks check that level's results (one bool per key) and name it in
its errors.

Capabilities are **live**: a layer does not copy them, it computes them from the level below on
every read (:meth:`Layer.adjust_capabilities`), so a connector that refines its capabilities
after opening is seen through every layer at once.

Naming: a layer's ``name`` shows the chain, ``"timeout(redis)"``, so an error or a metric label
says which level it came from. Statistics: each layer counts its own events (``timeouts``,
``retries``, ``integrity_miss_checksum``...) with ``_count``; a store's ``stats()`` sums the
events of every level below it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar, get_args

from hicache_storage.buffers import Segments
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.connector import Level
from hicache_storage.errors import InvalidArgumentError
from hicache_storage.keys import Namespace, PageKey

if TYPE_CHECKING:
    from hicache_storage.store import Store

L = TypeVar("L", bound="Layer")

#: A backend operation by name: what the retry, metrics and faults layers act on, count or break.
Operation = Literal["exists", "get", "put", "delete", "clear", "register_buffer"]
OPERATIONS: tuple[Operation, ...] = get_args(Operation)


class Layer(Level):
    """A level that forwards every hook to ``inner``; subclasses override the hooks they change.

    Construct as ``Layer(inner, config=None)``; ``config`` is the layer's own small config (a
    :class:`BackendConfig` subclass, a dict, a JSON string or ``@path``). Thread-safe as long as
    the level below is. Closing the layer closes the level below.
    """

    #: The word used in layer specs and in the chain name, e.g. ``"timeout"``.
    kind: ClassVar[str] = "layer"
    inner: Level

    def __init__(self, inner: Level, config: BackendConfig | dict[str, Any] | str | None = None) -> None:
        if not isinstance(inner, Level):
            raise InvalidArgumentError(
                f"{type(self).__name__} goes over a connector or another layer, got {type(inner).__name__}; "
                "build the connector first (hicache_storage.create_backend) and put the layer over it"
            )
        self.inner = inner
        self.name = f"{self.kind}({inner.name})"  # the chain, so errors and metrics say which level
        super().__init__(config)

    @property
    def capabilities(self) -> Capabilities:
        """This layer's capabilities, computed from the level below's on every read."""
        return self.adjust_capabilities(self.inner.capabilities)

    def adjust_capabilities(self, inner: Capabilities) -> Capabilities:
        """The capabilities this layer offers, given the level below's; by default the same."""
        return inner

    # --- forwarding through the level interface -----------------------------------------------

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

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.config} inner={self.inner!r}>"


def connector_of(stack: Store | Level) -> Level:
    """The connector at the bottom of a stack (a store's, or below a level; a connector itself)."""
    return stack.levels()[-1]


def find_layer(stack: Store | Level, cls: type[L]) -> L | None:
    """The outermost layer of type ``cls`` in a stack (a store's, or from a level down), or ``None``."""
    for level in stack.levels():
        if isinstance(level, cls):
            return level
    return None
