"""The one way the SDK counts: per-operation tallies and named events, thread-safe.

A store facade (:class:`~hicache_storage.store.Store`) keeps an :class:`OperationCounters` of
what its callers asked for, and the metrics layer keeps one of what reaches its place in the
stack; both are read through the same snapshot. Layers and connectors count their own events
(timeouts, retries, integrity misses, injected faults, evictions) in an :class:`EventCounters`,
and a facade's ``stats()`` sums the events of every level of its stack.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

#: Latency bucket upper bounds in seconds, from a local memory hit to a stalled network store.
DEFAULT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class _Tally:
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


class OperationCounters:
    """Calls, keys, hits, bytes, errors by type and a latency histogram, per operation."""

    def __init__(self, operations: Iterable[str], buckets: tuple[float, ...] = DEFAULT_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self._lock = threading.Lock()
        self._ops = {op: _Tally(len(self.buckets)) for op in operations}

    def observe(self, operation: str, keys: int, call: Callable[[], Any], moved: Callable[[Any], int] | None = None) -> Any:
        """Run ``call`` and count it: its keys, its hits (``True`` results), the bytes ``moved``
        reports for its results, its latency, and the type of what it raised."""
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
            self.add(operation, keys, results, time.perf_counter() - start, error, moved)

    def add(
        self,
        operation: str,
        keys: int,
        results: Any,
        elapsed: float,
        error: str | None = None,
        moved: Callable[[Any], int] | None = None,
    ) -> None:
        counted = isinstance(results, list)
        hits = sum(1 for r in results if r is True) if counted else 0
        size = moved(results) if counted and moved is not None else 0
        bucket = bisect.bisect_left(self.buckets, elapsed)
        with self._lock:
            tally = self._ops[operation]
            tally.calls += 1
            tally.keys += keys
            tally.hits += hits
            tally.bytes += size
            tally.latency_counts[bucket] += 1
            tally.latency_sum += elapsed
            if error is not None:
                tally.errors[error] += 1

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per operation: calls, keys, hits, bytes, errors and a cumulative latency histogram
        (``latency.buckets`` is ``[upper_bound, cumulative_count]`` pairs, ``"+Inf"`` last)."""
        with self._lock:
            operations = {}
            for op, tally in self._ops.items():
                cumulative, running = [], 0
                for bound, count in zip([*self.buckets, "+Inf"], tally.latency_counts):
                    running += count
                    cumulative.append([bound, running])
                operations[op] = {
                    "calls": tally.calls,
                    "keys": tally.keys,
                    "hits": tally.hits,
                    "bytes": tally.bytes,
                    "errors": dict(tally.errors),
                    "latency": {"buckets": cumulative, "sum": tally.latency_sum, "count": running},
                }
        return operations


class EventCounters:
    """Named event counts, all starting at zero; thread-safe."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(names, 0)

    def add(self, **deltas: int) -> int:
        """Add to each named count; returns the new value of the last one."""
        value = 0
        with self._lock:
            for name, delta in deltas.items():
                value = self._counts[name] = self._counts.get(name, 0) + delta
        return value

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def sum_events(snapshots: Iterable[dict[str, int]]) -> dict[str, int]:
    """Events of several levels as one dict; a name counted at several levels is their sum."""
    merged: dict[str, int] = {}
    for snapshot in snapshots:
        for name, value in snapshot.items():
            merged[name] = merged.get(name, 0) + value
    return merged
