"""Each layer kind passes the whole conformance suite once over the memory connector, and one
combined stack passes it over the file connector (persistence, other processes, zero-copy).

Real servers get one combined stack each (tests/layers/test_layers_mooncake.py); what a layer does
(timing, retries, trailers, counters, faults) is asserted by the behaviour tests in the other
tests/layers/test_layers_*.py files, which run in a fraction of a suite's time. Timeouts here are far
above anything a memory call takes: these runs prove forwarding and semantics, not timing.
"""

import pytest

from hicache_storage.conformance import ConformanceTests

# A memory store with a byte capacity declares max_value_size, which integrity must lower.
CAPPED_MEMORY = {"capacity_bytes": 64 * 2**20}


class TestTimeoutConformance(ConformanceTests):
    backend = "memory"
    layers = [{"kind": "timeout", "seconds": 60, "workers": 4}]


class TestRetryHidesInjectedErrorsConformance(ConformanceTests):
    """A store failing 30% of calls with retryable errors still conforms behind retry."""

    backend = "memory"
    layers = [
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


class TestIntegrityBlake2bVerifiedExistsConformance(ConformanceTests):
    """Integrity with its non-default options, on a store whose value size limit it must lower
    (the default crc32 trailer runs in the combined stacks)."""

    backend = "memory"
    layers = [{"kind": "integrity", "checksum": "blake2b", "verify_exists": True}]

    @pytest.fixture
    def backend_config(self):
        return CAPPED_MEMORY


class TestMetricsConformance(ConformanceTests):
    backend = "memory"
    layers = [{"kind": "metrics"}]


class TestFaultsWithNoFaultsConformance(ConformanceTests):
    """With every rate at zero the fault injector is a pure pass-through."""

    backend = "memory"
    layers = [{"kind": "faults", "seed": 1}]


class TestZeroCopyStackOnFileConformance(ConformanceTests):
    """Every layer kind in one stack, in the order a zero-copy timeout needs (retry and integrity
    below it), on a persistent store that reads and writes zero-copy: the stack must survive
    reopening, serve another process, keep the zero-copy clauses, and honour a batch limit the
    capability overrides set on the connector."""

    backend = "file"
    capability_overrides = {"max_batch": 7}
    layers = [
        {"kind": "faults", "seed": 2},
        {"kind": "integrity"},
        {"kind": "retry", "attempts": 3, "base_seconds": 0.001},
        {"kind": "timeout", "seconds": 60, "workers": 4, "zero_copy": True},
        {"kind": "metrics"},
    ]

    @pytest.fixture
    def backend_config(self, tmp_path):
        return {"root": str(tmp_path / "pages")}
