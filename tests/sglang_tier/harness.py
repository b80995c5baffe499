"""SGLang's own cache stack on the CPU, with our adapter as its L3, driven the way its scheduler does.

What runs is SGLang 0.5.23's code: ``UnifiedRadixCache`` builds its host pools and its
``HybridCacheController`` (``init_hicache``), the controller builds our adapter through its
``dynamic`` loader, registers every pool, and its own backup and prefetch threads call the
adapter. What this module supplies is only what a CPU machine outside a launched server lacks
(see :func:`prepare_cpu`) and the steps a scheduler would take: insert a request's tokens, back
its path up to host and storage, and on a fresh cache prefetch the prefix from storage and load it
back to the device.

The device pools are built by SGLang's own unit-test kit (``sglang.test.kits.unified_radix_cache``);
MLA swaps the kit's ``MHATokenToKVPool`` for SGLang's ``MLATokenToKVPool``.
"""

from __future__ import annotations

import json
import time
from array import array
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

_PREPARED = False


def prepare_cpu() -> None:
    """What SGLang's cache code needs on a CPU outside a launched server (idempotent):

    * the kit's ``get_device`` raises without an accelerator: the device is ``"cpu"``;
    * host pools pin their memory with ``cudaHostRegister``: pinning is off;
    * ``torch.cpu.Stream`` has no ``synchronize`` (SGLang calls it after a failed submission);
    * the host<->device copy ops are bound only under CUDA/ROCm/XPU: ours (:mod:`cpu_ops`).
    """
    global _PREPARED
    if _PREPARED:
        return
    import sglang.srt.mem_cache.pool_host.base as host_base
    import sglang.srt.mem_cache.pool_host.dsa as host_dsa
    import sglang.srt.mem_cache.memory_pool_host as host_v4
    import sglang.srt.mem_cache.pool_host.mamba as host_mamba
    import sglang.test.kits.unified_radix_cache.fixtures as kit_fixtures

    import cpu_ops

    kit_fixtures.get_device = lambda *args, **kwargs: "cpu"
    # Every host pool class that takes pin_memory itself rather than from HostKVCache.
    host_pools = (host_base.HostKVCache, host_mamba.MambaPoolHost, host_dsa.DSAIndexerPoolHost,
                  host_v4.DeepSeekV4PagedHostPool, host_v4.DeepSeekV4StateHostPool)  # fmt: skip
    for pool_class in host_pools:
        pool_class.__init__ = _unpinned(pool_class.__init__)
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None
    cpu_ops.install()
    _PREPARED = True


def _unpinned(init: Any) -> Any:
    def unpinned_init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    return unpinned_init


@dataclass
class Deployment:
    """One SGLang deployment's cache settings and the store it uses as L3."""

    connector: str
    connector_config: dict[str, Any]
    layout: str = "page_first"
    mla: bool = False
    #: MLA with a DSA/NSA indexer (DeepSeek V3.2): SGLang adds an indexer host pool as a KV sidecar
    dsa: bool = False
    components: tuple[str, ...] = ("FULL",)
    page_size: int = 4
    layers: int = 4
    tp_rank: int = 0
    tp_size: int = 1
    #: this engine's pipeline stage; each stage holds its own layers (``layers`` of them)
    pp_rank: int = 0
    pp_size: int = 1
    #: attention context parallelism: ``tp_size`` ranks are ``attn_cp_size`` groups of attention TP
    attn_cp_size: int = 1
    model: str = "tier/model"
    #: an EAGLE-style draft model's KV (MHA, one layer) as a sidecar that follows the target's KV slots
    draft: bool = False
    #: MTP draft layers (MLA, one layer each) packed into the target's KV host pages
    mtp_layers: int = 0
    #: DeepSeek V4: each layer's compress ratio (0: SWA only; 4 and 128: compressed KV too). Its
    #: device pool is SGLang's ``DeepSeekV4TokenToKVPool``; the tree's components are FULL + SWA.
    v4_ratios: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def io_backend(self) -> str:
        if self.layout == "page_first_kv_split":
            return "kernel_ascend"  # the only backend SGLang moves that layout with (Ascend's dim exchange)
        return "direct" if self.layout == "page_first_direct" else "kernel"

    def extra_config(self) -> dict[str, Any]:
        return {
            "backend_name": "hicache",
            "module_path": "hicache_storage.sglang",
            "class_name": "HiCacheStorageAdapter",
            "interface_v1": 1,
            "connector": self.connector,
            "connector_config": self.connector_config,
            "model": self.model,
            "prefetch_threshold": 1,
            **self.extra,
        }


