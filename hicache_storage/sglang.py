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
  run for MLA, one per layer and half for layer-first). A pool that cannot describe a page as runs
  moves whole flat pages; a pool without bytes (DeepSeek V4's logical anchor) moves nothing.
* **Every pool SGLang registers**, each keyed under its own dtype and page geometry, replicated or
  TP-sharded as SGLang holds it (see :class:`PoolBinding`).
* **Per-key results and typed errors** from the connector; a store that is down (an error whose
  status is temporary, or persistent once a retry layer gave up) degrades to misses and logged
  warnings instead of killing SGLang's I/O threads; a permanent error is raised.

This module imports SGLang; nothing else in ``hicache_storage`` does.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

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

from hicache_storage.buffers import RawBuffer
from hicache_storage.config import BackendConfig
from hicache_storage.errors import (
    ConfigError,
    ErrorStatus,
    InvalidArgumentError,
    StorageError,
    UnsupportedOperationError,
)
from hicache_storage.health import BreakerConfig, BreakerState, CircuitBreaker
from hicache_storage.keys import LAYOUTS, KeyScope, Namespace, PageKey, Shard, is_page_hash
from hicache_storage.multipool import HitPolicy, MultiPoolStore, PoolSpec
from hicache_storage.spec import StoreSpec, open_store, store_spec
from hicache_storage.store import Store

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Keys SGLang's own loader reads from the extra config, or removes from it before the backend
#: is built (SGLang 0.5.23: ``parse_storage_backend_extra_config``, ``_generate_storage_config``).
SGLANG_EXTRA_CONFIG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)

#: Keys SGLang 0.5.23 adds to the extra config itself, from its own flags: meant for its file
#: backend, meaningless to a connector. Accepted and ignored, with one log line.
SGLANG_ADDED_KEYS = {"file_storage_path": "--file-storage-path"}

#: Keys documented for SGLang's HiCache that SGLang 0.5.23 never reads: set, they would do
#: nothing, so each gets one warning.
SGLANG_UNREAD_KEYS = {
    "prefetch_timeout_max": "SGLang 0.5.23 bounds a prefetch by prefetch_timeout_base + "
    "prefetch_timeout_per_ki_token only; it has no maximum",
}


class AdapterConfig(BackendConfig):
    """The adapter's part of ``--hicache-storage-backend-extra-config`` (SGLang's keys are ignored)."""

    connector: str = pydantic.Field(description="registered connector name (memory, file, redis, ...) or 'package.module:Class'")
    connector_config: dict[str, Any] = pydantic.Field(default_factory=dict, description="the connector's own config")
    layers: list[dict[str, Any]] | None = pydantic.Field(
        None, description='layer specs, innermost first, e.g. [{"kind": "integrity"}, {"kind": "timeout", "seconds": 2}]'
    )
    tenant: str | None = pydantic.Field(None, description="cache salt: deployments with different tenants never share pages")
    model_revision: str | None = pydantic.Field(None, description="model weights revision (commit or tag); part of every key")
    model: str | None = pydantic.Field(None, description="model identity for keys; defaults to SGLang's model name")
    breaker: dict[str, float] = pydantic.Field(
        default_factory=dict,
        description="store health: failures_to_open, probe_backoff_s, probe_backoff_max_s (hicache_storage.health.BreakerConfig)",
    )

    @classmethod
    def from_extra_config(cls, extra_config: dict[str, Any] | None) -> AdapterConfig:
        given = dict(extra_config or {})
        for key, flag in SGLANG_ADDED_KEYS.items():
            if key in given:
                logger.info("hicache_storage: ignoring %r, which SGLang adds for its own file backend (%s)", key, flag)
        for key, why in SGLANG_UNREAD_KEYS.items():
            if key in given:
                logger.warning("hicache_storage: %r in the extra config has no effect: %s", key, why)
        ignored = SGLANG_EXTRA_CONFIG_KEYS | SGLANG_ADDED_KEYS.keys() | SGLANG_UNREAD_KEYS.keys()
        ours = {k: v for k, v in given.items() if k not in ignored}
        if "wrappers" in ours:
            from hicache_storage.deprecation import warn_renamed

            if "layers" in ours:
                raise ConfigError("'wrappers' is the old name of 'layers': give 'layers' only", field="wrappers", backend="sglang-adapter")
            warn_renamed("the extra-config key 'wrappers'", "'layers'", stacklevel=2)
            ours["layers"] = ours.pop("wrappers")
        if "connector" not in ours:
            raise ConfigError(
                "the hicache_storage adapter needs 'connector' in --hicache-storage-backend-extra-config "
                '(e.g. "connector": "file", "connector_config": {"root": "/mnt/nvme/kv"})',
                field="connector",
                backend="sglang-adapter",
            )
        return cls.parse(ours, backend="sglang-adapter")

    def store_spec(self) -> StoreSpec:
        """The store this adapter opens: the connector, its config and its layers."""
        return store_spec(self.connector, self.connector_config, self.layers)


