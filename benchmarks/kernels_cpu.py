"""CPU check of the KV transfer kernels: the torch backend next to a plain copy of the same bytes.

Times ``load_layer`` (host -> device, once per layer) and ``backup`` (device -> host, all layers)
between two CPU pools, per host layout, dtype, page count and index pattern, interleaved with
``torch.Tensor.copy_`` and ``numpy.copyto`` of the same number of bytes, and verifies a sample of
every measured transfer bit for bit. See ``hicache_storage.kernels.cpu_benchmark`` for what is
timed; the numbers that travel between machines are the ratios.

Usage::

    python benchmarks/kernels_cpu.py --out results/kernels_cpu
    python benchmarks/kernels_cpu.py --dtypes bfloat16 --pages 64 --patterns fragmented --repeats 3

Writes ``kernels_cpu.json`` and ``kernels_cpu.md`` into ``--out`` and prints the table; the exit
status is non-zero if a spot check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hicache_storage.kernels import KVLayout
from hicache_storage.kernels.cpu_benchmark import PATTERNS, format_table, measure_cpu_transfers


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
