"""Every connector with a real server behind it, as (name, config) pairs for cross-connector tests.

The configurations are the one table in :mod:`hicache_storage.testing.connector_configs` (the
conformance reports use it too). ``connector_config(request, label, tmp_path)`` starts (through
the session fixtures) whatever the configuration needs and returns its config under a fresh
prefix, so tests never see each other's pages.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from hicache_storage.testing.connector_configs import CONFIGS, MATRIX

#: Labels of the connector configurations the matrix tests run on.
CONNECTORS = MATRIX


def connector_config(request: pytest.FixtureRequest, label: str, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if label not in CONFIGS:
        raise ValueError(f"unknown connector label {label!r}; known: {', '.join(CONFIGS)}")
    entry = CONFIGS[label]
    servers = {name: request.getfixturevalue(name) for name in entry.servers}
    return entry.backend, entry.config(servers, tmp_path, f"matrix-{uuid.uuid4().hex[:10]}")
