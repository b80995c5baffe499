"""CPU check of the KV transfer kernels: the torch backend next to a plain copy of the same bytes.

:func:`measure_cpu_transfers` times, per host layout, dtype, page count and index pattern,

* ``load``: :func:`~hicache_storage.kernels.load_layer` once per layer (as the core loads), host -> device;
* ``backup``: :func:`~hicache_storage.kernels.backup` once (every layer), device -> host;
* ``copy_``: ``torch.Tensor.copy_`` of the same number of bytes between the same two pools,
  contiguous, in the same number of calls (one per layer for a load, one for a backup);
* ``copyto``: the same with ``numpy.copyto`` (one thread; torch's ``copy_`` uses the intra-op
  threads, whose static split stalls when another process holds a core),

and verifies a sample of every measured transfer bit for bit. Each repetition times all of them
back to back, so a ratio compares runs under the same machine load; the report gives the median
GB/s and the median per-repetition ratio. Speeds on a shared machine drift several-fold between
runs: read the ratios, and never assert on a time.

Usage::

    python benchmarks/kernels_cpu.py --out results/kernels_cpu
    python benchmarks/kernels_cpu.py --dtypes bfloat16 --pages 64 --patterns fragmented --repeats 3
    python -m hicache_storage.benchmarks.kernels_cpu --out results/kernels_cpu

Writes ``kernels_cpu.json`` and ``kernels_cpu.md`` into ``--out`` and prints the table; the exit
status is non-zero if a spot check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache_storage.kernels.dispatch import backup, load_layer
from hicache_storage.kernels.layouts import KVLayout, as_layout, host_shape, transfer_geometry

PATTERNS = ("fragmented", "coalesced", "slots")
"""``fragmented``: whole pages at random distinct positions on both sides (one run per page);
``coalesced``: one stretch of consecutive pages on both sides (one run); ``slots``: as many random
single token slots (no runs: the row gather/scatter path)."""


@dataclass(frozen=True)
class TransferTiming:
    layout: str
    dtype: str
    halves: int
    layers: int
    pages: int
    pattern: str
    direction: str
    bytes: int
    gbps: float
    copy_gbps: float
    copyto_gbps: float
    ratio_to_copy: float
    ratio_to_copyto: float
    verified: bool


def measure_cpu_transfers(
    *,
    layers: int = 28,
    heads: int = 4,
    head_dim: int = 128,
    mla: bool = False,
    dtypes: Sequence[torch.dtype | str] = ("float8_e4m3fn", "bfloat16"),
    page_size: int = 64,
    pages: Sequence[int] = (64, 256),
    layouts: Sequence[KVLayout | str] = tuple(KVLayout),
    patterns: Sequence[str] = ("fragmented", "coalesced"),
    repeats: int = 5,
    seed: int = 0,
) -> dict:
    """Time CPU load/backup against ``copy_`` and ``copyto`` of the same bytes (see module doc).

    ``mla=True`` uses one latent buffer (``halves=1``, ``heads`` forced to 1). The pools hold twice
    the largest page count, so a run needs about ``4 * max(pages) * page_size`` token-bytes of RAM
    (28 layers x 4 heads x 128 x bf16 at 256 pages of 64: 3.8 GB). Returns a JSON-ready dict:
    ``config``, ``machine`` and ``results`` (one :class:`TransferTiming` as a dict per
    layout x dtype x pages x pattern x direction); ``verified`` says a sample of the moved pages
    matched bit for bit.
    """
    for pattern in patterns:
        if pattern not in PATTERNS:
            raise ValueError(f"unknown index pattern {pattern!r}; expected one of {', '.join(PATTERNS)}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    halves, heads = (1, 1) if mla else (2, heads)
    pool_pages = 2 * max(pages)
    slots = pool_pages * page_size
    generator = torch.Generator().manual_seed(seed)
    results: list[TransferTiming] = []
    for dtype in (_dtype(d) for d in dtypes):
        device_kv = _filled((halves, layers, slots, heads, head_dim), dtype, generator)
        host_storage = _filled((device_kv.numel(),), dtype, generator)
        for layout in (as_layout(item) for item in layouts):
            shape = host_shape(
                layout, halves=halves, layers=layers, slots=slots, heads=heads, head_dim=head_dim, page_size=page_size
            )
            host_kv = host_storage.view(shape)
            for count in pages:
                for pattern in patterns:
                    device_idx, host_idx = _indices(pattern, count, pool_pages, page_size, generator)
                    results += _time_case(
                        device_kv, host_kv, layout, page_size, device_idx, host_idx, count, pattern, repeats
                    )
        del device_kv, host_storage
    return {
        "config": {
            "layers": layers,
            "heads": heads,
            "head_dim": head_dim,
            "halves": halves,
            "page_size": page_size,
            "repeats": repeats,
            "torch_threads": torch.get_num_threads(),
        },
        "machine": {"cpus": _cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "results": [asdict(row) for row in results],
    }


def _time_case(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    layout: KVLayout,
    page_size: int,
    device_idx: torch.Tensor,
    host_idx: torch.Tensor,
    pages: int,
    pattern: str,
    repeats: int,
) -> list[TransferTiming]:
    layers = device_kv.shape[1]
    row_bytes = device_kv[0, 0, 0].numel() * device_kv.element_size()
    layer_bytes = device_kv.shape[0] * device_idx.numel() * row_bytes
    args: dict[str, Any] = dict(device_indices=device_idx, host_indices=host_idx, layout=layout, page_size=page_size, backend="torch")

    def load() -> None:
        for layer in range(layers):
            load_layer(device_kv, host_kv, layer=layer, **args)

    def store() -> None:
        backup(device_kv, host_kv, **args)

    # The same bytes between the same pools, contiguous: the bound a gather/scatter aims at.
    source = host_kv.view(-1).view(torch.uint8)[: layers * layer_bytes]
    target = device_kv.view(-1).view(torch.uint8)[: layers * layer_bytes]
    source_np, target_np = source.numpy(), target.numpy()
    per_layer = [slice(layer * layer_bytes, (layer + 1) * layer_bytes) for layer in range(layers)]

    def copy_layers() -> None:
        for part in per_layer:
            target[part].copy_(source[part])

    def copyto_layers() -> None:
        for part in per_layer:
            np.copyto(target_np[part], source_np[part])

    def copy_all() -> None:
        source.copy_(target)

    def copyto_all() -> None:
        np.copyto(source_np, target_np)

    timings = {
        "load": _repeat({"op": load, "copy_": copy_layers, "copyto": copyto_layers}, repeats),
        "backup": _repeat({"op": store, "copy_": copy_all, "copyto": copyto_all}, repeats),
    }
    verified = _verify(device_kv, host_kv, layout, page_size, device_idx, host_idx, load, store)
    total = layers * layer_bytes
    rows = []
    for direction, seconds in timings.items():
        rows.append(
            TransferTiming(
                layout=layout.value,
                dtype=str(device_kv.dtype).removeprefix("torch."),
                halves=device_kv.shape[0],
                layers=layers,
                pages=pages,
                pattern=pattern,
                direction=direction,
                bytes=total,
                gbps=total / statistics.median(seconds["op"]) / 1e9,
                copy_gbps=total / statistics.median(seconds["copy_"]) / 1e9,
                copyto_gbps=total / statistics.median(seconds["copyto"]) / 1e9,
                ratio_to_copy=statistics.median(c / o for c, o in zip(seconds["copy_"], seconds["op"])),
                ratio_to_copyto=statistics.median(c / o for c, o in zip(seconds["copyto"], seconds["op"])),
                verified=verified,
            )
        )
    return rows


def _repeat(calls: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call per repetition, the calls interleaved; one untimed warm-up round first."""
    for call in calls.values():
        call()
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - started)
    return seconds


