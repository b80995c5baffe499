"""The reference connector passes the whole suite, in each of its configurations."""

import pytest

from hicache_storage.conformance import ConformanceTests


class TestMemoryConformance(ConformanceTests):
    backend = "memory"


class TestMemoryWithCapacityConformance(ConformanceTests):
    backend = "memory"

    @pytest.fixture
    def backend_config(self):
        return {"capacity_bytes": 64 * 2**20}


class TestSharedMemoryConformance(ConformanceTests):
    backend = "memory"

    @pytest.fixture
    def backend_config(self):
        return {"store": "conformance-shared"}