class Engine:
    """One ``UnifiedRadixCache`` with HiCache and our adapter as L3."""

    def __init__(self, deployment: Deployment, attn_cp_group: Any = None) -> None:
        """``attn_cp_group``: the attention-CP process group, which is where SGLang's controller
        reads a rank's CP rank and size from (``get_attn_cp_rank_and_size``)."""
        prepare_cpu()
        from sglang.srt.hardware_backend.npu.memory_pool_npu import NPUMLATokenToKVPool
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPool
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
        from sglang.test.kits.unified_radix_cache import fixtures as kit
        from sglang.test.kits.unified_radix_cache.config import CacheConfig

        self.deployment = deployment
        self._exit = ExitStack()
        attn_tp_size = deployment.tp_size // deployment.attn_cp_size
        self._exit.enter_context(
            get_parallel().override(
                tp_rank=deployment.tp_rank, tp_size=deployment.tp_size, attn_tp_rank=deployment.tp_rank % attn_tp_size,
                attn_tp_size=attn_tp_size, attn_cp_rank=deployment.tp_rank // attn_tp_size,
                attn_cp_size=deployment.attn_cp_size, moe_tp_rank=deployment.tp_rank, moe_tp_size=deployment.tp_size,
                pp_rank=deployment.pp_rank, pp_size=deployment.pp_size, attn_dcp_size=1, attn_dcp_rank=0,
            )
        )
        self.cfg = CacheConfig(
            page_size=deployment.page_size,
            components=tuple(ComponentType[name] for name in deployment.components),
            num_layers=deployment.layers,
            full_attention_layer_ids=tuple(range(1, deployment.layers, 2)),
            sliding_window_size=2 * deployment.page_size if "SWA" in deployment.components else None,
            kv_size=max(512, 8 * deployment.page_size),
            max_context_len=max(512, 8 * deployment.page_size),
            head_num=2,
            head_dim=8,
            # SGLang's Mamba component needs its extra buffer for pages of more than one token.
            enable_mamba_extra_buffer="MAMBA" in deployment.components,
            mamba_cache_size=60,
        )
        with ExitStack() as build:
            if deployment.mla or deployment.dsa:

                def mla_pool(*, size, page_size, dtype, head_num, head_dim, layer_num, device, enable_memory_saver):
                    if deployment.layout == "page_first_kv_split":
                        # SGLang's Ascend MLA pool: K (latent), V (rope) and a DSA indexer's K in
                        # separate layer-major buffers [layers, pages, page_size, 1, width].
                        return NPUMLATokenToKVPool(
                            size=size, page_size=page_size, dtype=dtype, kv_lora_rank=12, qk_rope_head_dim=4,
                            layer_num=layer_num, device=device, enable_memory_saver=enable_memory_saver,
                            index_head_dim=8 if deployment.dsa else None,
                        )  # fmt: skip
                    if deployment.dsa:
                        return DSATokenToKVPool(
                            size=size, page_size=page_size, kv_lora_rank=12, dtype=dtype, qk_rope_head_dim=4,
                            layer_num=layer_num, device=device, index_head_dim=128,
                            enable_memory_saver=enable_memory_saver, kv_cache_dim=16,
                        )  # fmt: skip
                    return MLATokenToKVPool(
                        size=size, page_size=page_size, dtype=dtype, kv_lora_rank=12, qk_rope_head_dim=4,
                        layer_num=layer_num, device=device, enable_memory_saver=enable_memory_saver,
                    )  # fmt: skip

                build.enter_context(mock.patch.object(kit, "MHATokenToKVPool", mla_pool))
            if deployment.v4_ratios:
                build.enter_context(mock.patch.object(kit, "SWAKVPool", self._v4_pool))
            if deployment.layout == "page_first_kv_split":
                # The kit hands out token slots from 1; a launched server allocates whole pages
                # (PagedTokenToKVPoolAllocator for any page size above 1), and Ascend's dim
                # exchange moves whole pages only.
                build.enter_context(mock.patch.object(kit, "TokenToKVPoolAllocator", self._paged_allocator))
            self.cache, self.allocator, self.req_to_token_pool = kit.build_fixture(self.cfg)
        self.mtp_pools = tuple(
            MLATokenToKVPool(
                size=self.allocator.get_kvcache().size, page_size=deployment.page_size, dtype=self.cfg.dtype,
                kv_lora_rank=12, qk_rope_head_dim=4, layer_num=1, device="cpu", enable_memory_saver=False,
            )  # fmt: skip
            for _ in range(deployment.mtp_layers)
        )
        # What SGLang's KV cache builder hands the tree for MTP draft layers (CacheInitParams).
        self.cache.cache_init_params.mtp_draft_device_pools = self.mtp_pools
        server_args = ServerArgs(
            model_path="dummy",
            page_size=deployment.page_size,
            hicache_io_backend=deployment.io_backend,
            hicache_mem_layout=deployment.layout,
            hicache_write_policy="write_through",
            hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps(deployment.extra_config()),
            hicache_storage_prefetch_policy="wait_complete",
            hicache_host_memory_mode="cache",
        )
        set_global_server_args_for_scheduler(server_args)
        if attn_cp_group is not None:
            # What SGLang's KV cache builder passes in CacheInitParams (the kit builds the tree without it).
            self.cache.cache_init_params.attn_cp_cache_group = self.cache.attn_cp_group = attn_cp_group
        self.cache.init_hicache(server_args, self.cache.cache_init_params)
        kit.drop_hicache_atexit_pin(self.cache)
        self.cache.write_through_threshold = 1 << 30
        self.cache.load_back_threshold = 0
        self.draft_pool = self._attach_draft() if deployment.draft else None
        controller = self.cache.cache_controller
        # The kit sizes host and device pools equally, which leaves no prefetch capacity.
        controller.prefetch_capacity_limit = max(controller.prefetch_capacity_limit, controller.mem_pool_host.size)

    def _paged_allocator(self, *, size, dtype, device, kvcache, need_sort) -> Any:
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

        return PagedTokenToKVPoolAllocator(size, self.cfg.page_size, dtype, device, kvcache, need_sort)

    def _v4_pool(self, *, size, size_swa, page_size, device, **_) -> Any:
        """SGLang's DeepSeek V4 device pool where the kit builds an SWA pool, sized the way
        SGLang's pool configurator sizes it (``_DSV4PoolSizes``): compressed pools at
        ``full // ratio`` tokens, the C4 compress state at one ring per SWA page."""
        from sglang.srt.mem_cache.deepseek_v4_compress_state import CompressStatePool  # noqa: F401
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool, resolve_compress_state_ring_size

        ratios = list(self.deployment.v4_ratios)
        return DeepSeekV4TokenToKVPool(
            max_num_reqs=self.cfg.max_num_reqs, swa_size=size_swa, c4_size=size // 4, c128_size=max(1, size // 128),
            c4_state_pool_size=size_swa // page_size * resolve_compress_state_ring_size(4), c128_state_pool_size=0,
            page_size=page_size, swa_page_size=page_size, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
            c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128,
            layer_num=len(ratios), start_layer=0, end_layer=len(ratios), device=device, enable_memory_saver=False,
            compression_ratios=ratios, full_size=size,
        )  # fmt: skip

    def _attach_draft(self) -> Any:
        """An MHA draft KV pool registered the way SGLang's speculative worker does
        (``build_hicache_draft_sidecars`` then ``register_sidecar_pool``)."""
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_hicache_draft_sidecars
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        target = self.allocator.get_kvcache()
        draft = MHATokenToKVPool(
            size=target.size, page_size=self.cfg.page_size, dtype=self.cfg.dtype, head_num=2, head_dim=8,
            layer_num=1, device="cpu", enable_memory_saver=False,
        )  # fmt: skip
        specs, entries = build_hicache_draft_sidecars(draft_device_pools=(draft,), tree_cache=self.cache)
        for spec, entry in zip(specs, entries):
            self.cache.register_sidecar_pool(spec, entry)
        return draft

    @property
    def adapter(self) -> Any:
        return self.cache.cache_controller.storage_backend

    def close(self) -> None:
        try:
            self.cache.cache_controller._stop_storage_threads()
            self.cache.release_host_resources()
            self.adapter.close()
        finally:
            self._exit.close()

    # --- the device KV --------------------------------------------------------------------------

    def _device_places(self, indices: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every device buffer a restore of token slots ``indices`` writes, with the rows it
        writes: full-attention KV (and a draft's, and MTP layers') by token, a DSA indexer by page;
        for DeepSeek V4, whose full-attention KV is only a logical anchor, the compressed pools
        that follow it (C4 and C128 KV, the C4 indexer) by page."""
        pool = self.allocator.get_kvcache()
        pages = indices[:: self.cfg.page_size] // self.cfg.page_size
        if self.deployment.v4_ratios:
            compressed = [*(pool.c4_kv_pool.kv_buffer if pool.c4_kv_pool else [])]
            compressed += [*(pool.c4_indexer_kv_pool.index_k_with_scale_buffer if pool.c4_indexer_kv_pool else [])]
            compressed += [*(pool.c128_kv_pool.kv_buffer if pool.c128_kv_pool else [])]
            return [(buffer, pages) for buffer in compressed]
        pool = getattr(pool, "full_kv_pool", pool)
        if hasattr(pool, "k_buffer"):
            buffers = list(pool.k_buffer) + list(pool.v_buffer)
            if self.deployment.layout == "page_first_kv_split":  # Ascend's [layers, pages, page_size, ...]
                buffers += list(pool.index_k_buffer) if pool.index_k_buffer is not None else []
                buffers = [layer.flatten(0, 1) for layer in buffers]
        else:
            buffers = list(pool.kv_buffer)
        if self.draft_pool is not None:
            buffers += list(self.draft_pool.k_buffer) + list(self.draft_pool.v_buffer)
        for mtp in self.mtp_pools:
            buffers += list(mtp.kv_buffer)
        places = [(buffer, indices) for buffer in buffers]
        places += [(buffer, pages) for buffer in getattr(pool, "index_k_with_scale_buffer", None) or []]
        return places

    def fill(self, indices: torch.Tensor, seed: int) -> list[torch.Tensor]:
        """Random bytes in every row a restore of ``indices`` writes; returns what was written."""
        generator = torch.Generator().manual_seed(seed)
        written = []
        for buffer, rows_at in self._device_places(indices):
            rows = buffer[rows_at]
            data = torch.randint(0, 256, rows.view(torch.uint8).shape, dtype=torch.uint8, generator=generator)
            buffer[rows_at] = data.view(buffer.dtype).view(rows.shape)
            written.append(buffer[rows_at].clone())
        return written

    def snapshot(self, indices: torch.Tensor) -> list[torch.Tensor]:
        return [buffer[rows_at].clone() for buffer, rows_at in self._device_places(indices)]

    def side_state(self, leaf: Any) -> list[tuple[torch.Tensor, tuple[Any, ...]]]:
        """Where a hybrid stack keeps the state a restore of ``leaf``'s path needs besides the
        full-attention KV: (buffer, index) pairs for the SWA rows of the last window (DeepSeek V4:
        its SWA pages and the C4 compress state rings that follow them), or the Mamba state slot
        of the leaf."""
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.test.kits.unified_radix_cache.fixtures import node_device_value

        places: list[tuple[torch.Tensor, tuple[Any, ...]]] = []
        if self.cfg.has_swa:
            full = self.cache.path_device_indices(leaf)[-self.cfg.sliding_window_size :]
            rows = self.allocator.full_to_swa_index_mapping[full].long()
            pool = self.allocator.get_kvcache()
            if self.deployment.v4_ratios:
                places += self._v4_swa_places(pool, rows[:: self.cfg.page_size] // self.cfg.page_size)
            else:
                places += [(buffer, (rows,)) for buffer in list(pool.swa_kv_pool.k_buffer) + list(pool.swa_kv_pool.v_buffer)]
        if self.cfg.has_mamba:
            slot = node_device_value(self.cache, leaf, ComponentType.MAMBA).long()
            state = self.req_to_token_pool.mamba_pool.mamba_cache
            places += [(buffer, (slice(None), slot)) for buffer in [*state.conv, state.temporal]]
        return places

    @staticmethod
    def _v4_swa_places(pool: Any, swa_pages: torch.Tensor) -> list[tuple[torch.Tensor, tuple[Any, ...]]]:
        """DeepSeek V4's SWA KV rows (one per SWA page and layer) and the compress state rings of
        its C4 layers (attention and indexer; one ring of state slots per SWA page)."""
        places: list[tuple[torch.Tensor, tuple[Any, ...]]] = [(buffer, (swa_pages,)) for buffer in pool.swa_kv_pool.kv_buffer]
        for state in [*pool.compress_state_pools, *pool.indexer_compress_state_pools]:
            if state is not None and state.ratio == 4:
                slots = (swa_pages[:, None] * state.ring_size + torch.arange(state.ring_size)).reshape(-1)
                places.append((state.kv_score_buffer.kv_score, (slots,)))
        return places

    def fill_side_state(self, leaf: Any, seed: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        written = []
        for buffer, index in self.side_state(leaf):
            rows = buffer[index]
            data = torch.randint(0, 256, rows.view(torch.uint8).shape, dtype=torch.uint8, generator=generator)
            buffer[index] = data.view(buffer.dtype).view(rows.shape)
            written.append(buffer[index].clone())
        return written

    def leaf(self, tokens: list[int]) -> Any:
        from sglang.test.kits.unified_radix_cache.fixtures import match_prefix

        return match_prefix(self.cache, tokens).last_device_node

    # --- what the scheduler does ----------------------------------------------------------------

    def insert(self, tokens: list[int]) -> Any:
        """Put ``tokens`` in the tree on the device (as a finished prefill does); returns the leaf."""
        from sglang.test.kits.unified_radix_cache.fixtures import match_prefix
        from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures

        # The kit's insert step: slots from the allocator (both SWA allocators on an SWA stack),
        # and a request's Mamba state slot on a Mamba stack.
        steps = UnifiedRadixCacheFixtures()
        steps.cfg = self.cfg
        steps._insert(self.cache, self.allocator, self.req_to_token_pool, tokens)
        return match_prefix(self.cache, tokens).last_device_node

    def path(self, node: Any) -> list[Any]:
        from sglang.test.kits.unified_radix_cache.fixtures import node_parent

        chain = []
        while node != self.cache.root_node_handle():
            chain.append(node)
            node = node_parent(self.cache, node)
        return chain[::-1]

    def back_up(self, leaf: Any, timeout: float = 30.0) -> None:
        """Device -> host for the whole path, then host -> storage, and wait until storage acked."""
        from sglang.test.kits.unified_radix_cache.fixtures import write_backup

        for node in self.path(leaf):
            if not self.cache.tree_core.is_backuped(node):
                write_backup(self.cache, node, write_back=True)
        self.cache.writing_check(write_back=True)
        for node in self.path(leaf):
            self.cache.write_backup_storage(node)
        deadline = time.monotonic() + timeout
        while self.cache.ongoing_backup and time.monotonic() < deadline:
            self.cache.drain_storage_control_queues()
            time.sleep(0.01)
        self.cache.drain_storage_control_queues()
        assert not self.cache.ongoing_backup, "SGLang's storage backups did not finish"

    def restore(self, tokens: list[int], timeout: float = 30.0) -> tuple[int, list[torch.Tensor]]:
        """Prefetch ``tokens`` from storage into host, load the host hit to the device.

        Returns the tokens now on the device and their KV rows.
        """
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.test.kits.unified_radix_cache.fixtures import match_prefix

        request = CacheRequestHandle(f"restore-{id(tokens)}", 0)
        self.cache.prefetch_from_storage(request, self.cache.root_node_handle(), array("q", tokens), None, None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.cache.check_hicache_events()
            if self.cache.check_prefetch_progress(request):
                break
            time.sleep(0.01)
        else:
            raise AssertionError("SGLang's prefetch did not finish")
        match = match_prefix(self.cache, tokens)
        if match.host_hit_length:
            assert self.cache.load_back(match.last_host_node) is not None
            self.cache.ready_to_load_host_cache()
            for ack in list(self.cache.cache_controller.ack_load_queue):
                ack.finish_event.synchronize()
            self.cache.loading_check()
        match = match_prefix(self.cache, tokens)
        indices = self.cache.path_device_indices(match.last_device_node)
        return match.device_prefix_len, self.snapshot(indices)
