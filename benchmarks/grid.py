"""The multi-turn bench over a grid of stores x compute speeds, each store against its real server.

    python -m hicache_storage.benchmarks.grid [--stores file,redis,s3,mooncake] [--compute l4-7b,h200-7b]
                                             [--preset long-history] [--out results/grid]

Starts the servers the stores need on loopback (Redis, SeaweedFS for S3, a Mooncake master with
Mooncake's own read lease and a storage node large enough for the workload), then for each
compute speed runs L1 once and L1+L2+L3 once per store, all in one process, and writes
``grid.json`` and ``grid.md``: per point, the hit rate, the ratio over that compute's L1 run,
both bounds and what the cost model chose.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from hicache_core.engine import CacheTiers

from hicache_storage.benchmarks.multiturn.bound import wait_for_cleanups
from hicache_storage.benchmarks.multiturn.runner import COMPUTE_PRESETS, PRESETS, BenchConfig, run_bench
from hicache_storage.benchmarks.multiturn.workload import Workload
from hicache_storage.benchmarks.stats import markdown_table

STORES = ("file", "redis", "s3", "mooncake")
#: Stores the grid can run besides: SGLang's own HiCacheFile (``sglang:file``, needs sglang).
EXTRA_STORES = ("sglang-file",)
#: The Mooncake storage node's segment: the long-history workload stores ~1.7 GB per run.
MOONCAKE_SEGMENT_BYTES = 6 * 2**30
#: The longest wait for the bench's removal of its timing pages before the servers stop (Mooncake
#: removes them once its 10 s read leases expire).
CLEANUP_WAIT_S = 30.0


def start_servers(stores: list[str], stack: ExitStack, scratch: Path) -> dict[str, tuple[str, dict[str, Any] | None]]:
    """``store -> (backend, config)``, with the servers they need started (and stopped with ``stack``)."""
    configs: dict[str, tuple[str, dict[str, Any] | None]] = {}
    for store in stores:
        if store == "file":
            configs[store] = ("file", {"root": str(scratch / "file")})
        elif store == "sglang-file":
            configs[store] = ("sglang:file", {"extra_config": {"file_storage_path": str(scratch / "sglang-file")}})
        elif store == "redis":
            from hicache_storage.testing.redis_server import RedisServer

            redis = RedisServer()
            redis.start()
            stack.callback(redis.stop)
            configs[store] = ("redis", {"url": redis.url})
        elif store == "s3":
            from hicache_storage.testing.seaweedfs import SeaweedFS

            seaweed = SeaweedFS()
            seaweed.start()
            stack.callback(seaweed.stop)
            configs[store] = (
                "s3",
                {
                    "bucket": seaweed.bucket,
                    "endpoint_url": seaweed.endpoint_url,
                    "region": seaweed.region,
                    "access_key_id": seaweed.access_key,
                    "secret_access_key": seaweed.secret_key,
                },
            )
        elif store == "mooncake":
            from hicache_storage.testing.mooncake_master import CLIENT_ENV, MooncakeMaster

            import os

            os.environ.update(CLIENT_ENV)
            # Mooncake's own read lease (the master's default), as an operator runs it: the tests'
            # short lease (300 ms, so that their deletes need not wait) expired under reads that a
            # busy 2-core machine took longer than that to transfer, and the engine recomputed
            # those pages (``prefetch_failed_batches``) and wrote them again.
            master = MooncakeMaster(node_segment_bytes=MOONCAKE_SEGMENT_BYTES, lease_ttl_ms=None)
            master.start()
            stack.callback(master.stop)
            configs[store] = ("mooncake", master.client_config())
        else:
            raise SystemExit(f"grid: unknown store {store!r}; choose from {', '.join(STORES + EXTRA_STORES)}")
    # The bench removes its timing pages on a thread of its own once the store allows it
    # (Mooncake: when the read leases expire); stop no server before those removals are done.
    stack.callback(wait_for_cleanups, CLEANUP_WAIT_S)
    return configs


def run_grid(stores: list[str], computes: list[str], preset: str, out: Path) -> dict[str, Any]:
    shape = PRESETS[preset]
    workload = Workload(shape["clients"], shape["rounds"], shape["request_length"])
    points: list[dict[str, Any]] = []
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="hicache-grid-") as scratch:
        configs = start_servers(stores, stack, Path(scratch))
        for compute in computes:
            base = BenchConfig(workload=workload, device_tokens=shape["device_tokens"], compute=compute)
            l1 = run_bench(replace(base, tiers=(CacheTiers.L1,)))["runs"][0]
            print(f"{compute}: L1 {l1['overall']['input_tokens_per_s']:,.0f} tok/s", file=sys.stderr, flush=True)
            for store in stores:
                backend, config = configs[store]
                started = time.perf_counter()
                result = run_bench(replace(base, tiers=(CacheTiers.L1_L2_L3,), backend=backend, backend_config=config), l1_wall_s=l1["overall"]["wall_s"])
                run = result["runs"][0]
                point = {"store": store, "compute": compute, "l1": l1["overall"], "run": run, "legs": result["legs"], "seconds": time.perf_counter() - started}
                points.append(point)
                print(" | ".join(row(point)), file=sys.stderr, flush=True)
    data = {"preset": preset, "points": points}
    out.mkdir(parents=True, exist_ok=True)
    (out / "grid.json").write_text(json.dumps(data, indent=1, default=str))
    (out / "grid.md").write_text(render(data))
    return data


def row(point: dict[str, Any]) -> list[str]:
    run, l1 = point["run"], point["l1"]
    simple = run.get("bound") or {}
    reachable = run.get("reachable") or {}
    metrics = run["metrics"]
    ratio = run["overall"]["input_tokens_per_s"] / l1["input_tokens_per_s"]
    return [
        point["store"],
        point["compute"],
        f"{run['overall']['cache_hit_rate']:.1%}",
        f"{ratio:.2f}x",
        f"{simple['efficiency']:.2f} ({simple['limit']})" if simple else "-",
        f"{reachable['efficiency']:.2f}" if reachable else "-",
        f"{reachable['bound_vs_l1']:.2f}x" if reachable.get("bound_vs_l1") else "-",
        f"{int(metrics['storage_hit_tokens']):,} / {int(metrics.get('storage_recomputed_tokens', 0)):,}",
        f"{reachable['best_loaded_tokens']:,} / {reachable['best_recomputed_tokens']:,}" if reachable else "-",
        f"{metrics['storage_backup_bytes'] / 2**20:,.0f} MiB",
        f"{int(metrics.get('storage_backup_deferred', 0)):,}",
        f"{run['overall']['wall_s']:.1f}",
    ]


HEADER = [
    "L3", "compute", "hit", "vs L1", "efficiency (simple bound)", "efficiency (reachable)", "reachable vs L1",
    "loaded / recomputed (cost model)", "loaded / recomputed (best)", "L3 written", "backups deferred", "wall s",
]


def render(data: dict[str, Any]) -> str:
    return f"## Grid: {data['preset']}\n\n" + markdown_table(HEADER, [row(p) for p in data["points"]]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stores", default=",".join(STORES), help=f"comma-separated, from {', '.join(STORES + EXTRA_STORES)}")
    parser.add_argument("--compute", default=",".join(COMPUTE_PRESETS), help=f"compute presets, comma-separated ({', '.join(COMPUTE_PRESETS)})")
    parser.add_argument("--preset", default="long-history", choices=list(PRESETS))
    parser.add_argument("--out", default="results/grid")
    args = parser.parse_args()
    for name, given, known in (("store", args.stores, STORES + EXTRA_STORES), ("compute", args.compute, tuple(COMPUTE_PRESETS))):
        unknown = [item for item in given.split(",") if item not in known]
        if unknown:
            parser.error(f"unknown {name} {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    data = run_grid(args.stores.split(","), args.compute.split(","), args.preset, Path(args.out))
    print(render(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
