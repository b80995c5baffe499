"""Any hicache-storage connector as an SGLang HiCache storage backend.

SGLang builds this class through its ``dynamic`` loader::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "hicache", "module_path":
            "hicache_storage.sglang", "class_name": "HiCacheStorageAdapter", "interface_v1": 1,
            "connector": "redis", "connector_config": {"url": "redis://127.0.0.1:6379"}}'

What it adds over SGLang's built-in backends:

* **Keys carry the whole identity.** SGLang's page hash becomes a :class:`~hicache_storage.keys.PageKey`
  whose namespace holds the model name, ``model_revision``, the host pool's KV dtype, page size and
  layout, and ``tenant``; its shard holds TP / PP / attention-CP rank and size (TP left out for
  MLA, whose KV is identical on every TP rank). Two deployments that differ in any of these never
  read each other's bytes.
* **Zero-copy pages.** ``batch_get_v1`` / ``batch_set_v1`` turn the host pool's
  ``get_page_buffer_meta`` (address, size) pairs into :class:`~hicache_storage.buffers.RawBuffer`
  segments: one page is one value made of its segments (K and V halves for MHA page-first, one
  run for MLA, one per layer and half for layer-first).
* **Per-key results and typed errors** from the connector; a store that is down (an error whose
  status is temporary, or persistent once a retry layer gave up) degrades to misses and logged
  warnings instead of killing SGLang's I/O threads; a permanent error is raised.

This module imports SGLang; nothing else in ``hicache_storage`` does.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pydantic
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from hicache_storage.backend import StorageBackend
from hicache_storage.buffers import RawBuffer
from hicache_storage.config import BackendConfig
from hicache_storage.errors import (
    ConfigError,
    ErrorStatus,
    InvalidArgumentError,
    StorageError,
    UnsupportedOperationError,
)
from hicache_storage.keys import LAYOUTS, KeyScope, Namespace, PageKey, Shard, is_page_hash
from hicache_storage.multipool import HitPolicy, MultiPoolStore, PoolSpec
from hicache_storage.spec import StoreSpec, open_store, store_spec

logger = logging.getLogger(__name__)

#: Extra-config keys SGLang itself reads (some are popped before the backend sees the dict).
SGLANG_EXTRA_CONFIG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "prefetch_timeout_max",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)


class AdapterConfig(BackendConfig):
    """The adapter's part of ``--hicache-storage-backend-extra-config`` (SGLang's keys are ignored)."""

    connector: str = pydantic.Field(description="registered connector name (memory, file, redis, ...) or 'package.module:Class'")
    connector_config: dict[str, Any] = pydantic.Field(default_factory=dict, description="the connector's own config")
    wrappers: list[dict[str, Any]] | None = pydantic.Field(
        None, description='wrapper specs, innermost first, e.g. [{"kind": "integrity"}, {"kind": "timeout", "seconds": 2}]'
    )
    tenant: str | None = pydantic.Field(None, description="cache salt: deployments with different tenants never share pages")
    model_revision: str | None = pydantic.Field(None, description="model weights revision (commit or tag); part of every key")
    model: str | None = pydantic.Field(None, description="model identity for keys; defaults to SGLang's model name")

    @classmethod
    def from_extra_config(cls, extra_config: dict[str, Any] | None) -> AdapterConfig:
        ours = {k: v for k, v in (extra_config or {}).items() if k not in SGLANG_EXTRA_CONFIG_KEYS}
        if "connector" not in ours:
            raise ConfigError(
                "the hicache_storage adapter needs 'connector' in --hicache-storage-backend-extra-config "
                '(e.g. "connector": "file", "connector_config": {"root": "/mnt/nvme/kv"})',
                field="connector",
                backend="sglang-adapter",
            )
        return cls.parse(ours, backend="sglang-adapter")

    def store_spec(self) -> StoreSpec:
        """The store this adapter opens: the connector, its config and the wrappers as its layers."""
        return store_spec(self.connector, self.connector_config, self.wrappers)


class HiCacheStorageAdapter(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` over a hicache-storage connector.

    Thread-safety: SGLang calls from its prefetch and backup threads at once; every method here
    only reads state fixed at registration, and connectors are thread-safe by contract.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        """Called by SGLang's dynamic loader as ``cls(storage_config, kwargs)``; ``kwargs`` is unused."""
        self.storage_config = storage_config
        self.config = AdapterConfig.from_extra_config(storage_config.extra_config)
        if storage_config.dcp_size > 1:
            raise ConfigError(
                f"decode context parallelism (dcp_size={storage_config.dcp_size}) is not supported by the "
                "hicache_storage adapter yet: keys have no DCP axis. Run without DCP or use SGLang's file backend.",
                backend="sglang-adapter",
            )
        if storage_config.should_split_heads:
            raise ConfigError(
                "tp_lcm_size (heterogeneous TP head splitting) is not supported by the hicache_storage adapter; "
                "drop tp_lcm_size from the extra config",
                field="tp_lcm_size",
                backend="sglang-adapter",
            )
        model = self.config.model or storage_config.model_name
        if not model:
            raise ConfigError(
                "SGLang passed no model name; set \"model\" in the extra config so keys name the model",
                field="model",
                backend="sglang-adapter",
            )
        self.model = model
        # The TP-sharded identity of this rank, and the one its KV keys use: MLA KV is the same on
        # every TP rank, so its shard is replicated (keys carry no TP rank).
        self.tp_shard = Shard(
            tp_rank=storage_config.tp_rank,
            tp_size=storage_config.tp_size,
            pp_rank=storage_config.pp_rank,
            pp_size=storage_config.pp_size,
            cp_rank=storage_config.attn_cp_rank,
            cp_size=storage_config.attn_cp_size,
        )
        self.shard = replace(self.tp_shard, replicated=storage_config.is_mla_model)
        #: SGLang's own rule: MLA ranks share one writer (TP rank 0), MHA ranks all write.
        self.is_writer = bool(storage_config.is_storage_writer)
        self.backend: StorageBackend = open_store(self.config.store_spec())
        self.namespace: Namespace | None = None
        self.scope: KeyScope | None = None
        self._pool_scopes: dict[str, KeyScope] = {}
        self._metrics_enabled = bool(storage_config.enable_storage_metrics)
        self._metrics_lock = threading.Lock()
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }

    # --- registration -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the page identity (dtype, page size, layout) and register the pool's memory."""
        super().register_mem_pool_host(mem_pool_host)
        layout = mem_pool_host.layout
        if layout not in LAYOUTS:
            raise ConfigError(
                f"host pool layout {layout!r} is not supported by the hicache_storage adapter; "
                f"use --hicache-mem-layout with one of {', '.join(LAYOUTS)}",
                field="layout",
                backend="sglang-adapter",
            )
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            raise ConfigError(
                f"{type(mem_pool_host).__name__} has no KV buffer of its own (a logical anchor, as in DeepSeek V4); "
                "the hicache_storage adapter needs a host pool that holds the KV pages",
                backend="sglang-adapter",
            )
        self.namespace = Namespace(
            model=self.model,
            kv_dtype=_format_name(mem_pool_host),
            page_size=mem_pool_host.page_size,
            layout=layout,
            revision=self.config.model_revision,
            tenant=self.config.tenant,
        )
        self.scope = KeyScope(self.namespace, self.shard, PoolName.KV.value)
        self._pool_scopes = {PoolName.KV.value: self.scope}
        self._register_memory(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._register_memory(host_pool)

    def _register_memory(self, pool: Any) -> None:
        buffer = getattr(pool, "kv_buffer", None)
        for tensor in buffer if isinstance(buffer, (list, tuple)) else [buffer]:
            if isinstance(tensor, torch.Tensor) and tensor.numel() > 0:
                self.backend.register_buffer(tensor)

    # --- keys ---------------------------------------------------------------------------------

    def _scope_for(self, pool_name: Any) -> KeyScope:
        name = str(pool_name)
        scope = self._pool_scopes.get(name)
        if scope is not None:
            return scope
        anchor = self._require_scope()
        pool = getattr(self, "registered_pools", {}).get(pool_name)
        if pool is None:
            raise InvalidArgumentError(f"no host pool registered under {name!r}; SGLang registers pools before I/O")
        # Mamba state is TP-sharded even when the model's MLA KV is replicated.
        shard = self.tp_shard if name == PoolName.MAMBA.value else self.shard
        namespace = replace(anchor.namespace, kv_dtype=_format_name(pool))
        scope = KeyScope(namespace, shard, name)
        self._pool_scopes[name] = scope
        return scope

    def _require_scope(self) -> KeyScope:
        if self.scope is None:
            raise InvalidArgumentError("register_mem_pool_host() must be called before any storage I/O")
        return self.scope

    def _writes(self, scope: KeyScope) -> bool:
        """Whether this rank stores pages of ``scope``: every rank its own shard, one rank a replicated one."""
        return self.is_writer or not scope.shard.replicated

    def _keys(self, keys: Sequence[str], scope: KeyScope | None = None) -> list[PageKey]:
        scope = scope or self._require_scope()
        return [scope.key(page_hash_of(key)) for key in keys]

    # --- zero-copy path (interface_v1) --------------------------------------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Read pages straight into the host pool; one result per key (SGLang uses the leading run)."""
        return self._pool_get(self.mem_pool_host, self._require_scope(), keys, host_indices)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Write pages straight from the host pool. Non-writer MLA ranks report success and write nothing."""
        return self._pool_set(self.mem_pool_host, self._require_scope(), keys, host_indices)

    def _pool_get(self, pool: Any, scope: KeyScope, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        if not keys:
            return []
        page_keys = self._keys(keys, scope)
        targets, nbytes = _page_segments(pool, len(keys), host_indices)
        start = time.perf_counter()
        try:
            results = self.backend.get_into(page_keys, targets)
        except StorageError as exc:
            if exc.status is ErrorStatus.PERMANENT:
                raise
            logger.warning("hicache_storage: read of %d pages failed, treated as misses: %s", len(keys), exc)
            return [False] * len(keys)
        self._record("prefetch", len(keys), nbytes, time.perf_counter() - start)
        return results

    def _pool_set(self, pool: Any, scope: KeyScope, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        if not keys:
            return []
        if not self._writes(scope):
            return [True] * len(keys)
        page_keys = self._keys(keys, scope)
        sources, _ = _page_segments(pool, len(keys), host_indices)
        start = time.perf_counter()
        try:
            # Keys are content hashes of the prefix: a page already stored holds these bytes.
            stored = self.backend.exists(page_keys)
            todo = [i for i, hit in enumerate(stored) if not hit]
            written = self.backend.put_from([page_keys[i] for i in todo], [sources[i] for i in todo]) if todo else []
        except StorageError as exc:
            if exc.status is ErrorStatus.PERMANENT:
                raise
            logger.warning("hicache_storage: write of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        for i, ok in zip(todo, written):
            stored[i] = ok
        if todo:
            page_bytes = sum(segment.size for segment in sources[0])
            self._record("backup", len(todo), page_bytes * len(todo), time.perf_counter() - start)
        return stored

    # --- lookups ------------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many keys, from the first, are stored without a gap (a prefix length, not a count)."""
        try:
            return self.backend.prefix_exists(self._keys(keys))
        except StorageError as exc:
            if exc.status is ErrorStatus.PERMANENT:
                raise
            logger.warning("hicache_storage: exists query failed, reporting no hit: %s", exc)
            return 0

    def exists(self, key: str) -> bool:
        try:
            return self.backend.exists(self._keys([key]))[0]
        except StorageError as exc:
            if exc.status is ErrorStatus.PERMANENT:
                raise
            logger.warning("hicache_storage: exists query failed, reporting a miss: %s", exc)
            return False

    # --- legacy copy path (interface_v1 off): flat page tensors -------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Read one page into ``target_location`` (a flat host tensor, or a fresh one); ``None`` on a miss."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[torch.Tensor | None]:
        if not keys:
            return []
        if target_locations is None:
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        try:
            hits = self.backend.get_into(self._keys(keys), list(target_locations))
        except StorageError as exc:
            if exc.status is ErrorStatus.PERMANENT:
                raise
            logger.warning("hicache_storage: read of %d pages failed, treated as misses: %s", len(keys), exc)
            return [None] * len(keys)
        return [target if hit else None for target, hit in zip(target_locations, hits)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one page given as a flat tensor, or as address/size lists (``target_location``/``target_sizes``)."""
        if value is None:
            if target_location is None or target_sizes is None:
                raise InvalidArgumentError("set() needs a page tensor, or target_location addresses with target_sizes")
            value = [RawBuffer(int(p), int(s)) for p, s in zip(target_location, target_sizes)]
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        """Store every page; ``True`` only if all are stored (SGLang's legacy contract)."""
        if not keys:
            return True
        if not self._writes(self._require_scope()):
            return True
        if values is None:
            raise InvalidArgumentError("batch_set() needs one page tensor per key")
        try:
            return all(self.backend.put_from(self._keys(keys), list(values)))
        except StorageError as exc:
            if exc.status is ErrorStatus.PERMANENT:
                raise
            logger.warning("hicache_storage: write of %d pages failed: %s", len(keys), exc)
            return False

    # --- pool transfers (v2: KV plus side pools such as mamba, swa, indexer) ------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The longest prefix every pool can restore, with SGLang's ``all_pages``/``trailing_pages`` policies.

        One :meth:`~hicache_storage.multipool.MultiPoolStore.lookup` over the KV pool and each
        transfer's pool, each under its own key scope (a trailing pool's window is the number of
        keys it transfers): the KV prefix bounds the answer, and ``restorable_prefix_pages`` lists
        every cut all pools accept, since a trailing pool may accept cut 5 but not 4. A pool's own
        hit is reported when the lookup knows it (see :class:`~hicache_storage.multipool.PoolCuts`)
        and is not 0. A failed query of a pool counts as that pool holding nothing, unless its
        error is permanent (then it raises).
        """
        kv = self._require_scope()
        pools = [PoolSpec(PoolName.KV.value, scope=kv)]
        # The KV pool is always asked over every key with all_pages; a KV transfer adds nothing.
        for transfer in pool_transfers or []:
            if str(transfer.name) != PoolName.KV.value:
                pools.append(replace(_pool_spec(transfer), scope=self._scope_for(transfer.name)))
        found = MultiPoolStore(self.backend, kv, pools).lookup([page_hash_of(key) for key in keys], degrade=True)
        hits = {name: pages for name, pages in found.pool_hits.items() if pages}
        return PoolTransferResult(found.longest, hits, list(found.cuts))

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {
            str(t.name): self._pool_get(self._pool(t.name), self._scope_for(t.name), t.keys or [], t.host_indices)
            for t in transfers
        }

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {
            str(t.name): self._pool_set(self._pool(t.name), self._scope_for(t.name), t.keys or [], t.host_indices)
            for t in transfers
        }

    def _pool(self, name: Any) -> Any:
        if str(name) == PoolName.KV.value:
            return self.mem_pool_host
        pools = getattr(self, "registered_pools", {})
        if name not in pools:
            raise InvalidArgumentError(f"no host pool registered under {str(name)!r}")
        return pools[name]

    # --- housekeeping -------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove this deployment's pages (its namespaces, every shard) and nothing else."""
        for namespace in {scope.namespace for scope in self._pool_scopes.values()}:
            self.backend.clear(namespace)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages per batch, GB/s); reset on read."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._metrics_lock:
            snapshot = {name: list(values) for name, values in self._metrics.items()}
            for values in self._metrics.values():
                values.clear()
        return StorageMetrics(**snapshot)

    def close(self) -> None:
        self.backend.close()

    def _record(self, direction: str, pages: int, nbytes: int, seconds: float) -> None:
        if not self._metrics_enabled:
            return
        with self._metrics_lock:
            self._metrics[f"{direction}_pgs"].append(pages)
            self._metrics[f"{direction}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)


def page_hash_of(key: str) -> str:
    """The page hash in a key SGLang passes: the key itself when it is a hex digest (as SGLang's
    are), else the SHA-256 of the string, so any key maps to one valid page hash."""
    if not isinstance(key, str):
        raise InvalidArgumentError(f"SGLang storage keys are strings, got {type(key).__name__}")
    return key if is_page_hash(key) else hashlib.sha256(key.encode()).hexdigest()


def _pool_spec(transfer: PoolTransfer) -> PoolSpec:
    """The hit policy of one of SGLang's pool transfers; a trailing window is the keys it transfers."""
    if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
        return PoolSpec(str(transfer.name), HitPolicy.ALL_PAGES)
    if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
        return PoolSpec(str(transfer.name), HitPolicy.TRAILING_PAGES, max(1, len(transfer.keys or ())))
    raise UnsupportedOperationError(
        f"pool hit policy {transfer.hit_policy!s} is not supported by the hicache_storage adapter",
        backend="sglang-adapter",
        operation="batch_exists_v2",
    )


def _format_name(pool: Any) -> str:
    """The byte format of a pool's pages: its dtype, plus SGLang's format tag when it has one."""
    dtype = getattr(pool, "dtype", None)
    name = str(dtype).removeprefix("torch.") if dtype is not None else type(pool).__name__
    tag = getattr(pool, "storage_format_tag", None)
    return f"{name}+{tag}" if tag else name


def _page_segments(pool: Any, pages: int, host_indices: torch.Tensor) -> tuple[list[list[RawBuffer]], int]:
    """Each page's (address, size) segments in the host pool, from its ``get_page_buffer_meta``."""
    page_size = pool.page_size
    if host_indices is None or host_indices.numel() != pages * page_size:
        got = 0 if host_indices is None else host_indices.numel()
        raise InvalidArgumentError(
            f"{pages} keys need {pages * page_size} host indices (page_size={page_size}), got {got}"
        )
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    if len(ptrs) != len(sizes) or len(ptrs) % pages:
        raise InvalidArgumentError(
            f"host pool returned {len(ptrs)} addresses and {len(sizes)} sizes for {pages} pages; "
            "expected the same whole number of segments per page"
        )
    per_page = len(ptrs) // pages
    segments = [
        [RawBuffer(int(ptrs[i]), int(sizes[i])) for i in range(p * per_page, (p + 1) * per_page)] for p in range(pages)
    ]
    return segments, sum(int(size) for size in sizes)