def _verify(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    layout: KVLayout,
    page_size: int,
    device_idx: torch.Tensor,
    host_idx: torch.Tensor,
    load: Callable[[], None],
    store: Callable[[], None],
) -> bool:
    """After a backup, and after a load over scrambled device slots, a sample of slots matches."""
    geometry = transfer_geometry(device_kv, host_kv, layout, page_size)
    sample = torch.linspace(0, device_idx.numel() - 1, min(64, device_idx.numel())).long()
    layers = torch.arange(geometry.layers).unsqueeze(1)
    device_rows = (layers * geometry.device_slots + device_idx[sample]).reshape(-1)
    host_rows = geometry.host_rows.rows(host_idx[sample].unsqueeze(0), layers).reshape(-1)

    def agree() -> bool:
        device = device_kv.view(torch.uint8).view(geometry.halves, geometry.device_rows.rows_per_half, -1)
        host = host_kv.view(torch.uint8).view(geometry.halves, geometry.host_rows.rows_per_half, -1)
        return torch.equal(device[:, device_rows], host[:, host_rows])

    device_kv.view(torch.uint8).view(geometry.halves, geometry.device_rows.rows_per_half, -1)[:, device_rows] ^= 0x5A
    store()
    backed_up = agree()
    device_kv.view(torch.uint8).view(geometry.halves, geometry.device_rows.rows_per_half, -1)[:, device_rows] ^= 0x5A
    changed = not agree()
    load()
    return backed_up and changed and agree()


