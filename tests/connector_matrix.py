"""Every connector with a real server behind it, as (name, config) pairs for cross-connector tests.

``connector_config(request, label, tmp_path)`` starts (through the session fixtures) whatever the
connector needs and returns a config under a fresh prefix, so tests never see each other's pages.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

#: Labels of the connector configurations the matrix tests run on.
CONNECTORS = ("memory", "file", "redis", "redis-cluster", "s3", "mooncake", "hf3fs", "fsspec-memory", "fsspec-s3")


def connector_config(request: pytest.FixtureRequest, label: str, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    fresh = uuid.uuid4().hex[:10]
    if label == "memory":
        return "memory", {"store": f"matrix-{fresh}"}
    if label == "file":
        return "file", {"root": str(tmp_path / "file-root")}
    if label == "redis":
        return "redis", {"url": request.getfixturevalue("redis_server").url, "prefix": f"m{fresh}"}
    if label == "redis-cluster":
        return "redis", {"url": request.getfixturevalue("redis_cluster").url, "cluster": True, "prefix": f"m{fresh}"}
    if label == "s3":
        server = request.getfixturevalue("seaweedfs")
        return "s3", {
            "bucket": server.bucket,
            "endpoint_url": server.endpoint_url,
            "region": server.region,
            "access_key_id": server.access_key,
            "secret_access_key": server.secret_key,
            "prefix": f"matrix-{fresh}/",
        }
    if label == "mooncake":
        return "mooncake", {**request.getfixturevalue("mooncake_master").client_config(), "key_prefix": f"m{fresh}/"}
    if label == "hf3fs":
        return "hf3fs", {"root": str(tmp_path / "hf3fs-mount"), "file_size": 64 * 2**20, "numjobs": 2, "page_size_bytes": 4096}
    if label == "fsspec-memory":
        return "fsspec", {"url": f"memory://matrix-{fresh}"}
    if label == "fsspec-s3":
        server = request.getfixturevalue("seaweedfs")
        return "fsspec", {
            "url": f"s3://{server.bucket}/matrix-{fresh}",
            "storage_options": {
                "key": server.access_key,
                "client_kwargs": {"endpoint_url": server.endpoint_url, "region_name": server.region},
                "config_kwargs": {"s3": {"addressing_style": "path"}},
            },
            "secret_storage_options": {"secret": server.secret_key},
        }
    raise ValueError(f"unknown connector label {label!r}")
