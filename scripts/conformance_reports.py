"""Regenerate docs/reports/conformance/: the suite's report for every connector against its real server.

    python scripts/conformance_reports.py [--out docs/reports/conformance] [--only NAME ...]

Starts Redis (standalone and a 3-node cluster), SeaweedFS and two Mooncake masters on loopback,
runs ``hicache-storage conformance`` once per configuration of the one table of connector test
configurations (``hicache_storage.testing.connector_configs``), and stops them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from hicache_storage.testing.connector_configs import CONFIGS, REPORTED
from hicache_storage.testing.mooncake_master import MooncakeMaster
from hicache_storage.testing.redis_server import RedisCluster, RedisServer
from hicache_storage.testing.seaweedfs import SeaweedFS


def start_servers(stack: ExitStack) -> dict[str, object]:
    """Every server a configuration in the table may need, started, and stopped when ``stack`` closes."""
    servers = {
        "redis_server": RedisServer(),
        "redis_cluster": RedisCluster(nodes=3),
        "seaweedfs": SeaweedFS(),
        "mooncake_master": MooncakeMaster(),
        "mooncake_master_plain": MooncakeMaster(storage_node=False),
    }
    for server in servers.values():
        server.start()
        stack.callback(server.stop)
    return servers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/reports/conformance")
    parser.add_argument("--only", nargs="*", choices=REPORTED, help="report names to regenerate (default: all)")
    args = parser.parse_args()
    failures = []
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="hicache-reports-") as scratch:
        servers = start_servers(stack)
        for report in args.only or REPORTED:
            entry = CONFIGS[report]
            backend, config = entry.backend, entry.config(servers, Path(scratch), "conformance")
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
