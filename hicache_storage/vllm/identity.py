"""What a vLLM deployment's pages are called: the namespace, the shards, and the page hashes.

A page is one vLLM KV block of one TP rank: every attention layer's bytes for that block, layer
after layer (layout ``vllm_block``). Its key chains vLLM's own block hashes (the request's
``block_hashes``, which already cover the tokens before the block, LoRA, multimodal inputs and
the request's ``cache_salt``); the namespace carries the model and revision, the KV dtype, the
block size, the tenant and a geometry naming vLLM's KV layout and the per-rank block shape; the
shard carries the TP rank and size. An SGLang deployment (layouts ``page_first`` and the like)
and a vLLM one never share a namespace, so neither reads the other's pages.

Both of vLLM's processes (the scheduler, which looks pages up, and each worker, which moves
them) derive the same identity from the same ``VllmConfig`` and ``KVCacheConfig``.

The secondary tier behind vLLM's CPU offloading (:mod:`hicache_storage.vllm.tier`) stores
something else: a row of the offloading's CPU primary tier, which holds one chunk of every
worker (rank after rank, each rank's blocks tensor after tensor, padded to a memory page), keyed
once for all ranks. Its namespace (:func:`offload_rows`) has the same model, revision, dtype and
tenant rules, and a geometry that starts ``kv_layout=offload_row``, a value no vLLM KV layout
has, so it never shares a namespace with the KV connector's pages, even where a row happens to
hold the same bytes as one rank's block (TP 1, one block per chunk, no padding): the tier runs in
the scheduler, which is not told the KV heads, head size or KV layout that name the KV
connector's geometry, so it could not prove that equality.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hicache_storage.errors import ConfigError
from hicache_storage.keys import KeyScope, Namespace, PageKey, Shard
from hicache_storage.vllm.config import TIER_WHERE, WHERE, VllmConnectorConfig

#: The key part of every page (K and V of every layer together).
PART = "kv"


@dataclass(frozen=True)
class Deployment:
    """One vLLM deployment's page identity."""

    namespace: Namespace
    tp_size: int
    #: tokens per KV block (one page)
    block_size: int
    #: vLLM block hashes per KV block (the hash block size divides the block size)
    hash_stride: int
    #: the attention layers, in the order their bytes follow each other in a page
    layer_names: tuple[str, ...]
    #: bytes of one layer's block on one rank
    layer_block_bytes: int

    def scope(self, tp_rank: int) -> KeyScope:
        return KeyScope(self.namespace, Shard(tp_rank=tp_rank, tp_size=self.tp_size), PART)

    def keys(self, tp_rank: int, hashes: Sequence[str]) -> list[PageKey]:
        return self.scope(tp_rank).keys(hashes)

    def page_hashes(self, block_hashes: Sequence[bytes]) -> list[str]:
        """One page hash per full KV block, from a request's ``block_hashes`` (hash of its last hash block)."""
        step = self.hash_stride
        return [bytes(h).hex() for h in block_hashes[step - 1 :: step]]


