"""The plain way to move KV slots: one ``copy_`` per contiguous run, per layer, per half.

This is deliberately independent of :class:`~.layouts.RowMap`: it addresses the host pool with
ordinary tensor indexing in each layout's own dimension order. That makes it

* the oracle the tests hold both backends to, and
* the ``cudaMemcpyAsync`` baseline of ``benchmarks/kernels_gpu.py``: with page-aligned indices a
  run is one page, so a call issues ``pages x halves`` copies (``x layers`` for a backup), the
  cost the one-launch Triton kernel removes.

A run is a stretch of slots consecutive on both sides (and, for ``page_first_direct``, inside
one host page, where consecutive slots are adjacent in memory). Plan the runs once with
:func:`contiguous_runs`; planning walks the indices in Python and is not part of a transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layouts import KVLayout, as_layout


@dataclass(frozen=True)
class Run:
    """``length`` slots from ``device_start`` on the device pair with those from ``host_start``."""

    device_start: int
    host_start: int
    length: int


def contiguous_runs(
    device_indices: torch.Tensor, host_indices: torch.Tensor, layout: KVLayout | str, page_size: int
) -> list[Run]:
    """Split the index pairs into maximal runs that one ``copy_`` per layer and half can move."""
    split_at_pages = as_layout(layout) is KVLayout.PAGE_FIRST_DIRECT
    runs: list[Run] = []
    length = 0
    device_start = host_start = -1
    for device_slot, host_slot in zip(device_indices.tolist(), host_indices.tolist(), strict=True):
        extends = (
            length > 0
            and device_slot == device_start + length
            and host_slot == host_start + length
            and not (split_at_pages and host_slot % page_size == 0)
        )
        if extends:
            length += 1
            continue
        if length:
            runs.append(Run(device_start, host_start, length))
        device_start, host_start, length = device_slot, host_slot, 1
    if length:
        runs.append(Run(device_start, host_start, length))
    return runs


def load_layer(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    runs: list[Run],
    *,
    layer: int,
    layout: KVLayout | str,
    page_size: int,
) -> None:
    """Host -> device for one layer: one ``copy_`` per run and half (asynchronous from pinned memory)."""
    layout = as_layout(layout)
    for half in range(device_kv.shape[0]):
        for run in runs:
            device_run = device_kv[half, layer, run.device_start : run.device_start + run.length]
            device_run.copy_(host_run(host_kv, layout, half, layer, run, page_size), non_blocking=True)


def backup(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    runs: list[Run],
    *,
    layout: KVLayout | str,
    page_size: int,
) -> None:
    """Device -> host for every layer: one ``copy_`` per run, layer and half."""
    layout = as_layout(layout)
    for half in range(device_kv.shape[0]):
        for layer in range(device_kv.shape[1]):
            for run in runs:
                device_run = device_kv[half, layer, run.device_start : run.device_start + run.length]
                host_run(host_kv, layout, half, layer, run, page_size).copy_(device_run, non_blocking=True)


def host_run(host_kv: torch.Tensor, layout: KVLayout, half: int, layer: int, run: Run, page_size: int) -> torch.Tensor:
    """View of ``run``'s host slots in one layer and half (contiguous except for page_first)."""
    end = run.host_start + run.length
    if layout is KVLayout.LAYER_FIRST:
        return host_kv[half, layer, run.host_start : end]
    if layout is KVLayout.PAGE_FIRST:
        return host_kv[half, run.host_start : end, layer]
    page, offset = divmod(run.host_start, page_size)
    return host_kv[half, page, layer, offset : offset + run.length]
