"""hicache-storage: the storage-backend SDK for the L3 tier of hierarchical KV caches.

Three types, one job each: a :class:`Connector` is what a storage vendor writes (hooks and a
capability declaration, :mod:`hicache_storage.connector`); a :class:`Layer` wraps the level below
it (timeout, retry, integrity, metrics, faults: :mod:`hicache_storage.layers`); a :class:`Store`
is what :func:`open_store` returns and every caller holds (:mod:`hicache_storage.store`). Pages
are named by :mod:`hicache_storage.keys`. The names from before (``StorageBackend``, ``wrap``,
the ``*Wrapper`` classes) still work for one release: :mod:`hicache_storage.compat`.
"""

from typing import Any

from hicache_storage.buffers import RawBuffer
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.connector import Connector, Level
from hicache_storage.errors import (
    AuthenticationError,
    BackendClosedError,
    BackendContractError,
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    ErrorStatus,
    InvalidArgumentError,
    InvalidKeyError,
    MissingDependencyError,
    PermanentError,
    PermissionDeniedError,
    RetryableError,
    StorageError,
    StorageTimeoutError,
    ThrottledError,
    UnknownBackendError,
    UnsupportedOperationError,
    ValueTooLargeError,
)
from hicache_storage.keys import KeyScope, Namespace, PageKey, Shard, hash_page, page_hashes
from hicache_storage.multipool import HitPolicy, MultiPoolStore, PoolSpec, longest_cut
from hicache_storage.registry import create_backend, describe_backends, resolve
from hicache_storage.spec import StoreSpec, open_store, store_spec
from hicache_storage.layers import Layer, stack_layers
from hicache_storage.store import Store

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "BackendClosedError",
    "BackendConfig",
    "BackendContractError",
    "BackendUnavailableError",
    "Capabilities",
    "CapacityError",
    "Connector",
    "ConfigError",
    "ErrorStatus",
    "InvalidArgumentError",
    "InvalidKeyError",
    "HitPolicy",
    "KeyScope",
    "Layer",
    "Level",
    "MissingDependencyError",
    "MultiPoolStore",
    "Namespace",
    "PageKey",
    "PermanentError",
    "PermissionDeniedError",
    "PoolSpec",
    "RawBuffer",
    "RetryableError",
    "Shard",
    "StorageError",
    "Store",
    "StoreSpec",
    "StorageTimeoutError",
    "ThrottledError",
    "UnknownBackendError",
    "UnsupportedOperationError",
    "ValueTooLargeError",
    "create_backend",
    "describe_backends",
    "hash_page",
    "longest_cut",
    "open_store",
    "page_hashes",
    "resolve",
    "stack_layers",
    "store_spec",
]


def __getattr__(name: str) -> Any:
    """The names from before Connector / Layer / Store (``StorageBackend``, ``wrap``), from :mod:`hicache_storage.compat`."""
    if name in ("StorageBackend", "wrap"):
        from hicache_storage import compat

        return getattr(compat, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