def _indices(
    pattern: str, pages: int, pool_pages: int, page_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.arange(page_size)
    if pattern == "slots":
        slots = pool_pages * page_size
        count = pages * page_size
        return torch.randperm(slots, generator=generator)[:count], torch.randperm(slots, generator=generator)[:count]
    if pattern == "coalesced":
        device_pages = torch.arange(pages) + int(torch.randint(0, pool_pages - pages + 1, (), generator=generator))
        host_pages = torch.arange(pages) + int(torch.randint(0, pool_pages - pages + 1, (), generator=generator))
    else:
        device_pages = torch.randperm(pool_pages, generator=generator)[:pages]
        host_pages = torch.randperm(pool_pages, generator=generator)[:pages]
    return (
        (device_pages[:, None] * page_size + offsets).reshape(-1),
        (host_pages[:, None] * page_size + offsets).reshape(-1),
    )


def _filled(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """A tensor of pseudo-random bytes (a random block of odd length, repeated): every page differs."""
    tensor = torch.empty(shape, dtype=dtype)
    flat = tensor.view(-1).view(torch.uint8)
    block = torch.randint(0, 256, ((1 << 20) + 7,), dtype=torch.uint8, generator=generator)
    for start in range(0, flat.numel(), block.numel()):
        part = flat[start : start + block.numel()]
        part.copy_(block[: part.numel()])
    return tensor


def _dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {value!r} (examples: bfloat16, float16, float8_e4m3fn)")
    return dtype


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def format_table(report: dict) -> str:
    """The report as a Markdown table: GB/s of the transfer, of ``copy_`` and of ``copyto`` of the
    same bytes, and the median per-repetition ratios."""
    lines = [
        "| layout | dtype | pages | indices | direction | GB/s | copy_ GB/s | copyto GB/s "
        "| x copy_ | x copyto | verified |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        lines.append(
            f"| {row['layout']} | {row['dtype']} | {row['pages']} | {row['pattern']} | {row['direction']} "
            f"| {row['gbps']:.2f} | {row['copy_gbps']:.2f} | {row['copyto_gbps']:.2f} "
            f"| {row['ratio_to_copy']:.2f} | {row['ratio_to_copyto']:.2f} | {'yes' if row['verified'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for kernels_cpu.json and .md")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=4, help="KV heads (ignored with --mla)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--mla", action="store_true", help="one latent buffer per token (halves=1, heads=1)")
    parser.add_argument("--dtypes", default="float8_e4m3fn,bfloat16")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--pages", default="64,256", help="pages per call, comma-separated")
    parser.add_argument("--layouts", default=",".join(layout.value for layout in KVLayout))
    parser.add_argument("--patterns", default="fragmented,coalesced", help=f"any of {', '.join(PATTERNS)}")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    try:
        report = measure_cpu_transfers(
            layers=args.layers,
            heads=args.heads,
            head_dim=args.head_dim,
            mla=args.mla,
            dtypes=_names(args.dtypes),
            page_size=args.page_size,
            pages=_counts(args.pages),
            layouts=_names(args.layouts),
            patterns=_names(args.patterns),
            repeats=args.repeats,
        )
    except ValueError as err:
        print(f"kernels_cpu: {err}", file=sys.stderr)
        return 2
    table = format_table(report)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernels_cpu.json").write_text(json.dumps(report, indent=2) + "\n")
        config = ", ".join(f"{key}={value}" for key, value in report["config"].items())
        (args.out / "kernels_cpu.md").write_text(f"# CPU transfer kernels\n\n{config}\n\n{table}\n")
    return 0 if all(row["verified"] for row in report["results"]) else 1


def _names(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _counts(value: str) -> list[int]:
    names = _names(value)
    if not names or not all(name.isdigit() and int(name) > 0 for name in names):
        raise ValueError(f"--pages takes comma-separated positive integers (e.g. 64,256), got {value!r}")
    return [int(name) for name in names]


if __name__ == "__main__":
    sys.exit(main())
