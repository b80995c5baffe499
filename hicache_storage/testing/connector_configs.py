"""The one table of connector test configurations: every connector against its real server.

Each :class:`ConnectorConfig` names a configuration (``label``), its connector, the servers it
needs and how its config is made from them. The conformance reports
(``scripts/conformance_reports.py``, one report per label in :data:`REPORTED`) and the
cross-connector matrix tests (``tests/helpers/connector_matrix.py``, the labels in :data:`MATRIX`) both
read it, so a configuration is written once.

A config is made from ``servers`` (server name -> a started server, see :data:`SERVERS`), a
scratch directory and ``fresh``, a word that keeps one run's pages apart from another's (a key
prefix, a store name, a directory).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Servers a configuration can need, by the name used in :attr:`ConnectorConfig.servers` (the
#: pytest fixtures in tests/conftest.py have the same names).
SERVERS = ("redis_server", "redis_cluster", "seaweedfs", "mooncake_master", "mooncake_master_plain")

Servers = Mapping[str, Any]


@dataclass(frozen=True)
class ConnectorConfig:
    """One configuration of one connector, as tests and reports run it."""

    label: str
    backend: str
    make: Callable[[Servers, Path, str], dict[str, Any]]
    servers: tuple[str, ...] = ()
    #: Config keys that only match the test server where it differs from a default one (Mooncake's
    #: lease TTL); README's minimal configs, written for servers at their defaults, leave them out.
    server_settings: tuple[str, ...] = ()

    def config(self, servers: Servers, scratch: Path, fresh: str) -> dict[str, Any]:
        """The connector config, with ``fresh`` in every name the store shares with other runs."""
        return self.make(servers, scratch, fresh)


def _s3(server: Any, fresh: str) -> dict[str, Any]:
    return {
        "bucket": server.bucket,
        "endpoint_url": server.endpoint_url,
        "region": server.region,
        "access_key_id": server.access_key,
        "secret_access_key": server.secret_key,
        "prefix": f"{fresh}/",
    }


def _fsspec_s3(server: Any, fresh: str) -> dict[str, Any]:
    return {
        "url": f"s3://{server.bucket}/fsspec-{fresh}",
        "storage_options": {
            "key": server.access_key,
            "client_kwargs": {"endpoint_url": server.endpoint_url, "region_name": server.region},
            "config_kwargs": {"s3": {"addressing_style": "path"}},
        },
        "secret_storage_options": {"secret": server.secret_key},
    }


_HF3FS = {"file_size": 256 * 2**20, "numjobs": 2, "page_size_bytes": 2**20}

CONFIGS: dict[str, ConnectorConfig] = {
    c.label: c
    for c in (
        ConnectorConfig("memory", "memory", lambda s, d, f: {"store": f}),
        ConnectorConfig("file", "file", lambda s, d, f: {"root": str(d / f"file-{f}")}),
        ConnectorConfig("file-direct-io", "file", lambda s, d, f: {"root": str(d / f"file-direct-{f}"), "direct_io": True}),
        ConnectorConfig("redis", "redis", lambda s, d, f: {"url": s["redis_server"].url, "prefix": f}, ("redis_server",)),
        ConnectorConfig(
            "redis-cluster",
            "redis",
            lambda s, d, f: {"url": s["redis_cluster"].url, "cluster": True, "prefix": f},
            ("redis_cluster",),
        ),
        ConnectorConfig("s3", "s3", lambda s, d, f: _s3(s["seaweedfs"], f), ("seaweedfs",)),
        ConnectorConfig(
            "mooncake",
            "mooncake",
            lambda s, d, f: {**s["mooncake_master"].client_config(), "key_prefix": f"{f}/"},
            ("mooncake_master",),
        ),
        # The deployment without storage nodes: each client brings its own segment (SGLang 0.5.23's
        # default: MOONCAKE_GLOBAL_SEGMENT_SIZE is 4gb in srt/environ.py).
        ConnectorConfig(
            "mooncake-per-client-segment",
            "mooncake",
            lambda s, d, f: {**s["mooncake_master_plain"].client_config(256 * 2**20), "key_prefix": f"{f}/"},
            ("mooncake_master_plain",),
        ),
        ConnectorConfig("hf3fs", "hf3fs", lambda s, d, f: {"root": str(d / f"hf3fs-{f}"), **_HF3FS}),
        ConnectorConfig(
            "hf3fs-redis-index",
            "hf3fs",
            lambda s, d, f: {"root": str(d / f"hf3fs-r-{f}"), **_HF3FS, "metadata_url": s["redis_server"].url},
            ("redis_server",),
        ),
        ConnectorConfig("fsspec-memory", "fsspec", lambda s, d, f: {"url": f"memory://{f}"}),
        ConnectorConfig("fsspec-file", "fsspec", lambda s, d, f: {"url": f"file://{d}/fsspec-{f}"}),
        ConnectorConfig("fsspec-s3", "fsspec", lambda s, d, f: _fsspec_s3(s["seaweedfs"], f), ("seaweedfs",)),
    )
}

#: Configurations with a published conformance report (docs/reports/conformance/<label>.md).
REPORTED = tuple(CONFIGS)
#: Configurations the cross-connector matrix tests run on: one per connector and server kind.
MATRIX = ("memory", "file", "redis", "redis-cluster", "s3", "mooncake", "hf3fs", "fsspec-memory", "fsspec-s3")

#: Each built-in connector with the least config it takes, as README.md shows it ("The least each
#: connector needs"): its required fields and where its server is, every other field at its
#: default. It is the config a new user copies first, so the suite runs every connector with it
#: too (tests/conformance/test_conformance_minimal_configs.py), not only with the tuned ones above.
MINIMAL: dict[str, ConnectorConfig] = {
    c.backend: c
    for c in (
        ConnectorConfig("memory-minimal", "memory", lambda s, d, f: {}),
        ConnectorConfig("file-minimal", "file", lambda s, d, f: {"root": str(d / f"file-{f}")}),
        ConnectorConfig("redis-minimal", "redis", lambda s, d, f: {"url": s["redis_server"].url}, ("redis_server",)),
        ConnectorConfig(
            "s3-minimal",
            "s3",
            lambda s, d, f: {
                "bucket": s["seaweedfs"].bucket,
                "endpoint_url": s["seaweedfs"].endpoint_url,
                "access_key_id": s["seaweedfs"].access_key,
                "secret_access_key": s["seaweedfs"].secret_key,
            },
            ("seaweedfs",),
        ),
        ConnectorConfig(
            "mooncake-minimal",
            "mooncake",
            lambda s, d, f: {
                "master_server_address": s["mooncake_master_plain"].master_server_addr,
                # the test master's 300 ms lease: at the default 10 s, each clause's clear waits 10 s
                "lease_ttl_s": s["mooncake_master_plain"].lease_ttl_ms / 1000,
            },
            ("mooncake_master_plain",),
            server_settings=("lease_ttl_s",),
        ),
        ConnectorConfig("hf3fs-minimal", "hf3fs", lambda s, d, f: {"root": str(d / f"hf3fs-{f}")}),
        ConnectorConfig("fsspec-minimal", "fsspec", lambda s, d, f: {"url": f"memory://{f}"}),
    )
}
