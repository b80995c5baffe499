"""Every wrapper, alone and stacked, passes the whole conformance suite around the memory connector.

Timeouts here are far above anything a memory call takes: these runs prove forwarding and
semantics, not timing (the timeout behaviour itself is tested in test_wrappers_timeout.py).
"""

import pytest

from hicache_storage.conformance import ConformanceTests

# A memory store with a byte capacity declares max_value_size, which integrity must lower.
CAPPED_MEMORY = {"capacity_bytes": 64 * 2**20}


class TestTimeoutConformance(ConformanceTests):
    backend = "memory"
    wrappers = [{"kind": "timeout", "seconds": 60, "workers": 4}]


class TestRetryConformance(ConformanceTests):
    backend = "memory"
    wrappers = [{"kind": "retry", "attempts": 3, "base_seconds": 0.001, "seed": 1}]


class TestIntegrityConformance(ConformanceTests):
    backend = "memory"
    wrappers = [{"kind": "integrity"}]


class TestIntegrityBlake2bVerifiedExistsConformance(ConformanceTests):
    backend = "memory"
    wrappers = [{"kind": "integrity", "checksum": "blake2b", "verify_exists": True}]

    @pytest.fixture
    def backend_config(self):
        return CAPPED_MEMORY


class TestMetricsConformance(ConformanceTests):
    backend = "memory"
    wrappers = [{"kind": "metrics"}]


class TestFaultsWithNoFaultsConformance(ConformanceTests):
    """With every rate at zero the fault injector is a pure pass-through."""

    backend = "memory"
    wrappers = [{"kind": "faults", "seed": 1}]


class TestRetryHidesInjectedErrorsConformance(ConformanceTests):
    """A store failing 30% of calls with retryable errors still conforms behind retry."""

    backend = "memory"
    wrappers = [
        {
            "kind": "faults",
            "seed": 3,
            **{
                op: {"error_rate": 0.3, "errors": ["unavailable", "timeout", "throttled"]}
                for op in ("exists", "get", "put", "delete", "clear")
            },
        },
        {"kind": "retry", "attempts": 40, "base_seconds": 0.0001, "cap_seconds": 0.001, "deadline_seconds": None, "seed": 3},
    ]


class TestRecommendedStackConformance(ConformanceTests):
    """The order the docs recommend, with a value size limit and a batch limit to honour."""

    backend = "memory"
    capability_overrides = {"max_batch": 7}
    wrappers = [
        {"kind": "faults", "seed": 2},
        {"kind": "integrity"},
        {"kind": "timeout", "seconds": 60},
        {"kind": "retry", "attempts": 3, "base_seconds": 0.001},
        {"kind": "metrics"},
    ]

    @pytest.fixture
    def backend_config(self):
        return CAPPED_MEMORY


class TestRecommendedStackOnFileConformance(ConformanceTests):
    """On a persistent store the stack must also survive reopening and serve another process."""

    backend = "file"
    wrappers = TestRecommendedStackConformance.wrappers

    @pytest.fixture
    def backend_config(self, tmp_path):
        return {"root": str(tmp_path / "pages")}
