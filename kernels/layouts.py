"""Host KV layouts and the row arithmetic every transfer backend shares.

The device KV is always layer-first, ``(halves, layers, device_slots, heads, head_dim)``: it is
what attention kernels read. The host pool may use one of three layouts (see
:class:`KVLayout`). Both backends (torch and Triton) see a KV tensor as ``halves`` blocks of
``rows_per_half`` rows, one row being the ``heads * head_dim`` elements of one token in one
layer. A :class:`RowMap` turns ``(slot, layer)`` into that row number, so a layout is a handful
of integers, and the torch path and the Triton kernel address memory with the same formula::

    row(slot, layer) = (slot // block) * block_stride
                     + (slot %  block) * in_block_stride
                     + layer * layer_stride

``block`` is 1 for the layer-first and page-first layouts (the formula reduces to
``slot * slot_stride + layer * layer_stride``) and the page size for ``page_first_direct``, whose
pages are stored as ``(layers, page_size)`` tiles.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch

from hicache_storage.errors import InvalidArgumentError


class KVLayout(str, enum.Enum):
    """Order of the host pool's dimensions (``halves`` is 2 for MHA K/V, 1 for MLA)."""

    LAYER_FIRST = "layer_first"
    """``(halves, layers, slots, heads, head_dim)``: the device order; a page is one run per layer."""
    PAGE_FIRST = "page_first"
    """``(halves, slots, layers, heads, head_dim)``: a page's K (or V) is one contiguous run."""
    PAGE_FIRST_DIRECT = "page_first_direct"
    """``(halves, slots // page_size, layers, page_size, heads, head_dim)``: a page-layer is one run."""


