"""Metrics: calls, keys, hits, errors, bytes and latency per operation, Prometheus-exportable.

Each hook call (one batch chunk as the store sees it) is one observation. Per operation
(``exists``, ``get``, ``put``, ``delete``, ``clear``, ``register_buffer``) it counts calls, keys,
hits (pages found for exists/get, stored for put, removed for delete), errors by exception type,
bytes moved (pages read on a get hit, written on a stored put) and a latency histogram with fixed
buckets. Put ``metrics`` outermost to see what callers see, or innermost to see the store itself.

:meth:`MetricsLayer.snapshot` returns everything as plain data, including the layer-specific
counters of the layers below (timeouts, retries, integrity misses, injected faults) as
``events``. With ``prometheus_client`` installed (the ``metrics`` extra, imported only when
asked for) :func:`prometheus_text` renders the Prometheus exposition format, and config
``prometheus: true`` (or :meth:`MetricsLayer.register_prometheus`) publishes the layer on
the process's default registry, under ``hicache_storage_*`` names labelled by ``backend`` and
``operation``. It counts with the same :class:`~hicache_storage.counters.OperationCounters` a
store facade keeps for its callers, at this layer's place in the stack; thread-safe.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pydantic

from hicache_storage.connector import Level
from hicache_storage.buffers import Segments, segments_size
from hicache_storage.config import BackendConfig
from hicache_storage.counters import DEFAULT_BUCKETS, OperationCounters, sum_events
from hicache_storage.errors import MissingDependencyError
from hicache_storage.keys import Namespace, PageKey
from hicache_storage.layers.base import OPERATIONS, Layer, connector_of


class MetricsConfig(BackendConfig):
    label: str | None = pydantic.Field(None, description="value of the 'backend' label; omit to use the connector's name")
    buckets: tuple[float, ...] = pydantic.Field(
        DEFAULT_BUCKETS, min_length=1, description="latency histogram bucket upper bounds in seconds, increasing"
    )
    prometheus: bool = pydantic.Field(
        False, description="publish on prometheus_client's default registry (needs the 'metrics' extra)"
    )

    @pydantic.field_validator("buckets")
    @classmethod
    def _increasing(cls, buckets: tuple[float, ...]) -> tuple[float, ...]:
        if any(b <= 0 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError("bucket bounds must be positive and strictly increasing")
        return buckets


class MetricsLayer(Layer):
    """Counts and times every call; read with :meth:`snapshot` or export to Prometheus."""

    kind = "metrics"
    Config = MetricsConfig
    config: MetricsConfig

    def __init__(self, inner: Level, config: MetricsConfig | dict[str, Any] | str | None = None) -> None:
        super().__init__(inner, config)
        self.label = self.config.label or connector_of(inner).name
        self.counters = OperationCounters(OPERATIONS, self.config.buckets)
        if self.config.prometheus:
            self.register_prometheus()

    # --- hooks --------------------------------------------------------------------------------

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        return self._observe("exists", len(keys), lambda: super(MetricsLayer, self)._exists(keys))

    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        return self._observe("get", len(keys), lambda: super(MetricsLayer, self)._get_into(keys, targets), targets)

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        return self._observe("put", len(keys), lambda: super(MetricsLayer, self)._put_from(keys, sources), sources)

    def _delete(self, keys: list[PageKey]) -> list[bool]:
        return self._observe("delete", len(keys), lambda: super(MetricsLayer, self)._delete(keys))

    def _clear(self, namespace: Namespace) -> None:
        self._observe("clear", 0, lambda: super(MetricsLayer, self)._clear(namespace))

    def _register_buffer(self, view: memoryview) -> None:
        self._observe("register_buffer", 0, lambda: super(MetricsLayer, self)._register_buffer(view))

    def _close(self) -> None:
        _DEFAULT_COLLECTOR.remove(self)
        super()._close()

    def _observe(self, operation: str, nkeys: int, call: Callable[[], Any], buffers: list[Segments] | None = None) -> Any:
        if buffers is None:
            return self.counters.observe(operation, nkeys, call)
        return self.counters.observe(operation, nkeys, call, lambda results: sum(segments_size(b) for b, ok in zip(buffers, results) if ok))

    # --- reading ------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Everything counted so far as plain data (JSON-serializable).

        ``operations[op]["latency"]["buckets"]`` is a list of ``[upper_bound, cumulative_count]``
        with ``"+Inf"`` last, as in Prometheus; ``events`` holds the lower layers' counters.
        """
        operations = self.counters.snapshot()
        events = sum_events(level.event_counts() for level in self.inner.levels())
        return {"backend": self.label, "operations": operations, "events": events}

    def register_prometheus(self, registry: Any = None) -> None:
        """Publish this layer's metrics on ``registry`` (default: prometheus_client's global one).

        On the default registry every layer shares one collector (its metric names may be
        registered only once); layers with the same label are summed, so give them the same
        ``buckets`` (or distinct labels).
        """
        if registry is None:
            _DEFAULT_COLLECTOR.add(self)
        else:
            registry.register(_Collector([self]))


