"""hicache-storage: the storage-backend SDK for the L3 tier of hierarchical KV caches.

Start with :class:`StorageBackend` (the connector contract), :mod:`hicache_storage.keys` (page
keys) and :func:`open_store` (a connector, its config and its layers from one :class:`StoreSpec`).
"""

from hicache_storage.backend import StorageBackend
from hicache_storage.buffers import RawBuffer
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
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
from hicache_storage.store import Store
from hicache_storage.wrappers import wrap

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "BackendClosedError",
    "BackendConfig",
    "BackendContractError",
    "BackendUnavailableError",
    "Capabilities",
    "CapacityError",
    "ConfigError",
    "ErrorStatus",
    "InvalidArgumentError",
    "InvalidKeyError",
    "HitPolicy",
    "KeyScope",
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
    "StorageBackend",
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
    "store_spec",
    "wrap",
]
