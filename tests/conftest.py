"""Shared fixtures: real servers on loopback, started once per test session on first use.

Each server class lives in ``hicache_storage.testing`` and is stopped by PID at the end. A test
that needs a server it has to kill or freeze starts its own instance instead of these.
"""

from __future__ import annotations

from collections.abc import Iterator

import os

import pytest

# tests/sglang_tier runs in SGLang's own environment (scripts/sglang_env.sh, run by scripts/test.sh),
# tests/vllm_tier in vLLM's (scripts/vllm_env.sh).
collect_ignore = [] if os.environ.get("HICACHE_SGLANG_TIER") else ["sglang_tier"]
if not os.environ.get("HICACHE_VLLM_TIER"):
    collect_ignore.append("vllm_tier")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[object]:
    from hicache_storage.testing.redis_server import RedisServer

    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[object]:
    from hicache_storage.testing.redis_server import RedisCluster

    cluster = RedisCluster(nodes=3)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def seaweedfs() -> Iterator[object]:
    from hicache_storage.testing.seaweedfs import SeaweedFS

    server = SeaweedFS()
    server.start()
    yield server
    server.kill()  # throwaway data, and SeaweedFS takes longer to exit than stop() waits
    server.stop()


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[object]:
    from hicache_storage.testing.mooncake_master import MooncakeMaster

    master = MooncakeMaster()
    master.start()
    yield master
    master.stop()


@pytest.fixture(scope="session")
def mooncake_master_plain() -> Iterator[object]:
    """A master without a storage node: each client brings its own segment (SGLang 0.5.23's
    default deployment, and what a Mooncake config that sets only the master reaches)."""
    from hicache_storage.testing.mooncake_master import MooncakeMaster

    master = MooncakeMaster(storage_node=False)
    master.start()
    yield master
    master.stop()
