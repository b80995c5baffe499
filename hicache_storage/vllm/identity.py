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
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hicache_storage.errors import ConfigError
from hicache_storage.keys import KeyScope, Namespace, PageKey, Shard
from hicache_storage.vllm.config import WHERE, VllmConnectorConfig

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
