"""Metrics: calls, keys, hits, errors, bytes and latency per operation, Prometheus-exportable.

Each hook call (one batch chunk as the store sees it) is one observation. Per operation
(``exists``, ``get``, ``put``, ``delete``, ``clear``, ``register_buffer``) it counts calls, keys,
hits (pages found for exists/get, stored for put, removed for delete), errors by exception type,
bytes moved (pages read on a get hit, written on a stored put) and a latency histogram with fixed
buckets. Put ``metrics`` outermost to see what callers see, or innermost to see the store itself.

:meth:`MetricsWrapper.snapshot` returns everything as plain data, including the wrapper-specific
counters of the layers below (timeouts, retries, integrity misses, injected faults) as
``events``. With ``prometheus_client`` installed (the ``metrics`` extra, imported only when
asked for) :func:`prometheus_text` renders the Prometheus exposition format, and config
``prometheus: true`` (or :meth:`MetricsWrapper.register_prometheus`) publishes the wrapper on
the process's default registry, under ``hicache_storage_*`` names labelled by ``backend`` and
``operation``. All counters are updated under one lock per wrapper; thread-safe.
"""

from __future__ import annotations

import bisect
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pydantic

from hicache_storage.backend import _STAT_NAMES, StorageBackend
from hicache_storage.buffers import Segments, segments_size
from hicache_storage.config import BackendConfig
from hicache_storage.errors import MissingDependencyError
from hicache_storage.keys import Namespace, PageKey
from hicache_storage.wrappers.base import OPERATIONS, BackendWrapper, unwrap

#: Latency bucket upper bounds in seconds, from a local memory hit to a stalled network store.
DEFAULT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


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


@dataclass
class _OperationStats:
    buckets: int
    calls: int = 0
    keys: int = 0
    hits: int = 0
    bytes: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    latency_counts: list[int] = field(default_factory=list)  # per bucket, the last one is +Inf
    latency_sum: float = 0.0

    def __post_init__(self) -> None:
        self.latency_counts = [0] * (self.buckets + 1)