def deployment(vllm_config: Any, kv_cache_config: Any, config: VllmConnectorConfig) -> Deployment:
    """The identity of ``vllm_config``'s pages; a ``ConfigError`` for a deployment the connector cannot key."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    parallel = vllm_config.parallel_config
    for axis, size in (("pipeline", parallel.pipeline_parallel_size), ("decode context", parallel.decode_context_parallel_size)):
        if size > 1:
            raise ConfigError(
                f"{axis} parallelism (size {size}) is not supported by HiCacheStorageConnector: its pages are keyed "
                "by TP rank only. Run with tensor parallelism alone.",
                backend=WHERE,
            )
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        kinds = ", ".join(sorted({type(g.kv_cache_spec).__name__ for g in groups}))
        raise ConfigError(
            f"HiCacheStorageConnector stores models with one full-attention KV cache group; this model has "
            f"{len(groups)} ({kinds}): hybrid models (sliding window, Mamba) are not supported",
            backend=WHERE,
        )
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or isinstance(spec, MLAAttentionSpec):
        raise ConfigError(
            f"HiCacheStorageConnector stores full-attention (MHA/GQA) KV; this model's KV cache is "
            f"{type(spec).__name__}, which it does not support",
            backend=WHERE,
        )
    cache = vllm_config.cache_config
    _check_hashes_are_shared(cache.prefix_caching_hash_algo)
    hash_block_size = kv_cache_config.hash_block_size or spec.block_size
    if spec.block_size % hash_block_size:
        raise ConfigError(
            f"vLLM's hash block size ({hash_block_size}) does not divide its KV block size ({spec.block_size})",
            backend=WHERE,
        )
    model_config = vllm_config.model_config
    model = config.model or _served_name(model_config)
    dtype = str(spec.dtype).removeprefix("torch.")
    kv_dtype = dtype if cache.cache_dtype in (None, "auto") else f"{cache.cache_dtype}:{dtype}"
    layer_names = tuple(groups[0].layer_names)
    layout = kv_cache_config.kv_cache_layout or "default"
    geometry = (
        f"kv_layout={layout},device={current_platform.device_type},layers={len(layer_names)},"
        f"kv_heads={spec.num_kv_heads},head_size={spec.head_size},block_bytes={spec.page_size_bytes}"
    )
    namespace = Namespace(
        model=model,
        kv_dtype=kv_dtype,
        page_size=spec.block_size,
        layout="vllm_block",
        revision=config.revision if config.revision is not None else model_config.revision,
        tenant=config.tenant,
        geometry=geometry,
    )
    return Deployment(
        namespace=namespace,
        tp_size=parallel.tensor_parallel_size,
        block_size=spec.block_size,
        hash_stride=spec.block_size // hash_block_size,
        layer_names=layer_names,
        layer_block_bytes=spec.page_size_bytes,
    )


#: The first field of an offloading row's geometry: no vLLM KV layout is called this.
OFFLOAD_ROW = "offload_row"


@dataclass(frozen=True)
class OffloadRows:
    """The page identity of vLLM's offloading rows in a secondary tier: one page per chunk key."""

    namespace: Namespace

    def scope(self, group: int) -> KeyScope:
        """Every rank's bytes are in the row: one shard for the deployment, a part per KV cache group."""
        return KeyScope(self.namespace, Shard(), f"kv_g{group}")

    def key(self, block_hash: bytes, group: int) -> PageKey:
        return self.scope(group).key(bytes(block_hash).hex())


def offload_rows(offloading_config: Any, config: VllmConnectorConfig, row_bytes: int) -> OffloadRows:
    """The identity of the rows an ``OffloadingSpec`` (its ``OffloadingConfig``) cascades to a
    secondary tier, ``row_bytes`` each. The spec carries neither vLLM's ``--revision`` nor its
    served model name: ``revision`` and ``model`` come from the tier's config (the model defaults
    to vLLM's ``--model``)."""
    groups = offloading_config.groups
    if not groups:
        raise ConfigError("vLLM's offloading config has no KV cache group to store", backend=TIER_WHERE)
    parallel = offloading_config.parallel
    blocks_per_chunk = offloading_config.cache.blocks_per_chunk
    canonical = "canonical" if offloading_config.canonical_layout else "direct"
    if offloading_config.replicated_layout:
        canonical += "+replicated"
    geometry = (
        f"kv_layout={OFFLOAD_ROW},vllm_kv_layout={offloading_config.kv_cache_layout or 'default'},format={canonical},"
        f"world={parallel.world_size},tp={parallel.tp_size},pp={parallel.pp_size},pcp={parallel.pcp_size},"
        f"dcp={parallel.dcp_size},blocks_per_chunk={blocks_per_chunk},"
        f"tokens_per_hash={offloading_config.cache.tokens_per_hash},"
        f"groups={'+'.join(f'{g.tokens_per_block}x{len(g.layer_names)}' for g in groups)},"
        f"worker_block_bytes={offloading_config.worker_kv_bytes_per_block},row_bytes={row_bytes}"
    )
    namespace = Namespace(
        model=config.model or str(offloading_config.model.name),
        kv_dtype=str(offloading_config.model.dtype),
        page_size=groups[0].tokens_per_block * blocks_per_chunk,
        layout="vllm_block",
        revision=config.revision,
        tenant=config.tenant,
        geometry=geometry,
    )
    return OffloadRows(namespace)


def _served_name(model_config: Any) -> str:
    served = model_config.served_model_name
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return str(served or model_config.model)


def _check_hashes_are_shared(algorithm: str) -> None:
    """vLLM seeds a non-cryptographic block hash with random bytes per process unless
    PYTHONHASHSEED is set: no other process could ever find the pages this one stores."""
    if algorithm.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None:
        raise ConfigError(
            f"prefix_caching_hash_algo={algorithm!r} without PYTHONHASHSEED gives every vLLM process its own random "
            "block hashes, so no other engine (nor this one after a restart) could read the pages it stores; set "
            "PYTHONHASHSEED to one value across the deployment, or use prefix_caching_hash_algo='sha256'",
            field="prefix_caching_hash_algo",
            backend=WHERE,
        )
