"""GPU check of the KV transfer kernels: correctness first, then GB/s side by side.

On a CUDA machine this script

1. checks, bit for bit, every layout x dtype (bf16, fp16, fp32, uint8, float8) x MHA/MLA x
   index pattern: the Triton kernels (device KV on the GPU, host pool pinned) and the torch
   backend against the copy-per-run oracle (``hicache_storage.kernels.reference``);
2. measures, for realistic shapes (8 KV heads x 128 dims, bf16, page 64, 32 and 64 layers,
   1 to 4096 scattered pages), the throughput of
   * ``triton``: the one-launch kernels (``load_layer`` once per layer, ``backup`` once),
   * ``copy_per_page``: one ``Tensor.copy_`` (a ``cudaMemcpyAsync``) per page, half and layer,
   * ``torch_gather_scatter``: the torch backend (gather on one side, one copy, scatter),
   and spot-checks every measured transfer;
3. writes ``kernels_gpu.json`` and ``kernels_gpu.md`` into ``--out``.

``--dry-run`` runs the same code end to end on the CPU with tiny shapes (the Triton method is
included only where it can run, i.e. under ``TRITON_INTERPRET=1``), so the script cannot rot
unnoticed where no GPU exists. Dry-run timings mean nothing.

Usage: ``python benchmarks/kernels_gpu.py --out results/kernels`` (GPU) or ``--dry-run`` (or
``python -m hicache_storage.benchmarks.kernels_gpu``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hicache_storage.errors import InvalidArgumentError
from hicache_storage.kernels import KVLayout, backup, host_shape, load_layer, reference, select_backend

CHECK_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn)
METHODS = ("triton", "copy_per_page", "torch_gather_scatter")
GIB = 1 << 30


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    halves: int = 2

    @property
    def row_bytes(self) -> int:
        return self.heads * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()

    def pool_bytes(self, pages: int) -> int:
        return self.halves * self.layers * pages * self.page_size * self.row_bytes


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Result:
    layout: str
    layers: int
    pages: int
    direction: str
    method: str
    bytes: int
    seconds: float
    gbps: float
    verified: bool


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    width = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * width), dtype=torch.uint8, generator=generator)
    return raw.view(dtype)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


def place(
    device_kv: torch.Tensor, host_kv: torch.Tensor, device: torch.device, host_memory: str, cleanup: ExitStack
) -> tuple[torch.Tensor, torch.Tensor]:
    """Device KV onto ``device``; on a GPU the host pool page-locked the way ``host_memory`` says:
    ``pinned`` (``pin_memory``, one ``cudaHostAlloc``) or ``registered`` (pageable memory
    registered page by page with ``cudaHostRegister``, as the HiCache core pins large pools in
    chunks: the kernel must address the pool across registrations)."""
    if device.type != "cuda":
        return device_kv.clone(), host_kv.clone()
    if host_memory == "pinned":
        return device_kv.to(device), host_kv.pin_memory()
    return device_kv.to(device), cleanup.enter_context(registered_copy(host_kv))


@contextmanager
def registered_copy(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    page = 4096
    nbytes = tensor.numel() * tensor.element_size()
    raw = torch.empty(nbytes + page, dtype=torch.uint8)
    start = -raw.data_ptr() % page
    copy = raw[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
    copy.copy_(tensor)
    cudart = torch.cuda.cudart()
    registered = []
    try:
        for offset in range(0, nbytes, page):
            status = cudart.cudaHostRegister(copy.data_ptr() + offset, min(page, nbytes - offset), 0)
            if int(status) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {status}")
            registered.append(copy.data_ptr() + offset)
        yield copy
    finally:
        torch.cuda.synchronize()
        for pointer in registered:
            cudart.cudaHostUnregister(pointer)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- correctness ---------------------------------------------------------------------------------


def correctness_checks(device: torch.device, backends: list[str]) -> list[Check]:
    """Every backend that can run here against the oracle, on small random cases."""
    checks = []
    generator = torch.Generator().manual_seed(0)
    for layout in KVLayout:
        for dtype in CHECK_DTYPES:
            for halves, heads, head_dim in ((2, 8, 16), (1, 1, 72)):
                for pattern in ("pages", "scattered"):
                    shape = Shape(layers=3, heads=heads, head_dim=head_dim, page_size=4, dtype=dtype, halves=halves)
                    checks.extend(check_case(layout, shape, pattern, device, backends, generator, "pinned"))
        if device.type == "cuda":
            shape = Shape(layers=3, heads=8, head_dim=64, page_size=4, dtype=torch.bfloat16)
            checks.extend(check_case(layout, shape, "scattered", device, backends, generator, "registered"))
    return checks


def check_case(
    layout: KVLayout,
    shape: Shape,
    pattern: str,
    device: torch.device,
    backends: list[str],
    generator: torch.Generator,
    host_memory: str,
) -> list[Check]:
    device_pages, host_pages = 6, 5
    device_slots, host_slots = device_pages * shape.page_size, host_pages * shape.page_size
    device_kv = random_bits(
        (shape.halves, shape.layers, device_slots, shape.heads, shape.head_dim), shape.dtype, generator
    )
    host_kv = random_bits(
        host_shape(
            layout,
            halves=shape.halves,
            layers=shape.layers,
            slots=host_slots,
            heads=shape.heads,
            head_dim=shape.head_dim,
            page_size=shape.page_size,
        ),
        shape.dtype,
        generator,
    )
    if pattern == "pages":
        device_idx = page_slots(torch.randperm(device_pages, generator=generator)[:4], shape.page_size)
        host_idx = page_slots(torch.randperm(host_pages, generator=generator)[:4], shape.page_size)
    else:
        device_idx = torch.randperm(device_slots, generator=generator)[:11]
        host_idx = torch.randperm(host_slots, generator=generator)[:11]
    runs = reference.contiguous_runs(device_idx, host_idx, layout, shape.page_size)
    want_device = device_kv.clone()
    for layer in range(shape.layers):
        reference.load_layer(want_device, host_kv, runs, layer=layer, layout=layout, page_size=shape.page_size)
    want_host = host_kv.clone()
    reference.backup(device_kv, want_host, runs, layout=layout, page_size=shape.page_size)

    checks = []
    for backend in backends:
        with ExitStack() as cleanup:
            loaded, backed_up = run_check(
                backend, device_kv, host_kv, device_idx, host_idx, layout, shape, device, host_memory, cleanup
            )
            load_ok = torch.equal(bits(loaded), bits(want_device))
            backup_ok = torch.equal(bits(backed_up), bits(want_host))
        name = (
            f"{backend}/{layout.value}/{str(shape.dtype).removeprefix('torch.')}/halves={shape.halves}/"
            f"{pattern}/{host_memory}"
        )
        detail = "" if load_ok and backup_ok else f"load_layer ok={load_ok}, backup ok={backup_ok}"
        checks.append(Check(name=name, ok=load_ok and backup_ok, detail=detail))
    return checks


def run_check(
    backend: str,
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    device_idx: torch.Tensor,
    host_idx: torch.Tensor,
    layout: KVLayout,
    shape: Shape,
    device: torch.device,
    host_memory: str,
    cleanup: ExitStack,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(device KV after loading every layer, host pool after a backup), both on the CPU."""
    dev, host = place(device_kv, host_kv, device, host_memory, cleanup)
    for layer in range(shape.layers):
        load_layer(
            dev,
            host,
            layer=layer,
            device_indices=device_idx,
            host_indices=host_idx,
            layout=layout,
            page_size=shape.page_size,
            backend=backend,
        )
    dev_for_backup, host_after = place(device_kv, host_kv, device, host_memory, cleanup)
    backup(
        dev_for_backup,
        host_after,
        device_indices=device_idx,
        host_indices=host_idx,
        layout=layout,
        page_size=shape.page_size,
        backend=backend,
    )
    synchronize(device)
    return dev.cpu(), host_after.clone()


