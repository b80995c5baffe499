"""Host<->device KV copies for SGLang's host pools on the CPU.

SGLang binds its ``sgl_kernel.kvcacheio`` copy ops only under CUDA, ROCm or XPU
(``srt/mem_cache/pool_host/mha.py``, ``mla.py``); on this machine the names are unbound and a
backup or load raises ``NameError``. These are plain indexed copies with the same keyword
signatures, installed into SGLang's pool modules by :func:`install`. Every op copies token rows:
a row is one token's bytes of one layer (``item_size``), addressed either through a tensor
(``src_k``, ``dst_k``, lists of layer tensors) or through a table of layer base addresses (the
``*_layers`` arguments: an int64 tensor of ``data_ptr()`` values, each layer packed row by row).

Ascend's ``transfer_kv_dim_exchange`` (``sgl_kernel_npu.kvcacheio``, bound in SGLang's pool
modules only on NPU) is here too, with its ``TransferDirection``: it moves whole pages between
layer-major device buffers and page-major host buffers (``page_first_kv_split``).

The page layouts they write are the host pool's own buffers (its ``kv_buffer`` views). A round
trip alone would pass an op that scrambles pages the same way in both directions, so
tests/sglang_tier/test_cpu_ops.py checks, through SGLang's MHA and MLA host pools on every layout
the tier runs, that the ops land device rows in the host page layout the pool defines (``get_data_page``, and ``get_page_buffer_meta``
for the split layout).
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Sequence

import torch

# --- rows ------------------------------------------------------------------------------------


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one byte row per index of its first dimension (a view, never a copy)."""
    rows = t.view(torch.uint8)
    return rows.view(t.shape[0], -1) if t.dim() > 1 else rows.view(-1, 1)


def _layer_rows(ptr: int, indices: torch.Tensor, item_size: int) -> torch.Tensor:
    """The layer at address ``ptr`` (rows of ``item_size`` bytes), viewed up to the last row indexed."""
    count = int(indices.max()) + 1 if indices.numel() else 0
    buffer = (ctypes.c_uint8 * (count * item_size)).from_address(int(ptr))
    return torch.frombuffer(buffer, dtype=torch.uint8).view(count, item_size)


def _copy(dst: torch.Tensor, dst_indices: torch.Tensor, src: torch.Tensor, src_indices: torch.Tensor) -> None:
    dst[dst_indices.long()] = src[src_indices.long()]


def _table(layers: torch.Tensor | Sequence[int]) -> list[int]:
    return [int(p) for p in (layers.tolist() if isinstance(layers, torch.Tensor) else layers)]


# --- MHA: K and V -------------------------------------------------------------------------------


def transfer_kv_per_layer(*, src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size, **_):
    """One layer, layer-first on both sides: ``dst[dst_i] = src[src_i]``."""
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        _copy(_rows(dst), dst_indices, _rows(src), src_indices)


def transfer_kv_all_layer(*, src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices, dst_indices, item_size, num_layers, **_):
    """Every layer, both sides given as tables of layer addresses."""
    for src_table, dst_table in ((src_k_layers, dst_k_layers), (src_v_layers, dst_v_layers)):
        for src, dst in zip(_table(src_table)[:num_layers], _table(dst_table)[:num_layers]):
            _copy(_layer_rows(dst, dst_indices, item_size), dst_indices, _layer_rows(src, src_indices, item_size), src_indices)


def transfer_kv_all_layer_lf_pf(*, src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size, num_layers, **_):
    """Device layers (address table) into a page-first host buffer ``[tokens, layers, ...]``."""
    for src_table, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        for layer, src in enumerate(_table(src_table)[:num_layers]):
            _copy(_rows(dst[:, layer]), dst_indices, _layer_rows(src, src_indices, item_size), src_indices)


def transfer_kv_per_layer_pf_lf(*, src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, **_):
    """One layer of a page-first host buffer into a device layer."""
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        _copy(_rows(dst), dst_indices, _rows(src[:, layer_id]), src_indices)


def _page_head_rows(buffer: torch.Tensor, layer: int, page_size: int) -> torch.Tensor:
    """Token rows of one layer of a page-head buffer ``[pages, heads, page_size, layers, dim]``,
    as a tensor ``[tokens, heads, dim]`` (a view: token ``j`` is page ``j // page_size``)."""
    pages, heads, _, _, dim = buffer.shape
    return buffer[:, :, :, layer, :].permute(0, 2, 1, 3).reshape(pages * page_size, heads, dim)


def transfer_kv_all_layer_lf_ph(*, src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size, num_layers, page_size, head_num, **_):
    """Device layers (address table) into a page-head host buffer."""
    for src_table, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        for layer, src in enumerate(_table(src_table)[:num_layers]):
            rows = _layer_rows(src, src_indices, item_size)[src_indices.long()]
            dim = dst.shape[-1]
            values = rows.view(dst.dtype).view(-1, head_num, dim)
            pages, slots = dst_indices.long() // page_size, dst_indices.long() % page_size
            dst[pages, :, slots, layer, :] = values


def transfer_kv_per_layer_ph_lf(*, src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, page_size, head_num, **_):
    """One layer of a page-head host buffer into a device layer."""
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        pages, slots = src_indices.long() // page_size, src_indices.long() % page_size
        dst[dst_indices.long()] = src[pages, :, slots, layer_id, :].reshape(-1, *dst.shape[1:])


def transfer_kv_direct(*, src_layers, dst_layers, src_indices, dst_indices, page_size, **_):
    """Layer tensors to layer tensors, pairwise."""
    for src, dst in zip(src_layers, dst_layers):
        _copy(_rows(dst), dst_indices, _rows(src), src_indices)


