"""``hicache-storage bench-io``: batch put / get / exists throughput and latency of one backend.

In one run, for each page size and batch size, it measures side by side:

* the SDK's zero-copy path (``put_from`` / ``get_into`` on views of one host arena),
* the SDK's copying path (``put`` of ``bytes`` / ``get`` returning ``bytes``),
* the raw client doing the same I/O (see :mod:`~hicache_storage.benchmarks.storage_io.raw`), and
  for the file connector ``dd`` with O_DIRECT on the same disk,

and reports throughput, per-batch latency percentiles and the SDK / raw ratio. Every put pass
writes keys no earlier pass of the run wrote, as a KV cache writes a page once under its hash;
writing over pages that exist (a rewrite after corruption) is measured apart, as op
``overwrite``. A second table compares host layouts for the same page: ``page_first`` (a page is
2 contiguous segments, K and V) against ``layer_first`` (2 x layers scattered segments), both
stored as one object per page. Absolute numbers drift 2-4x between runs on shared machines; the
ratios are measured together.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from hicache_storage.benchmarks.storage_io.raw import RawClient, dd_direct, make_raw
from hicache_storage.benchmarks.stats import human_bytes, markdown_table, percentile
from hicache_storage.connectors.file import FileBackend
from hicache_storage.store import Store
from hicache_storage.keys import KeyScope, Namespace, PageKey

DEFAULT_PAGE_SIZES = (64 * 2**10, 2**20, 4 * 2**20)
DEFAULT_BATCH_SIZES = (1, 16, 64)

#: A page's name on one path: a :class:`PageKey` through the SDK, a string for a raw client.
Name = TypeVar("Name")
#: One call on batch ``[start, stop)`` of one pass's names; an SDK call returns its per-page results.
BatchCall = Callable[[list[Name], int, int], object]


@dataclass
class Measurement:
    op: str  # put (fresh keys) / overwrite (keys that exist) / get / exists
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


@dataclass
class IoPath(Generic[Name]):
    """One way of moving a case's pages: names for a pass, and calls on a batch of them.

    ``names_for_pass(n)`` must name pages no other pass number names, so that a run handing out
    each pass number once writes fresh keys on every pass. ``remove`` drops a pass's pages after
    they are measured; ``None`` where the store cannot delete (they stay until the run's clear).
    ``exists`` is ``(label of its rows, call)``, or ``None`` where the path has no check of its own.
    """

    label: str
    names_for_pass: Callable[[int], list[Name]]
    put: BatchCall[Name]
    get: BatchCall[Name]
    remove: Callable[[list[Name]], object] | None
    exists: tuple[str, BatchCall[Name]] | None = None


#: One timed pass: total seconds, per-batch latencies, pages an SDK call reported False.
Pass = tuple[float, list[float], int]


def _timed_batches(batches: Sequence[tuple[int, int]], run: Callable[[int, int], object]) -> Pass:
    """Total time, per-batch latencies, and pages an SDK call reported False (raw clients report none)."""
    latencies, failed = [], 0
    for start, stop in batches:
        began = time.perf_counter()
        results = run(start, stop)
        latencies.append(time.perf_counter() - began)
        if isinstance(results, list):
            failed += results.count(False)
    return sum(latencies), latencies, failed


def _summarize(op: str, path: str, page_size: int, batch: int, pages: int, passes: list[Pass]) -> Measurement:
    """Throughput from the median pass, latencies from all of them."""
    total = sorted(p[0] for p in passes)[len(passes) // 2]
    latencies = [x for p in passes for x in p[1]]
    moved = 0 if op == "exists" else page_size * pages
    rate = moved / total / 1e9 if moved else pages / total / 1e6  # exists: million keys/s
    ms = [x * 1e3 for x in latencies]
    failed = sum(p[2] for p in passes) if op != "exists" else 0  # a False from exists is an answer, not a failure
    return Measurement(op, path, page_size, batch, pages, rate, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99), failed)


def _measure_path(
    path: IoPath[Name], pass_numbers: Iterator[int], page_size: int, batch: int, pages: int, repeats: int
) -> list[Measurement]:
    """``repeats`` passes of put, get and exists, each on fresh names, then one overwrite pass.

    Each pass writes names no earlier pass wrote, reads them back and checks them, and its pages
    are removed before the next pass writes, so the store holds one pass's pages at a time. The
    last pass's pages stay for the overwrite pass, which puts the same bytes over them (keys that
    exist), and are removed after it. Removal is not timed.
    """
    batches = [(s, min(s + batch, pages)) for s in range(0, pages, batch)]
    puts: list[Pass] = []
    gets: list[Pass] = []
    checks: list[Pass] = []
    names: list[Name] = []
    for repeat in range(repeats):
        names = path.names_for_pass(next(pass_numbers))
        puts.append(_timed_batches(batches, functools.partial(path.put, names)))
        gets.append(_timed_batches(batches, functools.partial(path.get, names)))
        if path.exists is not None:
            checks.append(_timed_batches(batches, functools.partial(path.exists[1], names)))
        if repeat < repeats - 1 and path.remove is not None:
            path.remove(names)
    overwrite = _timed_batches(batches, functools.partial(path.put, names))
    if path.remove is not None:
        path.remove(names)
    measured = [
        _summarize("put", path.label, page_size, batch, pages, puts),
        _summarize("overwrite", path.label, page_size, batch, pages, [overwrite]),
        _summarize("get", path.label, page_size, batch, pages, gets),
    ]
    if path.exists is not None:
        measured.append(_summarize("exists", path.exists[0], page_size, batch, pages, checks))
    return measured


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
    """Measure ``backend`` (and its raw client) and return the results as plain data.

    Each path of each case moves ``bytes_per_case`` (at least one batch of pages) per pass, on
    fresh keys; a store that can delete holds one pass's pages at a time, and the run's pages
    are cleared (where the store can) and the raw client's deleted before this returns.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1 (fresh-key passes per case), got {repeats}")
    raw = raw if raw is not None else make_raw(backend)
    run_tag = uuid.uuid4().hex[:8]
    scope = KeyScope(Namespace(model=f"bench-io-{run_tag}", kv_dtype="bfloat16", page_size=64))
    # One number per pass of the whole run, in every page's name: no pass writes a key that an
    # earlier one wrote, whichever path, case or layout it belongs to.
    pass_numbers = itertools.count()
    delete = backend.delete if backend.capabilities.delete else None
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

            def sdk_keys(n: int) -> list[PageKey]:
                return scope.keys(f"{n:016x}{i:048x}" for i in range(pages))

            paths: list[IoPath[Any]] = [
                IoPath(
                    "sdk zero-copy",
                    sdk_keys,
                    put=lambda keys, a, b: backend.put_from(keys[a:b], views[a:b]),
                    get=lambda keys, a, b: backend.get_into(keys[a:b], targets[a:b]),
                    remove=delete,
                    exists=("sdk", lambda keys, a, b: backend.exists(keys[a:b])),
                ),
                IoPath(
                    "sdk copy",
                    sdk_keys,
                    put=lambda keys, a, b: backend.put(keys[a:b], payloads[a:b]),
                    get=lambda keys, a, b: backend.get(keys[a:b], page_size),
                    remove=delete,
                ),
            ]
            if raw is not None:
                paths.append(
                    IoPath(
                        raw.label,
                        lambda n: [f"raw-{run_tag}-{n}-{i}" for i in range(pages)],
                        put=lambda names, a, b: raw.put(names[a:b], views[a:b]),
                        get=lambda names, a, b: raw.get(names[a:b], targets[a:b]),
                        remove=raw.delete,
                        exists=(raw.label, lambda names, a, b: raw.exists(names[a:b])),
                    )
                )
            for batch in batch_sizes:
                for path in paths:
                    measurements += _measure_path(path, pass_numbers, page_size, batch, pages, repeats)
                if bytes(targets[0]) != payloads[0]:
                    raise AssertionError(f"{backend.name}: a page read back differs from what was written")
            if with_dd and isinstance(backend.top, FileBackend):  # a bare file connector: dd where it writes
                rates = dd_direct(page_size, pages, str(backend.top.config.root))
                for op in ("put", "get"):
                    rate = rates["write" if op == "put" else "read"]
                    measurements.append(Measurement(op, "dd O_DIRECT", page_size, 1, pages, rate))
        layouts = _compare_layouts(
            backend, scope, pass_numbers, layers=layers, page_size=max(page_sizes), bytes_total=bytes_per_case
        )
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


def _compare_layouts(
    backend: Store, scope: KeyScope, pass_numbers: Iterator[int], *, layers: int, page_size: int, bytes_total: int
) -> list[LayoutMeasurement]:
    """The same pages from a page-first and a layer-first host arena: 2 vs 2 x layers segments.

    Each layout writes fresh keys (its own pass number) and, where the store can, deletes them
    after reading them back.
    """
    pages = max(8, bytes_total // page_size)
    piece = page_size // (2 * layers)
    arena = memoryview(bytearray(os.urandom(piece)) * (2 * layers * pages))
    batch = 16
    batches = [(s, min(s + batch, pages)) for s in range(0, pages, batch)]
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
        number = next(pass_numbers)
        keys = scope.with_part("layout").keys(f"{number:016x}{i:048x}" for i in range(pages))
        put_time, _, _ = _timed_batches(batches, lambda a, b: backend.put_from(keys[a:b], segments[a:b]))
        get_time, _, _ = _timed_batches(batches, lambda a, b: backend.get_into(keys[a:b], segments[a:b]))
        if backend.capabilities.delete:
            backend.delete(keys)
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
    lines.append("put: fresh keys on every pass (a page written once, as a KV cache writes it); overwrite: one pass over keys that exist.")
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
