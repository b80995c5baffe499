"""The metrics layer: counts per operation, latency histograms, and Prometheus export."""

import json
import sys

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.errors import BackendUnavailableError, ConfigError, MissingDependencyError
from hicache_storage.keys import KeyScope, Namespace, PageKey
from hicache_storage.layers import MetricsLayer, find_layer, prometheus_text, stack_layers
from hicache_storage.store import Store

NAMESPACE = Namespace(model="metrics-tests", kv_dtype="bfloat16", page_size=16)
SCOPE = KeyScope(NAMESPACE)


def keys(n: int) -> list[PageKey]:
    return SCOPE.keys([f"{i:016x}" for i in range(n)])


def workload(store) -> None:
    batch = keys(4)
    store.put(batch[:3], [b"a" * 100] * 3)
    store.exists(batch)
    store.get(batch, 100)
    store.delete([batch[0], batch[3]])
    store.clear(NAMESPACE)


def samples(text: str) -> dict[tuple[str, tuple], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_counts_calls_keys_hits_and_bytes_per_operation():
    metrics = MetricsLayer(MemoryBackend())
    workload(Store(metrics))
    ops = metrics.snapshot()["operations"]
    assert ops["put"] | {"errors": {}} == ops["put"]
    assert {k: ops["put"][k] for k in ("calls", "keys", "hits", "bytes")} == {"calls": 1, "keys": 3, "hits": 3, "bytes": 300}
    assert {k: ops["exists"][k] for k in ("calls", "keys", "hits", "bytes")} == {"calls": 1, "keys": 4, "hits": 3, "bytes": 0}
    assert {k: ops["get"][k] for k in ("calls", "keys", "hits", "bytes")} == {"calls": 1, "keys": 4, "hits": 3, "bytes": 300}
    assert {k: ops["delete"][k] for k in ("calls", "keys", "hits")} == {"calls": 1, "keys": 2, "hits": 1}
    assert ops["clear"]["calls"] == 1
    assert ops["register_buffer"]["calls"] == 0


def test_each_batch_the_store_sees_is_one_call():
    inner = MemoryBackend()
    inner.capabilities = inner.capabilities.replace(max_batch=3)
    metrics = MetricsLayer(inner)
    Store(metrics).put(keys(7), [b"x"] * 7)
    assert metrics.snapshot()["operations"]["put"]["calls"] == 3
    assert metrics.snapshot()["operations"]["put"]["keys"] == 7


def test_errors_are_counted_by_type():
    metrics = stack_layers(MemoryBackend(), [{"kind": "faults", "seed": 1, "exists": {"error_rate": 1.0}}, {"kind": "metrics"}])
    store = Store(metrics)
    for _ in range(3):
        with pytest.raises(BackendUnavailableError):
            store.exists(keys(1))
    exists = metrics.snapshot()["operations"]["exists"]
    assert exists["errors"] == {"BackendUnavailableError": 3}
    assert exists["calls"] == 3 and exists["hits"] == 0


def test_latency_histogram_is_cumulative_and_counts_every_call():
    metrics = MetricsLayer(MemoryBackend(), {"buckets": [0.001, 0.1, 10.0]})
    store = Store(metrics)
    for _ in range(5):
        store.exists(keys(2))
    latency = metrics.snapshot()["operations"]["exists"]["latency"]
    bounds = [bound for bound, _ in latency["buckets"]]
    counts = [count for _, count in latency["buckets"]]
    assert bounds == [0.001, 0.1, 10.0, "+Inf"]
    assert counts == sorted(counts) and counts[-1] == latency["count"] == 5
    assert latency["sum"] >= 0


def test_snapshot_is_plain_data_and_includes_lower_layers_events():
    metrics = stack_layers(MemoryBackend(), [{"kind": "integrity"}, {"kind": "metrics", "label": "l3"}])
    store = Store(metrics)
    memory = metrics.inner.inner
    Store(memory).put(keys(1), [bytes(100 + 48)])  # no integrity trailer: reads as a miss
    assert store.get(keys(1), 100) == [None]
    snapshot = json.loads(json.dumps(metrics.snapshot()))
    assert snapshot["backend"] == "l3"
    assert snapshot["events"]["integrity_miss_magic"] == 1
    assert snapshot["operations"]["get"]["hits"] == 0


def test_prometheus_text_exports_counters_histograms_and_events():
    metrics = stack_layers(MemoryBackend(), [{"kind": "integrity"}, {"kind": "metrics"}])
    store = Store(metrics)
    workload(store)
    with pytest.raises(BackendUnavailableError):
        metrics.inner.inner._exists = lambda keys: (_ for _ in ()).throw(BackendUnavailableError("down"))
        store.exists(keys(1))
    found = samples(prometheus_text(metrics))
    get = (("backend", "memory"), ("operation", "get"))
    assert found[("hicache_storage_calls_total", get)] == 1
    assert found[("hicache_storage_keys_total", get)] == 4
    assert found[("hicache_storage_hits_total", get)] == 3
    assert found[("hicache_storage_bytes_total", get)] == 300
    assert found[("hicache_storage_latency_seconds_count", get)] == 1
    assert found[("hicache_storage_latency_seconds_bucket", tuple(sorted((*get, ("le", "+Inf")))))] == 1
    error = (("backend", "memory"), ("error", "BackendUnavailableError"), ("operation", "exists"))
    assert found[("hicache_storage_errors_total", error)] == 1
    assert found[("hicache_storage_events_total", (("backend", "memory"), ("event", "integrity_miss_key")))] == 0


def test_register_on_a_registry_and_same_labels_are_summed():
    registry = CollectorRegistry()
    first = MetricsLayer(MemoryBackend(), {"label": "l3"})
    second = MetricsLayer(MemoryBackend(), {"label": "l3"})
    from hicache_storage.layers.metrics import _Collector

    registry.register(_Collector([first, second]))
    Store(first).exists(keys(2))
    Store(second).exists(keys(3))
    assert registry.get_sample_value("hicache_storage_keys_total", {"backend": "l3", "operation": "exists"}) == 5
    assert registry.get_sample_value("hicache_storage_latency_seconds_count", {"backend": "l3", "operation": "exists"}) == 2


def test_config_prometheus_publishes_on_the_default_registry_until_closed():
    from prometheus_client import REGISTRY

    label = "default-registry-test"
    store = Store(stack_layers(MemoryBackend(), [{"kind": "metrics", "label": label, "prometheus": True}]))
    other = Store(stack_layers(MemoryBackend(), [{"kind": "metrics", "label": label + "-2", "prometheus": True}]))
    store.exists(keys(4))
    assert REGISTRY.get_sample_value("hicache_storage_keys_total", {"backend": label, "operation": "exists"}) == 4
    assert REGISTRY.get_sample_value("hicache_storage_keys_total", {"backend": label + "-2", "operation": "exists"}) == 0
    store.close()
    other.close()
    assert REGISTRY.get_sample_value("hicache_storage_keys_total", {"backend": label, "operation": "exists"}) is None


def test_missing_prometheus_client_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    metrics = MetricsLayer(MemoryBackend())
    Store(metrics).exists(keys(1))  # counting needs nothing optional
    with pytest.raises(MissingDependencyError, match=r"hicache-storage\[metrics\]"):
        prometheus_text(metrics)
    with pytest.raises(MissingDependencyError):
        MetricsLayer(MemoryBackend(), {"prometheus": True})


@pytest.mark.parametrize("buckets", [[], [0.1, 0.1], [0.5, 0.1], [-1.0, 1.0]])
def test_bad_buckets_are_config_errors(buckets):
    with pytest.raises(ConfigError, match="buckets"):
        MetricsLayer(MemoryBackend(), {"buckets": buckets})


def test_find_the_metrics_layer_in_a_chain():
    store = Store(stack_layers(MemoryBackend(), [{"kind": "metrics"}, {"kind": "retry"}]))
    metrics = find_layer(store, MetricsLayer)
    store.put(keys(1), [b"x"])
    assert metrics.snapshot()["operations"]["put"]["hits"] == 1


def test_counts_are_exact_under_concurrent_callers():
    import threading

    metrics = MetricsLayer(MemoryBackend())
    store = Store(metrics)
    store.put(keys(2), [b"x" * 10] * 2)

    def hammer():
        for _ in range(300):
            store.exists(keys(3))

    threads = [threading.Thread(target=hammer) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    exists = metrics.snapshot()["operations"]["exists"]
    assert (exists["calls"], exists["keys"], exists["hits"]) == (1800, 5400, 3600)
    assert exists["latency"]["count"] == 1800