def _direct_at(buffer: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Page and slot of each token index in a page-first-direct buffer ``[pages, layers, page_size, ...]``."""
    page_size = buffer.shape[2]
    return indices.long() // page_size, indices.long() % page_size


def transfer_kv_all_layer_direct_lf_pf(*, src_ptrs, dst_ptrs, src_indices, dst_indices, page_size, **_):
    """Device layers (``[k_0..k_L-1, v_0..v_L-1]``, or ``[kv_0..]`` for MLA) into page-first-direct
    host buffers (``[k, v]``, or ``[kv]``)."""
    layers = len(src_ptrs) // len(dst_ptrs)
    for i, src in enumerate(src_ptrs):
        dst = dst_ptrs[i // layers]
        pages, slots = _direct_at(dst, dst_indices)
        dst[pages, i % layers, slots] = src[src_indices.long()].view(-1, *dst.shape[3:])


def transfer_kv_per_layer_direct_pf_lf(*, src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size, **_):
    """One layer of page-first-direct host buffers into device layers (pairwise)."""
    for src, dst in zip(src_ptrs, dst_ptrs):
        pages, slots = _direct_at(src, src_indices)
        dst[dst_indices.long()] = src[pages, layer_id, slots].view(-1, *dst.shape[1:])


# --- MLA: one latent buffer ---------------------------------------------------------------------


def transfer_kv_per_layer_mla(*, src, dst, src_indices, dst_indices, item_size, **_):
    _copy(_rows(dst), dst_indices, _rows(src), src_indices)


def transfer_kv_all_layer_mla(*, src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers, **_):
    for src, dst in zip(_table(src_layers)[:num_layers], _table(dst_layers)[:num_layers]):
        _copy(_layer_rows(dst, dst_indices, item_size), dst_indices, _layer_rows(src, src_indices, item_size), src_indices)


def transfer_kv_per_layer_mla_pf_lf(*, src, dst, src_indices, dst_indices, layer_id, **_):
    _copy(_rows(dst), dst_indices, _rows(src[:, layer_id]), src_indices)


def transfer_kv_all_layer_mla_lf_pf(*, src_layers, dst, src_indices, dst_indices, item_size, num_layers, **_):
    for layer, src in enumerate(_table(src_layers)[:num_layers]):
        _copy(_rows(dst[:, layer]), dst_indices, _layer_rows(src, src_indices, item_size), src_indices)


# --- Mamba state: one buffer per state kind, rows are request slots -------------------------------


def transfer_kv_mamba_lf_pf(*, src_ptrs, dst, src_indices, dst_indices, item_size, num_layers, **_):
    """Device state layers (address table) into a page-first host state ``[slots, layers, ...]``."""
    transfer_kv_all_layer_mla_lf_pf(
        src_layers=src_ptrs, dst=dst, src_indices=src_indices, dst_indices=dst_indices, item_size=item_size, num_layers=num_layers
    )


transfer_kv_mamba_pf_lf = transfer_kv_per_layer_mla_pf_lf


# --- Ascend's dim exchange (``sgl_kernel_npu.kvcacheio``): layer-major device, page-major host -----


class TransferDirection(enum.IntEnum):
    """Which way :func:`transfer_kv_dim_exchange` copies (the names SGLang's pools pass)."""

    H2D = 0
    D2H = 1


def _page_ids(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """The page of each run of ``page_size`` token slots; the op moves whole pages only."""
    indices = indices.long().reshape(-1, page_size)
    pages = indices[:, 0] // page_size
    expected = pages[:, None] * page_size + torch.arange(page_size)
    if not torch.equal(indices, expected):
        raise ValueError("transfer_kv_dim_exchange moves whole pages: token slots must be page-aligned runs")
    return pages


def transfer_kv_dim_exchange(
    *, device_indices, host_indices, device_k, host_k, device_v, host_v, page_size, direction,
    device_index_k=None, host_index_k=None, device_index_k_scale=None, host_index_k_scale=None, **_,
):  # fmt: skip
    """Whole pages between layer-major device buffers ``[layers, pages, page_size, ...]`` and
    page-major host buffers ``[pages, layers, page_size, ...]`` (the layer and page dimensions
    exchanged): K, V, and an indexer's K and scales where both sides have them. A side given as
    ``None`` or an empty tensor is not moved (SGLang passes empty V tensors for K-only pools)."""
    device_pages, host_pages = _page_ids(device_indices, page_size), _page_ids(host_indices, page_size)
    pairs = ((device_k, host_k), (device_v, host_v), (device_index_k, host_index_k), (device_index_k_scale, host_index_k_scale))
    for device, host in pairs:
        if device is None or host is None or device.numel() == 0 or host.numel() == 0:
            continue
        if direction == TransferDirection.D2H:
            host[host_pages] = device[:, device_pages].transpose(0, 1)
        elif direction == TransferDirection.H2D:
            device[:, device_pages] = host[host_pages].transpose(0, 1)
        else:
            raise ValueError(f"unknown transfer direction {direction!r}")


OPS = {
    name: obj
    for name, obj in dict(globals()).items()
    if name.startswith("transfer_kv_") and callable(obj)
}
OPS["TransferDirection"] = TransferDirection

#: SGLang's modules that call the ops by their global names.
POOL_MODULES = (
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.pool_host.dsa",
    "sglang.srt.mem_cache.pool_host.mamba",
    "sglang.srt.mem_cache.memory_pool_host",
)


def install() -> None:
    """Bind every op SGLang's pool modules left unbound (they bind theirs under CUDA/ROCm/XPU only)."""
    import importlib

    for module_name in POOL_MODULES:
        module = importlib.import_module(module_name)
        for name, op in OPS.items():
            if not hasattr(module, name):
                setattr(module, name, op)