class PageIO(str, enum.Enum):
    """How one host pool's pages move between the pool and the store."""

    #: the pool holds no bytes of its own (DeepSeek V4's KV anchor: its side pools carry the
    #: data); its pages are present exactly when the pools that carry them are.
    LOGICAL = "logical"
    #: zero-copy: the store reads and writes the (address, size) runs ``get_page_buffer_meta`` gives.
    SEGMENTS = "segments"
    #: the pool cannot describe a page as runs (a DSA indexer on ``layer_first``, Mamba state with
    #: slot side state): a page moves as one flat copy (``get_data_page`` / ``set_from_flat_data_page``).
    FLAT = "flat"


@dataclass(frozen=True)
class PoolBinding:
    """One registered host pool as the adapter stores it: how its pages move, and the key scope
    of each value a page is stored as (one, or one per head group when TP sizes share pages)."""

    name: str
    pool: Any
    io: PageIO
    scopes: tuple[KeyScope, ...]
    #: whether this rank stores this pool's pages (every rank its own shard, one rank a replicated one)
    writes: bool
    #: heads of a page split into this many groups, each its own value (``get_split_heads_page_buffer_meta``)
    head_groups: int = 1

    @property
    def namespaces(self) -> set[Namespace]:
        return {scope.namespace for scope in self.scopes}

    def keys(self, hashes: Sequence[str]) -> list[PageKey]:
        """Each page's keys, page by page (a page's head groups next to each other)."""
        return [scope.key(h) for h in hashes for scope in self.scopes]


