"""Transfers with stock torch ops, the backend everywhere Triton does not run.

* Both tensors in host memory (the CPU engine): :mod:`.cpu_transfer` copies each run of
  consecutive slots in place, one ``numpy.copyto`` per run, on the calling thread and idle
  helpers.
* A device KV on an accelerator with a host pool (Triton unavailable): one gather
  (``index_select``), one ``Tensor.to`` copy across, one scatter (``index_copy_``): a fixed
  handful of vectorized ops whatever the number of pages or layers. The staging copy is why the
  Triton path, which reads and writes the pinned pool in place, exists.

Both tensors are viewed as integers (or bytes) of the same width first: the copy moves bits,
never converts values (NaN payloads and float8 codes survive), and dtypes without CPU index
kernels (float8) work.

Indices must already be int64 and validated (see ``dispatch``); a slot listed twice among the
destination indices gets one of the written rows, which one is unspecified.
"""

from __future__ import annotations

import torch

from . import cpu_transfer
from .layouts import TransferGeometry

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(_SAME_WIDTH_INT[tensor.element_size()])


def load_layer(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    geometry: TransferGeometry,
    *,
    layer: int,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
) -> None:
    """Copy ``host_kv`` rows of ``host_indices`` in ``layer`` to ``device_kv`` rows of ``device_indices``."""
    if _both_on_cpu(device_kv, host_kv):
        cpu_transfer.load_layer(
            device_kv, host_kv, geometry, layer=layer, device_indices=device_indices, host_indices=host_indices
        )
        return
    device_kv, host_kv = _bits(device_kv), _bits(host_kv)
    host_flat = host_kv.view(geometry.halves, geometry.host_rows.rows_per_half, geometry.row_elems)
    host_rows = geometry.host_rows.rows(host_indices.to(host_kv.device), layer)
    gathered = host_flat.index_select(1, host_rows).to(device_kv.device, non_blocking=True)
    device_layer = device_kv[:, layer].view(geometry.halves, geometry.device_slots, geometry.row_elems)
    device_layer.index_copy_(1, device_indices.to(device_kv.device), gathered)


def load(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    geometry: TransferGeometry,
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
) -> None:
    """Copy every layer of ``host_kv`` slots ``host_indices`` to ``device_kv`` slots ``device_indices``."""
    if _both_on_cpu(device_kv, host_kv):
        cpu_transfer.load(device_kv, host_kv, geometry, device_indices=device_indices, host_indices=host_indices)
        return
    device_kv, host_kv = _bits(device_kv), _bits(host_kv)
    # Rows in layer-major order on both sides: layer l's slots, then layer l + 1's.
    layers = torch.arange(geometry.layers, dtype=torch.int64, device=host_kv.device).unsqueeze(1)
    host_rows = geometry.host_rows.rows(host_indices.to(host_kv.device).unsqueeze(0), layers).reshape(-1)
    host_flat = host_kv.view(geometry.halves, geometry.host_rows.rows_per_half, geometry.row_elems)
    gathered = host_flat.index_select(1, host_rows).to(device_kv.device, non_blocking=True)
    device_layers = layers.to(device_kv.device) * geometry.device_slots
    device_rows = (device_layers + device_indices.to(device_kv.device).unsqueeze(0)).reshape(-1)
    device_flat = device_kv.view(geometry.halves, geometry.layers * geometry.device_slots, geometry.row_elems)
    device_flat.index_copy_(1, device_rows, gathered)


def backup(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    geometry: TransferGeometry,
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
) -> None:
    """Copy every layer of ``device_kv`` slots ``device_indices`` to ``host_kv`` slots ``host_indices``."""
    if _both_on_cpu(device_kv, host_kv):
        cpu_transfer.backup(device_kv, host_kv, geometry, device_indices=device_indices, host_indices=host_indices)
        return
    device_kv, host_kv = _bits(device_kv), _bits(host_kv)
    count = device_indices.numel()
    device_flat = device_kv.view(geometry.halves, geometry.layers, geometry.device_slots, geometry.row_elems)
    # (halves, layers, count, row) in layer-major order, matching the host row numbers below.
    gathered = device_flat.index_select(2, device_indices.to(device_kv.device))
    gathered = gathered.view(geometry.halves, geometry.layers * count, geometry.row_elems)
    layers = torch.arange(geometry.layers, dtype=torch.int64, device=host_kv.device).unsqueeze(1)
    host_rows = geometry.host_rows.rows(host_indices.to(host_kv.device).unsqueeze(0), layers).reshape(-1)
    host_flat = host_kv.view(geometry.halves, geometry.host_rows.rows_per_half, geometry.row_elems)
    host_flat.index_copy_(1, host_rows, gathered.to(host_kv.device))


def _both_on_cpu(device_kv: torch.Tensor, host_kv: torch.Tensor) -> bool:
    return device_kv.device.type == "cpu" and host_kv.device.type == "cpu"