def prometheus_text(*layers: MetricsLayer) -> str:
    """The Prometheus exposition text for ``layers`` (on a private registry)."""
    client = _prometheus_client()
    registry = client.CollectorRegistry(auto_describe=True)
    registry.register(_Collector(list(layers)))
    return client.generate_latest(registry).decode()


# --- Prometheus -------------------------------------------------------------------------------

def _prometheus_client() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise MissingDependencyError("metrics", "prometheus_client", "metrics") from exc
    return prometheus_client


class _Collector:
    """A prometheus_client custom collector over a set of layers, grouped by label."""

    def __init__(self, layers: list[MetricsLayer]) -> None:
        self._layers = layers

    def layers(self) -> list[MetricsLayer]:
        return list(self._layers)

    def collect(self) -> Iterator[Any]:
        metrics = _prometheus_client().metrics_core
        labels = ["backend", "operation"]
        counters = {
            name: metrics.CounterMetricFamily(f"hicache_storage_{name}", help_text, labels=labels)
            for name, help_text in (
                ("calls", "Calls to the storage backend, one per batch the store sees"),
                ("keys", "Page keys in those calls"),
                ("hits", "Pages found (exists, get), stored (put) or removed (delete)"),
                ("bytes", "Page bytes read on hits and written on stored puts"),
            )
        }
        errors = metrics.CounterMetricFamily(
            "hicache_storage_errors", "Calls that raised, by exception type", labels=[*labels, "error"]
        )
        events = metrics.CounterMetricFamily(
            "hicache_storage_events", "Layer events: timeouts, retries, integrity misses, injected faults",
            labels=["backend", "event"],
        )
        latency = metrics.HistogramMetricFamily(
            "hicache_storage_latency_seconds", "Latency of one call in seconds", labels=labels
        )
        for label, snapshot in self._merged().items():
            for op, stats in snapshot["operations"].items():
                for name, family in counters.items():
                    family.add_metric([label, op], stats[name])
                for error, count in sorted(stats["errors"].items()):
                    errors.add_metric([label, op, error], count)
                buckets = [(str(bound) if bound == "+Inf" else repr(float(bound)), count) for bound, count in stats["latency"]["buckets"]]
                latency.add_metric([label, op], buckets, stats["latency"]["sum"])
            for event, count in sorted(snapshot["events"].items()):
                events.add_metric([label, event], count)
        yield from counters.values()
        yield errors
        yield events
        yield latency

    def _merged(self) -> dict[str, dict[str, Any]]:
        merged: dict[str, dict[str, Any]] = {}
        for layer in self.layers():
            snapshot = layer.snapshot()
            into = merged.get(layer.label)
            if into is None:
                merged[layer.label] = snapshot
            else:
                _add_snapshot(into, snapshot)
        return merged


class _DefaultCollector(_Collector):
    """The one collector on prometheus_client's default registry, holding layers weakly."""

    def __init__(self) -> None:
        super().__init__([])
        self._members: weakref.WeakSet[MetricsLayer] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._register_lock = threading.Lock()
        self._registered = False

    def layers(self) -> list[MetricsLayer]:
        with self._lock:
            return sorted(self._members, key=lambda w: w.label)

    def add(self, layer: MetricsLayer) -> None:
        client = _prometheus_client()
        with self._register_lock:  # register() calls collect(), which takes self._lock
            if not self._registered:
                client.REGISTRY.register(self)
                self._registered = True
        with self._lock:
            self._members.add(layer)

    def remove(self, layer: MetricsLayer) -> None:
        with self._lock:
            self._members.discard(layer)


_DEFAULT_COLLECTOR = _DefaultCollector()


def _add_snapshot(into: dict[str, Any], other: dict[str, Any]) -> None:
    for op, stats in other["operations"].items():
        target = into["operations"][op]
        for name in ("calls", "keys", "hits", "bytes"):
            target[name] += stats[name]
        for error, count in stats["errors"].items():
            target["errors"][error] = target["errors"].get(error, 0) + count
        latency = target["latency"]
        for pair, (_, count) in zip(latency["buckets"], stats["latency"]["buckets"]):
            pair[1] += count
        latency["sum"] += stats["latency"]["sum"]
        latency["count"] += stats["latency"]["count"]
    for event, count in other["events"].items():
        into["events"][event] = into["events"].get(event, 0) + count