class HiCacheStorageAdapter(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` over a hicache-storage connector.

    Thread-safety: SGLang calls from its prefetch and backup threads at once; pools are bound at
    registration (on SGLang's scheduler thread, before I/O on them) and only read afterwards, and
    connectors are thread-safe by contract.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        """Called by SGLang's dynamic loader as ``cls(storage_config, kwargs)``; ``kwargs`` is unused."""
        self.storage_config = storage_config
        self.config = AdapterConfig.from_extra_config(storage_config.extra_config)
        if storage_config.dcp_size > 1:
            raise ConfigError(
                f"decode context parallelism (dcp_size={storage_config.dcp_size}) is not supported by the "
                "hicache_storage adapter: keys have no DCP axis (SGLang 0.5.23 itself allows only its file and "
                "Mooncake backends with DCP). Run without DCP.",
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
        # The TP-sharded identity of this rank; pools whose bytes are the same on every TP rank
        # (MLA KV and its side pools) use it with replicated=True (keys carry no TP rank).
        self.tp_shard = Shard(
            tp_rank=storage_config.tp_rank,
            tp_size=storage_config.tp_size,
            pp_rank=storage_config.pp_rank,
            pp_size=storage_config.pp_size,
            cp_rank=storage_config.attn_cp_rank,
            cp_size=storage_config.attn_cp_size,
        )
        self.rank_replicated = bool(storage_config.is_mla_model)
        #: Whether this rank writes the replicated pools. SGLang's rule is one writer, TP rank 0;
        #: under attention CP each CP rank holds its own slice of every page (keyed per CP rank),
        #: so the first attention-TP rank of each CP rank writes (see :func:`_writes_replicated`).
        self.is_writer = _writes_replicated(storage_config)
        #: SGLang's own switch (``interface_v1``): KV pages move zero-copy through batch_get_v1 /
        #: batch_set_v1, or as flat page tensors through batch_get / batch_set.
        self.zero_copy = bool((storage_config.extra_config or {}).get("interface_v1", 0))
        self.store: Store = open_store(self.config.store_spec())
        self.bindings: dict[str, PoolBinding] = {}
        self._lock = threading.Lock()
        self._metrics_enabled = bool(storage_config.enable_storage_metrics)
        self._metrics_lock = threading.Lock()
        #: The store's health (see :mod:`hicache_storage.health`): consecutive timeouts or temporary
        #: errors stop data calls until a probe answers.
        try:
            options: dict[str, Any] = dict(self.config.breaker)  # checked by BreakerConfig itself
            breaker_config = BreakerConfig(**options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"bad 'breaker' in the extra config ({exc}); its keys are failures_to_open, probe_backoff_s, probe_backoff_max_s",
                field="breaker",
                backend="sglang-adapter",
            ) from exc
        self.breaker = CircuitBreaker(self.config.connector, self._probe, breaker_config, on_transition=self._count_transition)
        #: Breaker transitions and the data calls skipped while it was open, by operation.
        self.health_counts: collections.Counter[str] = collections.Counter()
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }

    # --- registration -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind the KV (anchor) pool: its page identity (dtype, page size, layout, geometry) and memory."""
        super().register_mem_pool_host(mem_pool_host)
        self._bind(PoolName.KV.value, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Bind a side pool (SWA, Mamba, indexer, draft, DeepSeek V4's compressed pools...)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == PoolName.KV.value and host_pool is getattr(self, "mem_pool_host", None):
            return
        self._bind(name, host_pool)

    def _bind(self, name: str, pool: Any) -> None:
        layout = getattr(pool, "layout", None)
        if layout not in LAYOUTS:
            raise ConfigError(
                f"host pool {name!r} has layout {layout!r}, which the hicache_storage adapter does not store; "
                f"use --hicache-mem-layout with one of {', '.join(LAYOUTS)}",
                field="layout",
                backend="sglang-adapter",
            )
        io = _page_io(pool, name)
        if name == PoolName.KV.value and io is PageIO.SEGMENTS and not self.zero_copy:
            io = PageIO.FLAT  # SGLang moves KV pages through batch_get/batch_set as flat pages
        head_groups = 1
        shard = self.tp_shard
        if _is_replicated(pool, name, self.rank_replicated):
            shard = replace(shard, replicated=True)
        elif name == PoolName.KV.value and self.storage_config.should_split_heads:
            # Heterogeneous TP (tp_lcm_size): each group of heads is a value keyed as the rank of a
            # TP-lcm deployment that holds exactly those heads, so TP4 and TP8 share pages.
            head_groups = self.storage_config.tp_lcm_size // self.storage_config.tp_size
        namespace = Namespace(
            model=self.model,
            kv_dtype=_format_name(pool),
            page_size=pool.page_size,
            layout=layout,
            revision=self.config.model_revision,
            tenant=self.config.tenant,
            geometry=None if io is PageIO.LOGICAL else _geometry(pool, io, head_groups),
        )
        if head_groups > 1:
            lcm = self.storage_config.tp_lcm_size
            scopes = tuple(
                KeyScope(namespace, replace(shard, tp_rank=shard.tp_rank * head_groups + g, tp_size=lcm), name)
                for g in range(head_groups)
            )
        else:
            scopes = (KeyScope(namespace, shard, name),)
        binding = PoolBinding(name, pool, io, scopes, self.is_writer or not shard.replicated, head_groups)
        with self._lock:
            self.bindings[name] = binding
        if binding.io is PageIO.FLAT:
            logger.info("hicache_storage: pool %r (%s) moves whole flat pages: it cannot describe a page as runs", name, type(pool).__name__)
        self._keep_sglang_backing_up(binding)
        if io is not PageIO.LOGICAL:
            self._register_memory(pool)

    def _keep_sglang_backing_up(self, binding: PoolBinding) -> None:
        """Make SGLang call this rank's backups when this rank writes a pool SGLang would not back up here.

        SGLang 0.5.23 skips every storage backup on MLA TP ranks other than 0
        (``HiCacheController.backup_skip``) except Mamba state, and backs up an MHA draft there only
        for its own Mooncake backend (``HybridCacheController.should_backup``). Two kinds of pool
        need those backups: a TP-sharded pool of an MLA deployment (an EAGLE draft, MHA, on an MLA
        target: without them its draft heads never reach storage), and under attention CP the MLA
        KV of every CP rank (each holds its own slice of every page: without them no CP rank
        above 0 ever stores its slice, and since the ranks agree on the smallest hit, no rank
        ever restores from L3). SGLang reads ``storage_config.is_mla_model`` only for that
        decision, so the adapter clears it; it keeps its own copy and skips the writes of
        replicated pools on ranks that do not write them itself.
        """
        if binding.writes and not self.storage_config.is_storage_writer and binding.name != PoolName.MAMBA.value:
            logger.info(
                "hicache_storage: pool %r is written by TP rank %d (%s); SGLang is told to back it up there "
                "(replicated pools are still written by one rank %s)",
                binding.name,
                self.storage_config.tp_rank,
                "its own attention-CP slice" if binding.scopes[0].shard.replicated else "TP-sharded",
                "per attention-CP rank" if self.storage_config.attn_cp_size > 1 else "(TP rank 0)",
            )
            self.storage_config.is_mla_model = False

    def _register_memory(self, pool: Any) -> None:
        buffer = getattr(pool, "kv_buffer", None)
        for tensor in buffer if isinstance(buffer, (list, tuple)) else [buffer]:
            if isinstance(tensor, torch.Tensor) and tensor.numel() > 0:
                self.store.register_buffer(tensor)

    def _binding(self, name: Any) -> PoolBinding:
        binding = self.bindings.get(str(name))
        if binding is None:
            if str(name) == PoolName.KV.value:
                raise InvalidArgumentError("register_mem_pool_host() must be called before any storage I/O")
            raise InvalidArgumentError(f"no host pool registered under {str(name)!r}; SGLang registers pools before I/O")
        return binding

    @property
    def scope(self) -> KeyScope:
        """The KV pool's key scope (its first head group's when heads are split)."""
        return self._binding(PoolName.KV.value).scopes[0]

    # --- zero-copy path (interface_v1) --------------------------------------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Read pages straight into the host pool; one result per key (SGLang uses the leading run)."""
        return self._pool_get(self._binding(PoolName.KV.value), keys, host_indices)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Write pages straight from the host pool. A rank that does not write a pool reports success."""
        return self._pool_set(self._binding(PoolName.KV.value), keys, host_indices)

    def _pool_get(self, binding: PoolBinding, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        if not keys:
            return []
        if binding.io is PageIO.LOGICAL:
            return [True] * len(keys)
        page_keys = binding.keys([page_hash_of(key) for key in keys])
        if binding.io is PageIO.FLAT:
            targets = [binding.pool.get_dummy_flat_data_page() for _ in keys]
            nbytes = sum(_nbytes(page) for page in targets)
        else:
            targets, nbytes = _page_segments(binding, len(keys), host_indices)
        start = time.perf_counter()
        hits = self._guarded("get", f"read of {len(keys)} pages of pool {binding.name}", None, lambda: self.store.get_into(page_keys, targets))
        if hits is None:
            return [False] * len(keys)
        if binding.io is PageIO.FLAT:
            for i, hit in enumerate(hits):
                if not hit:
                    break
                binding.pool.set_from_flat_data_page(int(host_indices[i * binding.pool.page_size]), targets[i])
        self._record("prefetch", len(keys), nbytes, time.perf_counter() - start)
        return _per_page(hits, binding.head_groups)

    def _pool_set(self, binding: PoolBinding, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        if not keys:
            return []
        if binding.io is PageIO.LOGICAL or not binding.writes:
            return [True] * len(keys)
        page_keys = binding.keys([page_hash_of(key) for key in keys])
        what = f"write of {len(keys)} pages of pool {binding.name}"
        start = time.perf_counter()
        # Keys are content hashes of the prefix: a value already stored holds these bytes.
        stored = self._guarded("exists", what, None, lambda: self.store.exists(page_keys))
        if stored is None:
            return [False] * len(keys)
        todo = [i for i, hit in enumerate(stored) if not hit]
        if todo:
            sources = _page_sources(binding, len(keys), host_indices, {i // binding.head_groups for i in todo})
            written = self._guarded("put", what, None, lambda: self.store.put_from([page_keys[i] for i in todo], [sources[i] for i in todo]))
            if written is None:
                return [False] * len(keys)
            for i, ok in zip(todo, written):
                stored[i] = ok
            self._record("backup", len(todo), sum(_nbytes(sources[i]) for i in todo), time.perf_counter() - start)
        return _per_page(stored, binding.head_groups)

    # --- lookups ------------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many keys, from the first, are stored without a gap (a prefix length, not a count).

        A pool without bytes of its own (a logical anchor) has nothing to check without its side
        pools: SGLang asks those through :meth:`batch_exists_v2`; alone it answers 0.
        """
        binding = self._binding(PoolName.KV.value)
        if binding.io is PageIO.LOGICAL:
            return 0
        hashes = [page_hash_of(key) for key in keys]
        return self._guarded("exists", f"exists query of {len(keys)} pages", 0, lambda: self._prefix(binding, hashes))

    def _prefix(self, binding: PoolBinding, hashes: list[str]) -> int:
        if binding.head_groups == 1:
            return self.store.prefix_exists(binding.keys(hashes))
        return min(self.store.prefix_exists(scope.keys(hashes)) for scope in binding.scopes)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- legacy copy path (interface_v1 off): flat page tensors -------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Read one page into ``target_location`` (a flat host tensor, or a fresh one); ``None`` on a miss."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[torch.Tensor | None]:
        if not keys:
            return []
        binding = self._binding(PoolName.KV.value)
        if target_locations is None:
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        page_keys, targets = binding.keys([page_hash_of(key) for key in keys]), list(target_locations)
        start = time.perf_counter()
        hits = self._guarded("get", f"read of {len(keys)} pages", None, lambda: self.store.get_into(page_keys, targets))
        if hits is None:
            return [None] * len(keys)
        self._record("prefetch", len(keys), sum(_nbytes(t) for t in target_locations), time.perf_counter() - start)
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
        binding = self._binding(PoolName.KV.value)
        if not binding.writes:
            return True
        if values is None:
            raise InvalidArgumentError("batch_set() needs one page tensor per key")
        values, page_keys = list(values), binding.keys([page_hash_of(key) for key in keys])
        start = time.perf_counter()
        written = self._guarded("put", f"write of {len(keys)} pages", None, lambda: self.store.put_from(page_keys, values))
        if written is None:
            return False
        self._record("backup", len(keys), sum(_nbytes(v) for v in values), time.perf_counter() - start)
        return all(written)

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
        and is not 0. A logical KV anchor (DeepSeek V4) does not vote: its side pools decide. A
        failed query answers nothing restorable, unless its error is permanent (then it raises).
        """
        hashes = [page_hash_of(key) for key in keys]
        kv = self._binding(PoolName.KV.value)
        pools: list[PoolSpec] = []
        if kv.io is not PageIO.LOGICAL:
            for g, scope in enumerate(kv.scopes):
                pools.append(PoolSpec(PoolName.KV.value if g == 0 else f"kv_heads{g}", scope=scope))
        for transfer in pool_transfers or []:
            name = str(transfer.name)
            if name == PoolName.KV.value:
                continue  # the KV pool is always asked, over every key
            binding = self._binding(name)
            if binding.io is PageIO.LOGICAL:
                continue
            pools.append(replace(_pool_spec(transfer), scope=binding.scopes[0]))
        if not any(spec.hit_policy is HitPolicy.ALL_PAGES for spec in pools):
            # Nothing holds every page of the prefix (a logical anchor and trailing pools only):
            # nothing proves the head of the prefix is restorable.
            return PoolTransferResult(0, {}, [])
        store = MultiPoolStore(self.store, pools[0].scope or kv.scopes[0], pools)
        found = self._guarded("exists", f"exists query of {len(keys)} pages", None, lambda: store.lookup(hashes))
        if found is None:
            return PoolTransferResult(0, {}, [])
        hits = {name: pages for name, pages in found.pool_hits.items() if pages and not name.startswith("kv_heads")}
        return PoolTransferResult(found.longest, hits, list(found.cuts))

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {str(t.name): self._pool_get(self._binding(t.name), t.keys or [], t.host_indices) for t in transfers}

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {str(t.name): self._pool_set(self._binding(t.name), t.keys or [], t.host_indices) for t in transfers}

    # --- store health -------------------------------------------------------------------------

    def _guarded(self, operation: str, what: str, unhealthy: T, call: Callable[[], T]) -> T:
        """``call()``, through the store's breaker: while it is open, ``unhealthy`` at once (a
        lookup finds nothing, a read misses, a write is skipped: SGLang recomputes); a timeout or
        temporary error is logged, counted by the breaker and answered with ``unhealthy``; a
        permanent one raises (SGLang's I/O threads log it)."""
        if not self.breaker.allows_call():
            with self._metrics_lock:
                self.health_counts[f"skipped_{operation}"] += 1
            return unhealthy
        try:
            result = call()
        except StorageError as exc:
            if exc.status is ErrorStatus.PERMANENT:
                raise
            self.breaker.record_failure(operation, exc)
            logger.warning("hicache_storage: %s failed, answered as if nothing were stored: %s", what, exc)
            return unhealthy
        self.breaker.record_success(operation)
        return result

    def _probe(self) -> None:
        """One cheap call that answers when the store does: an exists of one key."""
        self.store.exists([self.scope.key("0" * 64)])

    def _count_transition(self, old: BreakerState, new: BreakerState) -> None:
        with self._metrics_lock:
            self.health_counts["breaker_opened" if new is BreakerState.OPEN else "breaker_closed"] += 1

    # --- housekeeping -------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove this deployment's pages (the namespace of every registered pool, every shard) and nothing else."""
        with self._lock:
            namespaces = set().union(*(binding.namespaces for binding in self.bindings.values()))
        for namespace in namespaces:
            self.store.clear(namespace)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages per batch, GB/s); reset on read."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._metrics_lock:
            snapshot = {name: list(values) for name, values in self._metrics.items()}
            for values in self._metrics.values():
                values.clear()
        return StorageMetrics(**snapshot)

    def close(self) -> None:
        self.breaker.close()
        self.store.close()

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


def _page_io(pool: Any, name: str) -> PageIO:
    """How ``pool``'s pages move: decided once, at registration, by asking the pool to describe page 0.

    A pool whose page is neither runs nor a non-empty flat page holds no bytes of its own
    (DeepSeek V4's ``LogicalHostPool``, an MLA host pool built allocator-only).
    """
    if getattr(pool, "_is_dummy", False):
        return PageIO.LOGICAL
    try:
        meta = pool.get_page_buffer_meta(torch.arange(pool.page_size, dtype=torch.int64))
    except (NotImplementedError, ValueError, AssertionError, AttributeError) as exc:
        logger.debug("hicache_storage: pool %r cannot describe a page as runs (%s)", name, exc)
        meta = None
    if meta and len(meta[0]) and len(meta[0]) == len(meta[1]):
        return PageIO.SEGMENTS
    flat = pool.get_dummy_flat_data_page() if hasattr(pool, "get_dummy_flat_data_page") else None
    return PageIO.FLAT if flat is not None and _nbytes(flat) else PageIO.LOGICAL


def _writes_replicated(config: HiCacheStorageConfig) -> bool:
    """Whether this rank writes pools whose bytes are the same on every rank that shares its key.

    SGLang's rule (``HiCacheStorageConfig.is_storage_writer``): every rank when the KV is
    TP-sharded, TP rank 0 when it is replicated (MLA). Under attention CP the replicated KV is
    the same only within one CP rank's attention-TP group: ``tp_size`` is then
    ``attn_tp_size * attn_cp_size`` (SGLang passes the attention-TP rank and size instead under
    DP attention, where this rule makes every rank a writer: ranks of one attention-TP group then
    write the same bytes under the same key, which the write's exists check mostly skips).
    """
    if not config.is_mla_model or config.attn_cp_size <= 1:
        return bool(config.is_storage_writer)
    attn_tp_size = max(1, config.tp_size // config.attn_cp_size)
    return config.tp_rank % attn_tp_size == 0


def _is_replicated(pool: Any, name: str, rank_replicated: bool) -> bool:
    """Whether ``pool`` holds the same bytes on every TP rank.

    On an MLA (rank-replicated) deployment every pool is, except what SGLang shards by TP rank
    there: Mamba state, and a pool of SGLang's MHA class (an EAGLE draft on an MLA target, an MHA
    sliding-window pool).
    """
    if not rank_replicated or name == PoolName.MAMBA.value:
        return False
    return not any(cls.__name__ == "MHATokenToKVPoolHost" for cls in type(pool).__mro__)


def _geometry(pool: Any, io: PageIO, head_groups: int) -> str:
    """The shape of one stored value of ``pool``: its layer count (draft layers packed in
    included) and byte size, and ``flat`` when pages move as flat copies (their byte order is
    the pool's ``get_data_page``, not its runs)."""
    layers = getattr(pool, "layer_num", None)
    if io is PageIO.FLAT:
        nbytes, kind = _nbytes(pool.get_dummy_flat_data_page()), ",flat"
    else:
        indices = torch.arange(pool.page_size, dtype=torch.int64)
        _, sizes = (
            pool.get_split_heads_page_buffer_meta(indices, head_groups) if head_groups > 1 else pool.get_page_buffer_meta(indices)
        )
        nbytes, kind = sum(int(size) for size in sizes) // head_groups, ""
    return f"layers={layers},bytes={nbytes}{kind}"


def _nbytes(value: Any) -> int:
    """Bytes in a page value: a tensor, or a list of (address, size) runs."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(segment.size for segment in value)


def _per_page(results: list[bool], head_groups: int) -> list[bool]:
    """One result per page from one per stored value (a page is stored when all its head groups are)."""
    if head_groups == 1:
        return list(results)
    return [all(results[i : i + head_groups]) for i in range(0, len(results), head_groups)]


def _page_sources(binding: PoolBinding, pages: int, host_indices: torch.Tensor, needed: set[int]) -> list[Any]:
    """What each value of ``pages`` pages is written from: its runs, or for a FLAT pool a flat copy
    of the page (made only for the ``needed`` pages; the others are ``None``)."""
    if binding.io is PageIO.SEGMENTS:
        return _page_segments(binding, pages, host_indices)[0]
    _check_indices(binding.pool, pages, host_indices)
    page_size = binding.pool.page_size
    return [
        binding.pool.get_data_page(int(host_indices[p * page_size]), flat=True).contiguous() if p in needed else None
        for p in range(pages)
    ]


def _check_indices(pool: Any, pages: int, host_indices: torch.Tensor | None) -> None:
    page_size = pool.page_size
    if host_indices is None or host_indices.numel() != pages * page_size:
        got = 0 if host_indices is None else host_indices.numel()
        raise InvalidArgumentError(f"{pages} keys need {pages * page_size} host indices (page_size={page_size}), got {got}")


def _page_segments(binding: PoolBinding, pages: int, host_indices: torch.Tensor) -> tuple[list[list[RawBuffer]], int]:
    """Each value's (address, size) runs in the host pool, from its ``get_page_buffer_meta``
    (``get_split_heads_page_buffer_meta`` when a page is stored as head groups)."""
    pool = binding.pool
    _check_indices(pool, pages, host_indices)
    if binding.head_groups > 1:
        ptrs, sizes = pool.get_split_heads_page_buffer_meta(host_indices, binding.head_groups)
    else:
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    values = pages * binding.head_groups
    if len(ptrs) != len(sizes) or len(ptrs) % values:
        raise InvalidArgumentError(
            f"host pool {binding.name!r} returned {len(ptrs)} addresses and {len(sizes)} sizes for {values} values; "
            "expected the same whole number of segments per value"
        )
    per_value = len(ptrs) // values
    segments = [
        [RawBuffer(int(ptrs[i]), int(sizes[i])) for i in range(v * per_value, (v + 1) * per_value)] for v in range(values)
    ]
    return segments, sum(int(size) for size in sizes)
