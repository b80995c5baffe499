"""Triton transfer kernel: every page, layer and half of a transfer in one launch.

One kernel serves both directions and all layouts. A program copies a tile of ``BLOCK_T`` tokens
of one (half, layer): it loads the tokens' source and destination slots, turns them into row
numbers with each side's :class:`~.layouts.RowMap` (the same formula the torch path uses), and
moves the rows ``BLOCK_W`` words at a time. The grid is ``(token tiles, layers, halves)``: a
per-layer load is one launch of ``layers = 1``, a backup one launch over all layers.

Data moves as raw machine words: both tensors are viewed as the widest integer type (8, 4, 2 or
1 bytes) that divides a row and both base addresses, so bf16, fp16, fp32 and 8-bit types
(uint8, float8) are bit-exact by construction and a wide word means fewer, wider memory ops.

Host memory on a GPU: the host pool is a pinned CPU tensor and is passed to the kernel as it is.
Triton's launcher turns every pointer argument into a device address with
``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)``; for page-locked memory (torch's
``pin_memory`` uses ``cudaHostAlloc``, which is mapped into the device address space under
unified virtual addressing on every 64-bit CUDA platform) that address is valid on the device and
equal to the host address, so the kernel reads and writes the pool over PCIe/NVLink-C2C directly,
with no staging copy. Pageable memory has no device address; the launcher would reject it, and
``dispatch`` refuses it earlier with a clearer message. This is the same mapping
``cudaHostGetDevicePointer`` returns; relying on the launcher's lookup keeps the pool an ordinary
torch tensor.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernel runs in Triton's
interpreter on CPU tensors, which is how the CPU test suite checks it bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .layouts import RowMap, TransferGeometry

# A tile of about this many words keeps enough bytes in flight per program on a GPU (16 KiB of
# int64) without spilling registers, and keeps the interpreter's program count small on the CPU.
_TILE_WORDS = 2048
_MAX_BLOCK_W = 256
_WORD_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


# The token count and first layer change from call to call: specializing on their values (== 1,
# divisible by 16) would only multiply compiled variants without speeding up a copy.
@triton.jit(do_not_specialize=["n_tokens", "first_layer"])
def _copy_rows_kernel(
    src_ptr,
    dst_ptr,
    src_slots_ptr,
    dst_slots_ptr,
    n_tokens,
    first_layer,
    row_words,
    src_rows_per_half,
    src_block,
    src_block_stride,
    src_in_block_stride,
    src_layer_stride,
    dst_rows_per_half,
    dst_block,
    dst_block_stride,
    dst_in_block_stride,
    dst_layer_stride,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    layer = first_layer + tl.program_id(1).to(tl.int64)
    half = tl.program_id(2).to(tl.int64)
    token_mask = tokens < n_tokens
    src_slot = tl.load(src_slots_ptr + tokens, mask=token_mask, other=0)
    dst_slot = tl.load(dst_slots_ptr + tokens, mask=token_mask, other=0)
    src_row = (
        half * src_rows_per_half
        + (src_slot // src_block) * src_block_stride
        + (src_slot % src_block) * src_in_block_stride
        + layer * src_layer_stride
    )
    dst_row = (
        half * dst_rows_per_half
        + (dst_slot // dst_block) * dst_block_stride
        + (dst_slot % dst_block) * dst_in_block_stride
        + layer * dst_layer_stride
    )
    src_base = src_row * row_words
    dst_base = dst_row * row_words
    for word0 in range(0, row_words, BLOCK_W):
        words = word0 + tl.arange(0, BLOCK_W)
        mask = token_mask[:, None] & (words < row_words)[None, :]
        values = tl.load(src_ptr + (src_base[:, None] + words[None, :]), mask=mask)
        tl.store(dst_ptr + (dst_base[:, None] + words[None, :]), values, mask=mask)


def is_interpreted() -> bool:
    """Whether the kernel was defined under ``TRITON_INTERPRET=1`` (runs on CPU tensors)."""
    return isinstance(_copy_rows_kernel, InterpretedFunction)


def load_layer(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    geometry: TransferGeometry,
    *,
    layer: int,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
) -> None:
    """Host rows of ``host_indices`` in ``layer`` -> device rows of ``device_indices``: one launch."""
    _launch(
        src=host_kv,
        dst=device_kv,
        src_rows=geometry.host_rows,
        dst_rows=geometry.device_rows,
        src_slots=host_indices,
        dst_slots=device_indices,
        geometry=geometry,
        first_layer=layer,
        layer_count=1,
    )


def backup(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    geometry: TransferGeometry,
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
) -> None:
    """Device slots ``device_indices`` -> host slots ``host_indices``, every layer: one launch."""
    _launch(
        src=device_kv,
        dst=host_kv,
        src_rows=geometry.device_rows,
        dst_rows=geometry.host_rows,
        src_slots=device_indices,
        dst_slots=host_indices,
        geometry=geometry,
        first_layer=0,
        layer_count=geometry.layers,
    )


def _launch(
    *,
    src: torch.Tensor,
    dst: torch.Tensor,
    src_rows: RowMap,
    dst_rows: RowMap,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    geometry: TransferGeometry,
    first_layer: int,
    layer_count: int,
) -> None:
    n_tokens = src_slots.numel()
    word_size, word_dtype = _word(src, dst, geometry.row_elems * src.element_size())
    row_words = geometry.row_elems * src.element_size() // word_size
    block_w = min(triton.next_power_of_2(row_words), _MAX_BLOCK_W)
    block_t = min(max(_TILE_WORDS // block_w, 1), triton.next_power_of_2(n_tokens))
    grid = (triton.cdiv(n_tokens, block_t), layer_count, geometry.halves)
    _copy_rows_kernel[grid](
        src.view(-1).view(word_dtype),
        dst.view(-1).view(word_dtype),
        src_slots,
        dst_slots,
        n_tokens,
        first_layer,
        row_words,
        src_rows.rows_per_half,
        src_rows.block,
        src_rows.block_stride,
        src_rows.in_block_stride,
        src_rows.layer_stride,
        dst_rows.rows_per_half,
        dst_rows.block,
        dst_rows.block_stride,
        dst_rows.in_block_stride,
        dst_rows.layer_stride,
        BLOCK_T=block_t,
        BLOCK_W=block_w,
        num_warps=4,
    )


def _word(src: torch.Tensor, dst: torch.Tensor, row_bytes: int) -> tuple[int, torch.dtype]:
    """Widest word that divides a row and both base addresses (so every word access is aligned)."""
    for size, dtype in _WORD_DTYPES:
        if row_bytes % size == 0 and src.data_ptr() % size == 0 and dst.data_ptr() % size == 0:
            return size, dtype
    raise AssertionError("a one-byte word always fits")
