"""The torch backend when both KV tensors are in host memory: copy runs of slots, in place.

The engine's indices are whole pages, often several consecutive ones, so a transfer is a list of
*runs*: stretches of slots consecutive on both sides (for ``page_first_direct`` also inside one
host page). A run of one layer is one strided block in each tensor, so it moves with one
``numpy.copyto`` from source to destination: no staging buffer, no per-element index kernel, a
``memmove`` per row or per page-layer. The Python cost is one call per run (a load moves one layer,
so ``runs`` calls; a backup moves every layer of a run in one call), small next to a page's bytes.
Few calls matter more than a faster loop: each call gives the GIL away and must win it back from
the engine's other threads. A page_first backup once used torch's strided ``copy_`` in pieces
under torch's parallel grain (15 calls for a 2-page sliding window of 43 layers): in the hybrid
long-history bench that copy took 13-20 ms against 2-7 ms as one ``copyto`` per run, which
measured as fast or faster alone (docs/kernels.md).

Slots left in runs shorter than :data:`MIN_RUN_SLOTS` (scattered slots, odd alignments) move with
one vectorized row gather and scatter instead, so any order and alignment still work.

Everything runs on the calling thread, and calls are thread-safe (each builds its own views; the
only shared state is a per-thread plan cache). Splitting a transfer across helper threads
(numpy releases the GIL while it copies) was measured and lost here: on 2 shared cores with the
engine's compute thread beside the loader, a helper descheduled mid-chunk holds up the whole
call, and the serial copies were faster in 42 of 48 benchmark cases (``docs/kernels.md``).

Tensors are viewed as bytes: values are never converted (NaN payloads and float8 codes survive).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from .layouts import RowMap, TransferGeometry

#: Runs shorter than this many slots move with the row gather/scatter (one call per run would
#: cost more than the row copies it saves).
MIN_RUN_SLOTS = 4


@dataclass(frozen=True)
class Runs:
    """Index pairs split into runs (``device_starts[i]``, ``host_starts[i]``, ``lengths[i]``)
    plus the slots of the runs too short to copy one by one (``device_rest``, ``host_rest``)."""

    device_starts: list[int]
    host_starts: list[int]
    lengths: list[int]
    device_rest: np.ndarray
    host_rest: np.ndarray


def plan_runs(device_indices: torch.Tensor, host_indices: torch.Tensor, block: int) -> Runs:
    """Split int64 index lists into maximal runs; ``block`` > 1 splits runs at host blocks.

    A load calls this once per layer with the same lists: the last plan of each thread is kept
    with a copy of its lists and reused when the contents match (a comparison costs far less than
    planning, and a list changed in place, by any route, is never mistaken for the old one).
    """
    device = device_indices.cpu().numpy()  # no copy for CPU lists, the ones the engine passes
    host = host_indices.cpu().numpy()
    last = getattr(_last_plan, "value", None)
    if (
        last is not None
        and last[0] == block
        and np.array_equal(last[1], device)
        and np.array_equal(last[2], host)
    ):
        return last[3]
    breaks = np.ones(device.size, dtype=bool)
    np.not_equal(np.diff(device), 1, out=breaks[1:])
    breaks[1:] |= np.diff(host) != 1
    if block > 1:
        breaks[1:] |= host[1:] % block == 0
    starts = np.flatnonzero(breaks)
    lengths = np.diff(starts, append=device.size)
    long = lengths >= MIN_RUN_SLOTS
    if long.all():
        rest = np.empty(0, dtype=np.int64)
        device_rest = host_rest = rest
    else:
        short_slots = np.repeat(~long, lengths)
        device_rest, host_rest = device[short_slots], host[short_slots]
        starts, lengths = starts[long], lengths[long]
    runs = Runs(
        device_starts=device[starts].tolist(),
        host_starts=host[starts].tolist(),
        lengths=lengths.tolist(),
        device_rest=device_rest,
        host_rest=host_rest,
    )
    _last_plan.value = (block, device.copy(), host.copy(), runs)
    return runs


_last_plan = threading.local()


def load_layer(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    geometry: TransferGeometry,
    *,
    layer: int,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
) -> None:
    """Copy ``host_kv`` slots ``host_indices`` of ``layer`` to ``device_kv`` slots ``device_indices``."""
    hmap = geometry.host_rows
    runs = plan_runs(device_indices, host_indices, hmap.block)
    device = _device_view(device_kv, geometry)
    host_rows = _rows(host_kv, geometry.halves, hmap.rows_per_half)
    device_layer = device[:, layer]
    run_list = zip(runs.device_starts, runs.host_starts, runs.lengths)
    if hmap.block == 1:
        host_layer = _slot_view(host_rows, geometry)[:, :, layer]
        for d, h, n in run_list:
            np.copyto(device_layer[:, d : d + n], host_layer[:, h : h + n])
    else:
        host_blocks = _block_view(host_rows, geometry)
        block = hmap.block
        for d, h, n in run_list:
            offset = h % block
            np.copyto(device_layer[:, d : d + n], host_blocks[:, h // block, layer, offset : offset + n])
    if runs.device_rest.size:
        rows = device.reshape(geometry.halves, -1, device.shape[-1])
        device_rows = runs.device_rest + layer * geometry.device_slots
        rows[:, device_rows] = host_rows[:, _host_row_numbers(hmap, runs.host_rest, layer)]


def load(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    geometry: TransferGeometry,
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
) -> None:
    """Copy every layer of ``host_kv`` slots ``host_indices`` to ``device_kv`` slots ``device_indices``:
    one call per run for all layers (a per-layer load makes one per run and layer)."""
    _all_layers(device_kv, host_kv, geometry, device_indices, host_indices, to_host=False)


def backup(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    geometry: TransferGeometry,
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
) -> None:
    """Copy every layer of ``device_kv`` slots ``device_indices`` to ``host_kv`` slots ``host_indices``."""
    _all_layers(device_kv, host_kv, geometry, device_indices, host_indices, to_host=True)


def _all_layers(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    geometry: TransferGeometry,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    *,
    to_host: bool,
) -> None:
    """Copy every layer of the slots between the device and the host, one way or the other: one
    ``numpy.copyto`` per run, then the short runs' rows with one gather and scatter."""
    runs = plan_runs(device_indices, host_indices, geometry.host_rows.block)
    device = _device_view(device_kv, geometry)
    host_rows = _rows(host_kv, geometry.halves, geometry.host_rows.rows_per_half)
    hmap = geometry.host_rows
    if hmap.block == 1:
        # (halves, layers, slots, row): the slot view with layers moved in front, like the device.
        host_layers = _slot_view(host_rows, geometry).transpose(0, 2, 1, 3)
        host_runs = (host_layers[:, :, h : h + n] for h, n in zip(runs.host_starts, runs.lengths))
    else:
        host_blocks, block = _block_view(host_rows, geometry), hmap.block
        host_runs = (host_blocks[:, h // block, :, h % block : h % block + n] for h, n in zip(runs.host_starts, runs.lengths))
    for d, n, host in zip(runs.device_starts, runs.lengths, host_runs):
        if to_host:
            np.copyto(host, device[:, :, d : d + n])
        else:
            np.copyto(device[:, :, d : d + n], host)
    if runs.device_rest.size:
        layers = np.arange(geometry.layers, dtype=np.int64)[:, None]
        device_rows = (layers * geometry.device_slots + runs.device_rest).reshape(-1)
        host_row_numbers = _host_row_numbers(hmap, runs.host_rest, layers).reshape(-1)
        rows = device.reshape(geometry.halves, -1, device.shape[-1])
        if to_host:
            host_rows[:, host_row_numbers] = rows[:, device_rows]
        else:
            rows[:, device_rows] = host_rows[:, host_row_numbers]


def _rows(tensor: torch.Tensor, halves: int, rows_per_half: int) -> np.ndarray:
    """``tensor``'s bytes as ``(halves, rows_per_half, row_bytes)``, sharing its memory."""
    return tensor.detach().view(torch.uint8).numpy().reshape(halves, rows_per_half, -1)


def _device_view(device_kv: torch.Tensor, geometry: TransferGeometry) -> np.ndarray:
    """The device KV as bytes, ``(halves, layers, device_slots, row_bytes)``."""
    rows = _rows(device_kv, geometry.halves, geometry.device_rows.rows_per_half)
    return rows.reshape(geometry.halves, geometry.layers, geometry.device_slots, -1)


def _slot_view(host_rows: np.ndarray, geometry: TransferGeometry) -> np.ndarray:
    """A host pool whose row map has ``block == 1`` as ``(halves, slots, layers, row_bytes)``."""
    halves, _, row_bytes = host_rows.shape
    rows = geometry.host_rows
    return np.lib.stride_tricks.as_strided(
        host_rows,
        shape=(halves, geometry.host_slots, geometry.layers, row_bytes),
        strides=(host_rows.strides[0], rows.block_stride * row_bytes, rows.layer_stride * row_bytes, 1),
        writeable=True,
    )


def _block_view(host_rows: np.ndarray, geometry: TransferGeometry) -> np.ndarray:
    """A paged host pool (``block > 1``) as ``(halves, slots // block, layers, block, row_bytes)``."""
    halves, _, row_bytes = host_rows.shape
    rows = geometry.host_rows
    return np.lib.stride_tricks.as_strided(
        host_rows,
        shape=(halves, geometry.host_slots // rows.block, geometry.layers, rows.block, row_bytes),
        strides=(
            host_rows.strides[0],
            rows.block_stride * row_bytes,
            rows.layer_stride * row_bytes,
            rows.in_block_stride * row_bytes,
            1,
        ),
        writeable=True,
    )


def _host_row_numbers(rows: RowMap, slots: np.ndarray, layer: int | np.ndarray) -> np.ndarray:
    """:meth:`RowMap.rows` on numpy arrays (same formula, same broadcasting)."""
    return (
        (slots // rows.block) * rows.block_stride
        + (slots % rows.block) * rows.in_block_stride
        + layer * rows.layer_stride
    )
