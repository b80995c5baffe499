"""Counters of the HiCache core: where tokens came from, what moved, how long it took.

One :class:`CacheMetrics` per engine, updated from the scheduler, backup, prefetch and load
threads (thread-safe). ``snapshot()`` returns plain numbers plus derived bandwidths, for tests,
the benchmark's tables and logs.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass


@dataclass
class CacheCounters:
    # tokens of prompts, by where their KV came from
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    computed_tokens: int = 0
    #: of computed_tokens, those the store held (see RequestResult.stored_recomputed)
    storage_recomputed_tokens: int = 0
    #: engine steps that decoded (one batched forward each)
    decode_steps: int = 0
    # device <-> host
    host_backup_pages: int = 0
    host_backup_seconds: float = 0.0
    host_backup_errors: int = 0
    load_back_tokens: int = 0
    load_back_bytes: int = 0
    load_back_seconds: float = 0.0
    # host -> storage
    storage_backup_ops: int = 0
    storage_backup_pages: int = 0
    storage_backup_skipped_pages: int = 0
    storage_backup_bytes: int = 0
    storage_backup_seconds: float = 0.0
    storage_backup_failed_batches: int = 0
    # storage -> host
    prefetch_issued: int = 0
    #: tries to issue a prefetch that found no room (the prefetch capacity, host pages free now
    #: or once evicted, a component's slots); each is tried again at a later step
    prefetch_rate_limited: int = 0
    prefetch_revoked: int = 0
    prefetch_terminated_early: int = 0
    prefetch_pages: int = 0
    prefetch_bytes: int = 0
    prefetch_seconds: float = 0.0
    prefetch_failed_batches: int = 0
    prefetch_dropped_tokens: int = 0
    #: best_effort prefetches whose request stopped waiting before anything arrived, left to land in the tree
    prefetch_left_to_land: int = 0
    # load or recompute (the cost model, hicache_storage.cost)
    #: stored pages the cost model chose to compute rather than load, and prefetches it dropped
    #: whole (what was worth loading fell below the threshold)
    prefetch_declined_pages: int = 0
    prefetch_declined_by_cost: int = 0
    #: of those, prefetches whose store was not even asked: all it could hold was too little
    #: (the pages declined then count only those known stored: written or read by this engine)
    prefetch_lookups_skipped: int = 0
    #: prefetches whose lookup this engine answered itself: every page asked was one it wrote or
    #: read, on a store that drops nothing on its own (see ``Prefetcher._known_leading``)
    prefetch_lookups_known: int = 0
    #: prefetches whose store was not asked about pages only another engine could have written:
    #: recent lookups found such pages too seldom to be worth waiting for (``CostModel.lookup_pays``)
    prefetch_lookups_unlikely: int = 0
    #: prefetches stopped because the pages still to come would arrive after computing them
    prefetch_stopped_by_cost: int = 0
    #: prefetches never issued (no host slots) whose request computed instead, having waited as
    #: long as computing the pages takes
    prefetch_skipped_by_cost: int = 0
    #: storage backups deferred to the node's next hit (write-through degraded to selective while
    #: the store is the slow leg), and seconds backups waited for reads
    storage_backup_deferred: int = 0
    storage_backup_yield_seconds: float = 0.0
    # faults
    storage_errors: int = 0
    storage_timeouts: int = 0
    #: permanent or persistent storage errors (bad credentials, contract violations, retries exhausted)
    storage_permanent_errors: int = 0
    #: times an attached store was given up after such an error (at most once per attachment)
    storage_disabled: int = 0
    #: the store's breaker opening (consecutive timeouts or temporary errors) and closing (a probe answered)
    storage_breaker_opened: int = 0
    storage_breaker_closed: int = 0
    #: data calls not made while the breaker was open
    storage_skipped_calls: int = 0
    #: prefetches answered "nothing stored" at once, and backups skipped, while the breaker was open
    prefetch_skipped_unhealthy: int = 0
    storage_backup_skipped_unhealthy: int = 0
    #: calls made through private buffers because pages pinned by abandoned calls reached their cap
    storage_staged_calls: int = 0
    # evictions
    device_evicted_tokens: int = 0
    host_evicted_tokens: int = 0


class CacheMetrics:
    """Thread-safe accumulation of :class:`CacheCounters`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters = CacheCounters()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._counters, name, getattr(self._counters, name) + delta)

    def reset(self) -> None:
        with self._lock:
            self._counters = CacheCounters()

    def snapshot(self) -> dict[str, float]:
        """Every counter, plus ``*_gbps`` bandwidths (GB/s over the time spent moving) and hit rate."""
        with self._lock:
            data: dict[str, float] = asdict(self._counters)
        for prefix in ("load_back", "storage_backup", "prefetch"):
            seconds = data[f"{prefix}_seconds"]
            data[f"{prefix}_gbps"] = data[f"{prefix}_bytes"] / seconds / 1e9 if seconds > 0 else 0.0
        prompt = data["prompt_tokens"]
        cached = data["device_hit_tokens"] + data["host_hit_tokens"] + data["storage_hit_tokens"]
        data["cache_hit_rate"] = cached / prompt if prompt else 0.0
        return data
