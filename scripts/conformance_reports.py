"""Regenerate docs/conformance/: the suite's report for every connector against its real server.

    python scripts/conformance_reports.py [--out docs/conformance] [--only NAME ...]

Starts Redis (standalone and a 3-node cluster), SeaweedFS and a Mooncake master on loopback,
runs ``hicache-storage conformance`` once per connector configuration, and stops them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from hicache_storage.testing.mooncake_master import MooncakeMaster
from hicache_storage.testing.redis_server import RedisCluster, RedisServer
from hicache_storage.testing.seaweedfs import SeaweedFS


def started(stack: ExitStack, server):
    server.start()
    stack.callback(server.stop)
    return server


def configurations(stack: ExitStack, scratch: Path) -> dict[str, tuple[str, dict]]:
    redis = started(stack, RedisServer())
    cluster = started(stack, RedisCluster(nodes=3))
    seaweed = started(stack, SeaweedFS())
    mooncake = started(stack, MooncakeMaster())
    # The deployment without storage nodes: each client brings its own segment (SGLang's default).
    mooncake_plain = started(stack, MooncakeMaster(storage_node=False))
    s3 = {"bucket": seaweed.bucket, "endpoint_url": seaweed.endpoint_url, "region": seaweed.region,
          "access_key_id": seaweed.access_key, "secret_access_key": seaweed.secret_key, "prefix": "conformance/"}
    return {
        "memory": ("memory", {}),
        "file": ("file", {"root": str(scratch / "file")}),
        "file-direct-io": ("file", {"root": str(scratch / "file-direct"), "direct_io": True}),
        "redis": ("redis", {"url": redis.url}),
        "redis-cluster": ("redis", {"url": cluster.url, "cluster": True}),
        "s3": ("s3", s3),
        "mooncake": ("mooncake", mooncake.client_config()),
        "mooncake-per-client-segment": ("mooncake", mooncake_plain.client_config(256 * 2**20)),
        "hf3fs": ("hf3fs", {"root": str(scratch / "hf3fs"), "file_size": 256 * 2**20, "numjobs": 2, "page_size_bytes": 2**20}),
        "hf3fs-redis-index": ("hf3fs", {"root": str(scratch / "hf3fs-r"), "file_size": 256 * 2**20, "numjobs": 2,
                                        "page_size_bytes": 2**20, "metadata_url": redis.url}),
        "fsspec-memory": ("fsspec", {"url": "memory://conformance"}),
        "fsspec-file": ("fsspec", {"url": f"file://{scratch}/fsspec"}),
        "fsspec-s3": ("fsspec", {"url": f"s3://{seaweed.bucket}/fsspec-conformance",
                                 "storage_options": {"key": seaweed.access_key, "client_kwargs": {"endpoint_url": seaweed.endpoint_url, "region_name": seaweed.region},
                                                     "config_kwargs": {"s3": {"addressing_style": "path"}}},
                                 "secret_storage_options": {"secret": seaweed.secret_key}}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/conformance")
    parser.add_argument("--only", nargs="*", help="report names to regenerate (default: all)")
    args = parser.parse_args()
    failures = []
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="hicache-reports-") as scratch:
        for report, (backend, config) in configurations(stack, Path(scratch)).items():
            if args.only and report not in args.only:
                continue
            command = [sys.executable, "-m", "hicache_storage.cli", "conformance", backend, "--config", json.dumps(config),
                       "--report-dir", args.out, "--report-name", report]
            result = subprocess.run(command, capture_output=True, text=True)
            print(f"{report}: {result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-500:]}")
            if result.returncode != 0:
                failures.append(report)
    if failures:
        print(f"failed: {', '.join(failures)}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
