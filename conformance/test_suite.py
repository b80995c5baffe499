"""Entry point of ``pytest --pyargs hicache_storage.conformance --hicache-backend NAME``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hicache_storage.conformance.suite import ConformanceTests
from hicache_storage.config import load_config_source


class TestConformance(ConformanceTests):
    @pytest.fixture
    def backend_name(self, request: pytest.FixtureRequest) -> str:
        name = request.config.getoption("--hicache-backend")
        if not name:
            pytest.fail("pass --hicache-backend NAME (and --hicache-config JSON) to run the conformance suite", pytrace=False)
        return name

    @pytest.fixture
    def backend_config(self, request: pytest.FixtureRequest) -> dict[str, Any]:
        return load_config_source(request.config.getoption("--hicache-config"))

    @pytest.fixture
    def backend_layers(self, request: pytest.FixtureRequest) -> list[dict[str, Any]] | None:
        raw = request.config.getoption("--hicache-layers")
        return json.loads(raw) if raw else None
