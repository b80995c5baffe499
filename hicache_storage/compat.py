"""The names this package had before it said Connector, Layer and Store: accepted for one more
release, each with a :class:`DeprecationWarning` that names its replacement.

* ``StorageBackend`` is :class:`~hicache_storage.connector.Connector` under its old name. A
  connector written against it (hooks, ``capabilities``, ``Config``) loads, registers and passes
  the conformance suite unchanged; subclassing it warns. Its instances also keep the caller
  methods a connector used to carry (``exists``, ``get_into``, ``put_from``...), which now belong
  to the :class:`~hicache_storage.store.Store` over it.
* Layers were called wrappers: ``BackendWrapper`` (:class:`~hicache_storage.layers.Layer`),
  ``TimeoutWrapper``, ``RetryWrapper``, ``IntegrityWrapper``, ``MetricsWrapper``,
  ``FaultInjectionWrapper`` (the ``*Layer`` classes of :mod:`hicache_storage.layers`), ``WRAPPERS``,
  ``wrap``, ``find_wrapper``, ``unwrap``, ``load_wrapper_specs``: importable from here.
* The config keys and flags that said ``wrappers`` (a layer file's ``{"wrappers": [...]}``, the
  SGLang adapter's ``wrappers``, the CLI's ``--wrappers``, the suite's ``backend_wrappers``
  fixture) are read as ``layers``, with the same warning (:func:`warn_renamed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hicache_storage import layers
from hicache_storage.buffers import BufferLike
from hicache_storage.connector import Connector, Level
from hicache_storage.deprecation import renamed_message, warn_renamed
from hicache_storage.keys import Namespace, PageKey
from hicache_storage.store import Store


class StorageBackend(Connector):
    """The old name of :class:`~hicache_storage.connector.Connector` (deprecated; see the module docstring)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        warn_renamed(f"subclassing hicache_storage.StorageBackend ({cls.__module__}.{cls.__qualname__})", "hicache_storage.Connector", stacklevel=4)

    @property
    def facade(self) -> Store:
        """A store over this connector, as every StorageBackend had."""
        store: Store | None = self.__dict__.get("_compat_store")
        if store is None:
            store = self.__dict__["_compat_store"] = Store(self)
        return store

    def exists(self, keys: Sequence[PageKey]) -> list[bool]:
        return self.facade.exists(keys)

    def prefix_exists(self, keys: Sequence[PageKey]) -> int:
        return self.facade.prefix_exists(keys)

    def get_into(self, keys: Sequence[PageKey], targets: Sequence[BufferLike | Sequence[BufferLike]]) -> list[bool]:
        return self.facade.get_into(keys, targets)

    def put_from(self, keys: Sequence[PageKey], sources: Sequence[BufferLike | Sequence[BufferLike]]) -> list[bool]:
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
        return self.facade.stats()


def conformance_layers_by_old_names(tests: Any, request: Any) -> list[dict[str, Any]] | None:
    """Layer specs a conformance test class gives under the names from before layers were layers:
    a ``backend_wrappers`` fixture or a ``wrappers`` class attribute (each warns), else ``None``.
    ``request`` is the pytest fixture request."""
    cls = type(tests)
    if hasattr(cls, "backend_wrappers"):
        warn_renamed(f"{cls.__name__}.backend_wrappers", "the backend_layers fixture")
        specs: list[dict[str, Any]] | None = request.getfixturevalue("backend_wrappers")
        return specs
    old: list[dict[str, Any]] | None = getattr(cls, "wrappers", None)
    if old is not None:
        warn_renamed(f"{cls.__name__}.wrappers", "the 'layers' class attribute")
        return list(old)
    return None


def wrap(backend: Level, specs: layers.LayerSpecs) -> Level:
    """The old name of :func:`~hicache_storage.layers.stack_layers` (deprecated)."""
    warn_renamed("hicache_storage.wrap", "hicache_storage.layers.stack_layers")
    return layers.stack_layers(backend, specs)


#: Old name -> (the object now, its new name).
_RENAMED: dict[str, tuple[Any, str]] = {
    "BackendWrapper": (layers.Layer, "hicache_storage.layers.Layer"),
    "TimeoutWrapper": (layers.TimeoutLayer, "hicache_storage.layers.TimeoutLayer"),
    "RetryWrapper": (layers.RetryLayer, "hicache_storage.layers.RetryLayer"),
    "IntegrityWrapper": (layers.IntegrityLayer, "hicache_storage.layers.IntegrityLayer"),
    "MetricsWrapper": (layers.MetricsLayer, "hicache_storage.layers.MetricsLayer"),
    "FaultInjectionWrapper": (layers.FaultInjectionLayer, "hicache_storage.layers.FaultInjectionLayer"),
    "WRAPPERS": (layers.LAYERS, "hicache_storage.layers.LAYERS"),
    "WrapperSpecs": (layers.LayerSpecs, "hicache_storage.layers.LayerSpecs"),
    "find_wrapper": (layers.find_layer, "hicache_storage.layers.find_layer"),
    "unwrap": (layers.connector_of, "hicache_storage.layers.connector_of"),
    "load_wrapper_specs": (layers.load_layer_specs, "hicache_storage.layers.load_layer_specs"),
}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        value, new = _RENAMED[name]
        warn_renamed(f"hicache_storage.compat.{name}", new)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["StorageBackend", "conformance_layers_by_old_names", "renamed_message", "warn_renamed", "wrap", *_RENAMED]