def host_shape(
    layout: KVLayout | str,
    *,
    halves: int,
    layers: int,
    slots: int,
    heads: int,
    head_dim: int,
    page_size: int,
) -> tuple[int, ...]:
    """Shape of a host pool of ``slots`` token slots in ``layout``.

    Raises :class:`~hicache_storage.errors.InvalidArgumentError` (a ``ValueError``) when a size
    is not positive, ``halves`` is not 1 or 2, or ``slots`` is not a multiple of ``page_size``.
    """
    layout = as_layout(layout)
    for name, value in (
        ("halves", halves),
        ("layers", layers),
        ("slots", slots),
        ("heads", heads),
        ("head_dim", head_dim),
        ("page_size", page_size),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    if halves not in (1, 2):
        raise InvalidArgumentError(f"halves must be 2 (MHA: K and V) or 1 (MLA: one latent buffer), got {halves}")
    if slots % page_size:
        raise InvalidArgumentError(
            f"slots ({slots}) must be a multiple of page_size ({page_size}): the host pool holds whole pages"
        )
    if layout is KVLayout.LAYER_FIRST:
        return (halves, layers, slots, heads, head_dim)
    if layout is KVLayout.PAGE_FIRST:
        return (halves, slots, layers, heads, head_dim)
    return (halves, slots // page_size, layers, page_size, heads, head_dim)


def as_layout(layout: KVLayout | str) -> KVLayout:
    """``layout`` as a :class:`KVLayout`; an unknown name raises ``InvalidArgumentError``."""
    try:
        return KVLayout(layout)
    except ValueError:
        known = ", ".join(item.value for item in KVLayout)
        raise InvalidArgumentError(f"unknown KV layout {layout!r}; expected one of: {known}") from None


@dataclass(frozen=True)
class RowMap:
    """Where the row of ``(slot, layer)`` lies inside one half of a KV tensor (see module doc)."""

    block: int
    block_stride: int
    in_block_stride: int
    layer_stride: int
    rows_per_half: int

    def rows(self, slots: torch.Tensor, layer: int | torch.Tensor) -> torch.Tensor:
        """Row numbers of ``slots`` (int64) in ``layer``; broadcasts like ordinary tensor math."""
        return (
            torch.div(slots, self.block, rounding_mode="floor") * self.block_stride
            + torch.remainder(slots, self.block) * self.in_block_stride
            + layer * self.layer_stride
        )


@dataclass(frozen=True)
class TransferGeometry:
    """Sizes shared by a device KV tensor and the host pool it is paired with (validated)."""

    halves: int
    layers: int
    device_slots: int
    host_slots: int
    row_elems: int
    device_rows: RowMap
    host_rows: RowMap


def device_row_map(layers: int, slots: int) -> RowMap:
    """Row map of a layer-first tensor ``(halves, layers, slots, ...)``."""
    return RowMap(block=1, block_stride=1, in_block_stride=0, layer_stride=slots, rows_per_half=layers * slots)


def host_row_map(layout: KVLayout, *, layers: int, slots: int, page_size: int) -> RowMap:
    """Row map of a host pool of ``slots`` slots in ``layout`` (shape from :func:`host_shape`)."""
    rows = layers * slots
    if layout is KVLayout.LAYER_FIRST:
        return device_row_map(layers, slots)
    if layout is KVLayout.PAGE_FIRST:
        return RowMap(block=1, block_stride=layers, in_block_stride=0, layer_stride=1, rows_per_half=rows)
    return RowMap(
        block=page_size,
        block_stride=layers * page_size,
        in_block_stride=1,
        layer_stride=page_size,
        rows_per_half=rows,
    )


def transfer_geometry(
    device_kv: torch.Tensor, host_kv: torch.Tensor, layout: KVLayout | str, page_size: int
) -> TransferGeometry:
    """Check that ``device_kv`` (layer-first) and ``host_kv`` (``layout``) fit together.

    Both must be contiguous, of one dtype, and agree on halves, layers, heads and head_dim; the
    host shape must be exactly ``host_shape(layout, ...)``. Raises ``InvalidArgumentError``
    naming the mismatch otherwise.
    """
    if host_kv.dtype != device_kv.dtype:
        raise InvalidArgumentError(
            f"host_kv dtype {host_kv.dtype} differs from device_kv dtype {device_kv.dtype}; "
            "transfers move bytes and never convert"
        )
    if device_kv.element_size() not in (1, 2, 4, 8):
        raise InvalidArgumentError(f"KV dtype {device_kv.dtype} is not 1, 2, 4 or 8 bytes wide")
    for name, tensor in (("device_kv", device_kv), ("host_kv", host_kv)):
        if not tensor.is_contiguous():
            raise InvalidArgumentError(f"{name} must be contiguous (allocate the pool as one tensor)")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
        raise InvalidArgumentError(f"page_size must be a positive int, got {page_size!r}")
    return _geometry(tuple(device_kv.shape), tuple(host_kv.shape), layout, page_size)


# Called once per layer per transfer with the same few pools: the shape arithmetic and its
# checks run once per distinct (shapes, layout, page size). Failures raise and are not cached.
@functools.lru_cache(maxsize=64)
def _geometry(
    device_shape: tuple[int, ...], host_kv_shape: tuple[int, ...], layout: KVLayout | str, page_size: int
) -> TransferGeometry:
    layout = as_layout(layout)
    if len(device_shape) != 5:
        raise InvalidArgumentError(
            f"device_kv must be 5-D (halves, layers, device_slots, heads, head_dim), got shape {device_shape}"
        )
    halves, layers, device_slots, heads, head_dim = device_shape
    host_slots = _host_slots(host_kv_shape, layout, page_size)
    if host_slots % page_size:
        raise InvalidArgumentError(
            f"host_kv shape {host_kv_shape} does not match layout {layout.value} with page_size "
            f"{page_size}: its slot count ({host_slots}) is not a multiple of page_size"
        )
    expected = host_shape(
        layout,
        halves=halves,
        layers=layers,
        slots=host_slots,
        heads=heads,
        head_dim=head_dim,
        page_size=page_size,
    )
    if host_kv_shape != expected:
        raise InvalidArgumentError(
            f"host_kv shape {host_kv_shape} does not match device_kv shape {device_shape} "
            f"in layout {layout.value} with page_size {page_size}: expected {expected}"
        )
    return TransferGeometry(
        halves=halves,
        layers=layers,
        device_slots=device_slots,
        host_slots=host_slots,
        row_elems=heads * head_dim,
        device_rows=device_row_map(layers, device_slots),
        host_rows=host_row_map(layout, layers=layers, slots=host_slots, page_size=page_size),
    )


def _host_slots(host_kv_shape: tuple[int, ...], layout: KVLayout, page_size: int) -> int:
    wanted_dims = 6 if layout is KVLayout.PAGE_FIRST_DIRECT else 5
    if len(host_kv_shape) != wanted_dims:
        raise InvalidArgumentError(
            f"host_kv in layout {layout.value} must be {wanted_dims}-D, got shape {host_kv_shape}"
        )
    if layout is KVLayout.LAYER_FIRST:
        return host_kv_shape[2]
    if layout is KVLayout.PAGE_FIRST:
        return host_kv_shape[1]
    return host_kv_shape[1] * page_size