class MetricsWrapper(BackendWrapper):
    """Counts and times every call; read with :meth:`snapshot` or export to Prometheus."""

    kind = "metrics"
    Config = MetricsConfig
    config: MetricsConfig

    def __init__(self, inner: StorageBackend, config: MetricsConfig | dict[str, Any] | str | None = None) -> None:
        super().__init__(inner, config)
        self.label = self.config.label or unwrap(inner).name
        self._lock = threading.Lock()
        self._ops = {op: _OperationStats(len(self.config.buckets)) for op in OPERATIONS}
        if self.config.prometheus:
            self.register_prometheus()

    # --- hooks --------------------------------------------------------------------------------

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        return self._observe("exists", len(keys), lambda: super(MetricsWrapper, self)._exists(keys))

    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        return self._observe("get", len(keys), lambda: super(MetricsWrapper, self)._get_into(keys, targets), targets)

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        return self._observe("put", len(keys), lambda: super(MetricsWrapper, self)._put_from(keys, sources), sources)

    def _delete(self, keys: list[PageKey]) -> list[bool]:
        return self._observe("delete", len(keys), lambda: super(MetricsWrapper, self)._delete(keys))

    def _clear(self, namespace: Namespace) -> None:
        self._observe("clear", 0, lambda: super(MetricsWrapper, self)._clear(namespace))

    def _register_buffer(self, view: memoryview) -> None:
        self._observe("register_buffer", 0, lambda: super(MetricsWrapper, self)._register_buffer(view))

    def _close(self) -> None:
        _DEFAULT_COLLECTOR.remove(self)
        super()._close()

    def _observe(self, operation: str, nkeys: int, call: Callable[[], Any], buffers: list[Segments] | None = None) -> Any:
        start = time.perf_counter()
        error: str | None = None
        results = None
        try:
            results = call()
            return results
        except BaseException as exc:
            error = type(exc).__name__
            raise
        finally:
            elapsed = time.perf_counter() - start
            hits = sum(results) if isinstance(results, list) else 0
            moved = 0
            if buffers is not None and isinstance(results, list):
                moved = sum(segments_size(b) for b, ok in zip(buffers, results) if ok)
            bucket = bisect.bisect_left(self.config.buckets, elapsed)
            with self._lock:
                stats = self._ops[operation]
                stats.calls += 1
                stats.keys += nkeys
                stats.hits += hits
                stats.bytes += moved
                stats.latency_counts[bucket] += 1
                stats.latency_sum += elapsed
                if error is not None:
                    stats.errors[error] += 1

    # --- reading ------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Everything counted so far as plain data (JSON-serializable).

        ``operations[op]["latency"]["buckets"]`` is a list of ``[upper_bound, cumulative_count]``
        with ``"+Inf"`` last, as in Prometheus; ``events`` holds the lower layers' counters.
        """
        with self._lock:
            operations = {}
            for op, stats in self._ops.items():
                cumulative, running = [], 0
                for bound, count in zip([*self.config.buckets, "+Inf"], stats.latency_counts):
                    running += count
                    cumulative.append([bound, running])
                operations[op] = {
                    "calls": stats.calls,
                    "keys": stats.keys,
                    "hits": stats.hits,
                    "bytes": stats.bytes,
                    "errors": dict(stats.errors),
                    "latency": {"buckets": cumulative, "sum": stats.latency_sum, "count": running},
                }
        events = {name: value for name, value in self.inner.stats().items() if name not in _STAT_NAMES}
        return {"backend": self.label, "operations": operations, "events": events}

    def register_prometheus(self, registry: Any = None) -> None:
        """Publish this wrapper's metrics on ``registry`` (default: prometheus_client's global one).

        On the default registry every wrapper shares one collector (its metric names may be
        registered only once); wrappers with the same label are summed, so give them the same
        ``buckets`` (or distinct labels).
        """
        if registry is None:
            _DEFAULT_COLLECTOR.add(self)
        else:
            registry.register(_Collector([self]))


def prometheus_text(*wrappers: MetricsWrapper) -> str:
    """The Prometheus exposition text for ``wrappers`` (on a private registry)."""
    client = _prometheus_client()
    registry = client.CollectorRegistry(auto_describe=True)
    registry.register(_Collector(list(wrappers)))
    return client.generate_latest(registry).decode()


# --- Prometheus -------------------------------------------------------------------------------

def _prometheus_client() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise MissingDependencyError("metrics", "prometheus_client", "metrics") from exc
    return prometheus_client


class _Collector:
    """A prometheus_client custom collector over a set of wrappers, grouped by label."""

    def __init__(self, wrappers: list[MetricsWrapper]) -> None:
        self._wrappers = wrappers

    def wrappers(self) -> list[MetricsWrapper]:
        return list(self._wrappers)

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
            "hicache_storage_events", "Wrapper events: timeouts, retries, integrity misses, injected faults",
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
        for wrapper in self.wrappers():
            snapshot = wrapper.snapshot()
            into = merged.get(wrapper.label)
            if into is None:
                merged[wrapper.label] = snapshot
            else:
                _add_snapshot(into, snapshot)
        return merged


class _DefaultCollector(_Collector):
    """The one collector on prometheus_client's default registry, holding wrappers weakly."""

    def __init__(self) -> None:
        super().__init__([])
        self._members: weakref.WeakSet[MetricsWrapper] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._register_lock = threading.Lock()
        self._registered = False

    def wrappers(self) -> list[MetricsWrapper]:
        with self._lock:
            return sorted(self._members, key=lambda w: w.label)

    def add(self, wrapper: MetricsWrapper) -> None:
        client = _prometheus_client()
        with self._register_lock:  # register() calls collect(), which takes self._lock
            if not self._registered:
                client.REGISTRY.register(self)
                self._registered = True
        with self._lock:
            self._members.add(wrapper)

    def remove(self, wrapper: MetricsWrapper) -> None:
        with self._lock:
            self._members.discard(wrapper)


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
