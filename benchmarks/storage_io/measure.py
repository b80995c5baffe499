"""``hicache-storage bench-io``: batch put / get / exists throughput and latency of one backend.

In one run, for each page size and batch size, it measures side by side:

* the SDK's zero-copy path (``put_from`` / ``get_into`` on views of one host arena),
* the SDK's copying path (``put`` of ``bytes`` / ``get`` returning ``bytes``),
* the raw client doing the same I/O (see :mod:`~hicache_storage.benchmarks.storage_io.raw`), and
  for the file connector ``dd`` with O_DIRECT on the same disk,

and reports throughput, per-batch latency percentiles and the SDK / raw ratio. A second table
compares host layouts for the same page: ``page_first`` (a page is 2 contiguous segments, K and
V) against ``layer_first`` (2 x layers scattered segments), both stored as one object per page.
Absolute numbers drift 2-4x between runs on shared machines; the ratios are measured together.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hicache_storage.benchmarks.storage_io.raw import RawClient, dd_direct, make_raw
from hicache_storage.benchmarks.stats import human_bytes, markdown_table, percentile
from hicache_storage.connectors.file import FileBackend
from hicache_storage.store import Store
from hicache_storage.keys import KeyScope, Namespace

DEFAULT_PAGE_SIZES = (64 * 2**10, 2**20, 4 * 2**20)
DEFAULT_BATCH_SIZES = (1, 16, 64)


@dataclass
class Measurement:
    op: str  # put / get / exists
    path: str  # "sdk zero-copy", "sdk copy", the raw client's label, "dd O_DIRECT"
    page_size: int
    batch: int
    pages: int
    gb_per_s: float
    p50_ms: float = float("nan")
    p90_ms: float = float("nan")
    p99_ms: float = float("nan")
    #: Pages the call reported not stored / not read (a full store): such a case's rate is not I/O.
    failed: int = 0


@dataclass
class LayoutMeasurement:
    layout: str
    segments_per_page: int
    objects_per_page: int
    bytes_per_page: int
    put_gb_per_s: float
    get_gb_per_s: float


def _timed_batches(batches: Sequence[tuple[int, int]], run: Callable[[int, int], object]) -> tuple[float, list[float], int]:
    """Total time, per-batch latencies, and pages an SDK call reported False (raw clients report none)."""
    latencies, failed = [], 0
    for start, stop in batches:
        began = time.perf_counter()
        results = run(start, stop)
        latencies.append(time.perf_counter() - began)
        if isinstance(results, list):
            failed += results.count(False)
    return sum(latencies), latencies, failed


def _measure(
    op: str, path: str, page_size: int, batch: int, pages: int, run: Callable[[int, int], object], repeats: int
) -> Measurement:
    """Run every batch ``repeats`` times; throughput from the median pass, latencies from all."""
    batches = [(s, min(s + batch, pages)) for s in range(0, pages, batch)]
    totals, latencies, failed = [], [], 0
    for _ in range(repeats):
        total, passes, misses = _timed_batches(batches, run)
        totals.append(total)
        latencies += passes
        failed += misses
    total = sorted(totals)[len(totals) // 2]
    moved = 0 if op == "exists" else page_size * pages
    rate = moved / total / 1e9 if moved else pages / total / 1e6  # exists: million keys/s
    ms = [x * 1e3 for x in latencies]
    failed = failed if op != "exists" else 0  # a False from exists is an answer, not a failure
    return Measurement(op, path, page_size, batch, pages, rate, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99), failed)


def run_bench_io(
    backend: Store,
    *,
    page_sizes: Sequence[int] = DEFAULT_PAGE_SIZES,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    bytes_per_case: int = 64 * 2**20,
    layers: int = 32,
    repeats: int = 3,
    raw: RawClient | None = None,
    with_dd: bool = True,
) -> dict[str, Any]:
    """Measure ``backend`` (and its raw client) and return the results as plain data."""
    raw = raw if raw is not None else make_raw(backend)
    scope = KeyScope(Namespace(model=f"bench-io-{uuid.uuid4().hex[:8]}", kv_dtype="bfloat16", page_size=64))
    measurements: list[Measurement] = []
    try:
        for page_size in page_sizes:
            pages = max(max(batch_sizes), bytes_per_case // page_size)
            arena = memoryview(bytearray(os.urandom(page_size)) * pages)
            views = [arena[i * page_size : (i + 1) * page_size] for i in range(pages)]
            payloads = [bytes(v) for v in views]
            readback = memoryview(bytearray(page_size * pages))
            backend.register_buffer(arena)  # as an engine registers its host pool
            backend.register_buffer(readback)
            targets = [readback[i * page_size : (i + 1) * page_size] for i in range(pages)]
            for batch in batch_sizes:
                keys = scope.keys(f"{batch:08x}{i:056x}" for i in range(pages))
                names = [f"raw-{page_size}-{batch}-{i}" for i in range(pages)]
                cases: list[tuple[str, str, Callable[[int, int], object]]] = [
                    ("put", "sdk zero-copy", lambda a, b: backend.put_from(keys[a:b], views[a:b])),
                    ("get", "sdk zero-copy", lambda a, b: backend.get_into(keys[a:b], targets[a:b])),
                    ("exists", "sdk", lambda a, b: backend.exists(keys[a:b])),
                    ("put", "sdk copy", lambda a, b: backend.put(keys[a:b], payloads[a:b])),
                    ("get", "sdk copy", lambda a, b: backend.get(keys[a:b], page_size)),
                ]
                if raw is not None:
                    cases += [
                        ("put", raw.label, lambda a, b: raw.put(names[a:b], views[a:b])),
                        ("get", raw.label, lambda a, b: raw.get(names[a:b], targets[a:b])),
                        ("exists", raw.label, lambda a, b: raw.exists(names[a:b])),
                    ]
                for op, path, run in cases:
                    measurements.append(_measure(op, path, page_size, batch, pages, run, repeats))
                if bytes(targets[0]) != payloads[0]:
                    raise AssertionError(f"{backend.name}: a page read back differs from what was written")
            if with_dd and isinstance(backend.top, FileBackend):  # a bare file connector: dd where it writes
                rates = dd_direct(page_size, pages, str(backend.top.config.root))
                for op in ("put", "get"):
                    rate = rates["write" if op == "put" else "read"]
                    measurements.append(Measurement(op, "dd O_DIRECT", page_size, 1, pages, rate))
        layouts = _compare_layouts(backend, scope, layers=layers, page_size=max(page_sizes), bytes_total=bytes_per_case)
    finally:
        if backend.capabilities.clear:
            backend.clear(scope.namespace)
        if raw is not None:
            raw.close()
    return {
        "backend": backend.name,
        "raw_client": raw.label if raw is not None else None,
        "measurements": [asdict(m) for m in measurements],
        "layouts": [asdict(m) for m in layouts],
    }


def _compare_layouts(backend: Store, scope: KeyScope, *, layers: int, page_size: int, bytes_total: int) -> list[LayoutMeasurement]:
    """The same pages from a page-first and a layer-first host arena: 2 vs 2 x layers segments."""
    pages = max(8, bytes_total // page_size)
    piece = page_size // (2 * layers)
    arena = memoryview(bytearray(os.urandom(piece)) * (2 * layers * pages))
    results = []
    for layout in ("page_first", "layer_first"):
        if layout == "page_first":
            # (halves, pages, layers, piece): a page's K half and V half are each one run
            half = layers * piece
            segments = [[arena[(h * pages + p) * half : (h * pages + p + 1) * half] for h in range(2)] for p in range(pages)]
        else:
            # (halves, layers, pages, piece): a page is one piece per layer and half
            segments = [
                [arena[((h * layers + l) * pages + p) * piece : ((h * layers + l) * pages + p + 1) * piece] for h in range(2) for l in range(layers)]
                for p in range(pages)
            ]
        keys = scope.with_part("layout").keys(f"{len(segments[0]):08x}{i:056x}" for i in range(pages))
        batch = 16
        put_time, _, _ = _timed_batches([(s, min(s + batch, pages)) for s in range(0, pages, batch)], lambda a, b: backend.put_from(keys[a:b], segments[a:b]))
        get_time, _, _ = _timed_batches([(s, min(s + batch, pages)) for s in range(0, pages, batch)], lambda a, b: backend.get_into(keys[a:b], segments[a:b]))
        moved = pages * 2 * layers * piece
        results.append(LayoutMeasurement(layout, len(segments[0]), 1, 2 * layers * piece, moved / put_time / 1e9, moved / get_time / 1e9))
    return results


def ratios(result: dict[str, Any]) -> list[dict[str, Any]]:
    """SDK zero-copy throughput divided by the raw client's, per op, page size and batch.

    A case where the SDK reported failed pages has no ratio: refusing is faster than storing.
    """
    raw_label = result["raw_client"]
    if raw_label is None:
        return []
    by_case: dict[tuple[str, int, int], dict[str, float]] = {}
    failed: dict[tuple[str, int, int], int] = {}
    for m in result["measurements"]:
        case = (m["op"], m["page_size"], m["batch"])
        by_case.setdefault(case, {})[m["path"]] = m["gb_per_s"]
        failed[case] = failed.get(case, 0) + m["failed"]
    rows = []
    for (op, page_size, batch), paths in sorted(by_case.items()):
        sdk = paths.get("sdk zero-copy", paths.get("sdk"))
        if sdk is not None and raw_label in paths and not failed.get((op, page_size, batch)):
            rows.append({"op": op, "page_size": page_size, "batch": batch, "sdk_over_raw": sdk / paths[raw_label]})
    return rows


def render_markdown(result: dict[str, Any]) -> str:
    lines = [f"## bench-io: `{result['backend']}` (raw client: {result['raw_client'] or 'none'})", ""]
    lines.append("Throughput in GB/s (exists: million keys/s); latency per batch call in ms.")
    lines.append("")
    rows = [
        (m["op"], m["path"], human_bytes(m["page_size"]), m["batch"], m["pages"], m["gb_per_s"], m["p50_ms"], m["p90_ms"], m["p99_ms"], m["failed"])
        for m in result["measurements"]
    ]
    lines.append(markdown_table(["op", "path", "page", "batch", "pages", "GB/s", "p50 ms", "p90 ms", "p99 ms", "failed pages"], rows))
    ratio_rows = ratios(result)
    if ratio_rows:
        lines += ["", "SDK zero-copy / raw client throughput (1.0 = no overhead):", ""]
        lines.append(
            markdown_table(["op", "page", "batch", "SDK / raw"], [(r["op"], human_bytes(r["page_size"]), r["batch"], r["sdk_over_raw"]) for r in ratio_rows])
        )
    lines += ["", "Host layouts, same bytes, one object per page:", ""]
    lines.append(
        markdown_table(
            ["layout", "segments / page", "objects / page", "bytes / page", "put GB/s", "get GB/s"],
            [(l["layout"], l["segments_per_page"], l["objects_per_page"], human_bytes(l["bytes_per_page"]), l["put_gb_per_s"], l["get_gb_per_s"]) for l in result["layouts"]],
        )
    )
    return "\n".join(lines) + "\n"


def write_results(result: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"bench-io-{result['backend']}"
    stem.with_suffix(".json").write_text(json.dumps({**result, "ratios": ratios(result)}, indent=2))
    stem.with_suffix(".md").write_text(render_markdown(result))
    return stem.with_suffix(".md")