def page_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


# --- throughput ----------------------------------------------------------------------------------


def measure(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median wall-clock seconds of ``run`` after one warm-up (which also compiles kernels)."""
    run()
    synchronize(device)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def throughput(
    device: torch.device,
    methods: list[str],
    layouts: list[KVLayout],
    layer_counts: list[int],
    page_counts: list[int],
    shape_template: Shape,  # every field but ``layers``, which each entry of layer_counts sets
    max_bytes: int,
    torch_max_bytes: int,
    repeats: int,
) -> tuple[list[Result], list[str]]:
    results: list[Result] = []
    skipped: list[str] = []
    for layers in layer_counts:
        shape = dataclasses.replace(shape_template, layers=layers)
        fitting = [pages for pages in page_counts if shape.pool_bytes(pages) <= max_bytes]
        for pages in sorted(set(page_counts) - set(fitting)):
            skipped.append(f"{layers} layers x {pages} pages: pool {shape.pool_bytes(pages) / GIB:.1f} GiB > --max-gib")
        if not fitting:
            continue
        pool_pages = max(fitting)
        # One device pool and one host pool per layer count; every layout views the same host
        # bytes (all three layouts hold the same number of elements).
        slots = pool_pages * shape.page_size
        device_kv = torch.empty(
            (shape.halves, layers, slots, shape.heads, shape.head_dim), dtype=shape.dtype, device=device
        )
        fill_random(device_kv)
        host_flat = torch.empty(device_kv.numel(), dtype=shape.dtype, pin_memory=device.type == "cuda")
        host_flat.copy_(device_kv.view(-1))
        fill_random(device_kv)
        generator = torch.Generator().manual_seed(layers)
        for layout in layouts:
            host_kv = host_flat.view(
                host_shape(
                    layout,
                    halves=shape.halves,
                    layers=layers,
                    slots=slots,
                    heads=shape.heads,
                    head_dim=shape.head_dim,
                    page_size=shape.page_size,
                )
            )
            for pages in fitting:
                device_idx = page_slots(torch.randperm(pool_pages, generator=generator)[:pages], shape.page_size)
                host_idx = page_slots(torch.randperm(pool_pages, generator=generator)[:pages], shape.page_size)
                runs = reference.contiguous_runs(device_idx, host_idx, layout, shape.page_size)
                moved = shape.pool_bytes(pages)
                for method in methods:
                    if method == "torch_gather_scatter" and moved > torch_max_bytes:
                        skipped.append(
                            f"torch_gather_scatter {layout.value} {layers} layers x {pages} pages: "
                            f"{moved / GIB:.1f} GiB > --torch-max-gib (CPU-bound, slow)"
                        )
                        continue
                    load, save = transfer_functions(
                        method, device_kv, host_kv, device_idx, host_idx, runs, layout, shape.page_size, device
                    )
                    for direction, run in (("load", load), ("backup", save)):
                        if direction == "load":
                            device_kv.zero_()
                        else:
                            bits(device_kv).add_(1)  # new bytes, so a backup that moved nothing fails
                        seconds = measure(run, device, repeats)
                        verified = spot_check(device_kv, host_kv, device_idx, host_idx, layout, shape, generator)
                        results.append(
                            Result(
                                layout=layout.value,
                                layers=layers,
                                pages=pages,
                                direction=direction,
                                method=method,
                                bytes=moved,
                                seconds=seconds,
                                gbps=moved / seconds / 1e9,
                                verified=verified,
                            )
                        )
                        print(
                            f"{layout.value:18} L={layers:3} pages={pages:5} {direction:6} {method:21} "
                            f"{moved / seconds / 1e9:8.2f} GB/s  verified={verified}",
                            flush=True,
                        )
        del device_kv, host_flat
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results, skipped


def fill_random(tensor: torch.Tensor) -> None:
    bits(tensor).random_(0, 256)  # in place: no second pool-sized buffer


def transfer_functions(
    method: str,
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    device_idx: torch.Tensor,
    host_idx: torch.Tensor,
    runs: list[reference.Run],
    layout: KVLayout,
    page_size: int,
    device: torch.device,
) -> tuple[Callable[[], None], Callable[[], None]]:
    """(load all layers, backup all layers) closures for one method."""
    layers = device_kv.shape[1]
    if method == "copy_per_page":

        def load_pages() -> None:
            for layer in range(layers):
                reference.load_layer(device_kv, host_kv, runs, layer=layer, layout=layout, page_size=page_size)

        def save_pages() -> None:
            reference.backup(device_kv, host_kv, runs, layout=layout, page_size=page_size)

        return load_pages, save_pages
    backend = "triton" if method == "triton" else "torch"
    # Indices live where each backend reads them, as the core would keep them.
    kernel_device = device if backend == "triton" else torch.device("cpu")
    device_idx, host_idx = device_idx.to(kernel_device), host_idx.to(kernel_device)
    kwargs: dict[str, Any] = dict(device_indices=device_idx, host_indices=host_idx, layout=layout, page_size=page_size, backend=backend)

    def load() -> None:
        for layer in range(layers):
            load_layer(device_kv, host_kv, layer=layer, **kwargs)

    def save() -> None:
        backup(device_kv, host_kv, **kwargs)

    return load, save


def spot_check(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    device_idx: torch.Tensor,
    host_idx: torch.Tensor,
    layout: KVLayout,
    shape: Shape,
    generator: torch.Generator,
    samples: int = 4,
) -> bool:
    """Device and host agree on a few random (slot, layer, half) rows of the transfer just timed."""
    for _ in range(samples):
        i = int(torch.randint(0, device_idx.numel(), (), generator=generator))
        layer = int(torch.randint(0, shape.layers, (), generator=generator))
        half = int(torch.randint(0, shape.halves, (), generator=generator))
        run = reference.Run(int(device_idx[i]), int(host_idx[i]), 1)
        host_row = reference.host_run(host_kv, layout, half, layer, run, shape.page_size)
        device_row = device_kv[half, layer, run.device_start : run.device_start + 1].cpu()
        if not torch.equal(bits(host_row), bits(device_row)):
            return False
    return True


# --- report --------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    lines = [f"# KV transfer kernels: {report['mode']}", ""]
    env = report["environment"]
    lines += [f"- {key}: {value}" for key, value in env.items()]
    failed = [check for check in report["checks"] if not check["ok"]]
    lines += [
        "",
        f"Correctness: {len(report['checks']) - len(failed)}/{len(report['checks'])} checks bit-exact.",
    ]
    lines += [f"- FAILED {check['name']}: {check['detail']}" for check in failed]
    lines += [
        "",
        "| layout | layers | pages | direction | "
        + " | ".join(f"{m} GB/s" for m in METHODS)
        + " | triton / copy_per_page |",
        "|---|---|---|---|" + "---|" * (len(METHODS) + 1),
    ]
    table: dict[tuple, dict[str, dict]] = {}
    for row in report["results"]:
        key = (row["layout"], row["layers"], row["pages"], row["direction"])
        table.setdefault(key, {})[row["method"]] = row
    for key, by_method in table.items():
        cells = []
        for method in METHODS:
            row = by_method.get(method)
            cells.append("-" if row is None else f"{row['gbps']:.2f}" + ("" if row["verified"] else " (WRONG)"))
        ratio = "-"
        if "triton" in by_method and "copy_per_page" in by_method:
            ratio = f"{by_method['triton']['gbps'] / by_method['copy_per_page']['gbps']:.2f}x"
        lines.append("| " + " | ".join(str(part) for part in key) + " | " + " | ".join(cells) + f" | {ratio} |")
    if report["skipped"]:
        lines += ["", "Skipped:"] + [f"- {reason}" for reason in report["skipped"]]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for kernels_gpu.json and kernels_gpu.md")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the script, not speed")
    parser.add_argument("--layers", default="32,64", help="comma-separated layer counts")
    parser.add_argument("--pages", default="1,16,256,1024,4096", help="comma-separated page counts to move")
    parser.add_argument("--layouts", default=",".join(item.value for item in KVLayout))
    parser.add_argument("--max-gib", type=float, default=32.0, help="largest pool (per side) to allocate")
    parser.add_argument("--torch-max-gib", type=float, default=2.0, help="largest transfer timed with torch")
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        device = torch.device("cpu")
        template = Shape(layers=1, heads=2, head_dim=8, page_size=4, dtype=torch.bfloat16)
        layer_counts, page_counts, repeats = [2], [1, 3], 1
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run on a machine without a GPU", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        template = Shape(layers=1, heads=8, head_dim=128, page_size=64, dtype=torch.bfloat16)
        layer_counts = [int(part) for part in args.layers.split(",")]
        page_counts = [int(part) for part in args.pages.split(",")]
        repeats = args.repeats

    probe_device = torch.zeros(2, 1, 4, 1, 1, device=device)
    probe_host = torch.zeros(2, 4, 1, 1, 1, pin_memory=device.type == "cuda")
    backends = ["torch"]
    try:
        select_backend(probe_device, probe_host, "triton")
        backends.insert(0, "triton")
        triton_status = "runs here"
    except InvalidArgumentError as err:
        triton_status = f"not run: {err}"
    methods = [m for m in METHODS if m != "triton" or "triton" in backends]
    environment = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "default backend for this device": select_backend(probe_device, probe_host),
        "triton backend": triton_status,
        "shape": f"{template.heads} heads x {template.head_dim} dims, {template.dtype}, page {template.page_size}",
    }
    print(json.dumps(environment, indent=1), flush=True)

    checks = correctness_checks(device, backends)
    print(f"correctness: {sum(c.ok for c in checks)}/{len(checks)} bit-exact", flush=True)
    results, skipped = throughput(
        device,
        methods,
        [KVLayout(name) for name in args.layouts.split(",")],
        layer_counts,
        page_counts,
        template,
        max_bytes=int(args.max_gib * GIB),
        torch_max_bytes=int(args.torch_max_gib * GIB),
        repeats=repeats,
    )
    report = {
        "mode": "dry-run" if args.dry_run else "gpu",
        "environment": environment,
        "checks": [asdict(check) for check in checks],
        "results": [asdict(result) for result in results],
        "skipped": skipped,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels_gpu.json").write_text(json.dumps(report, indent=1))
    (args.out / "kernels_gpu.md").write_text(markdown(report))
    ok = all(check.ok for check in checks) and all(result.verified for result in results)
    print(f"wrote {args.out}/kernels_gpu.json and .md; {'all correct' if ok else 'SOME RESULTS ARE WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
