"""How the core calls storage from its threads: never raising, and reading only leading successes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from hicache_storage.errors import StorageTimeoutError

from hicache_core.metrics import CacheMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")
D = TypeVar("D")


def guarded_call(
    metrics: CacheMetrics,
    call: Callable[[], T],
    default: D,
    operation: str,
    on_abandoned: Callable[[StorageTimeoutError], None] | None = None,
) -> T | D:
    """Run one storage call; any exception is logged, counted and replaced by ``default``.

    The backup and prefetch threads go through this, so no backend failure can end them. A
    timeout whose call may still use the caller's buffers (a zero-copy timeout: ``settled`` is
    set) is handed to ``on_abandoned``, which must keep those buffers untouched until it settles.
    """
    try:
        return call()
    except StorageTimeoutError as exc:
        log.warning("storage %s timed out: %s", operation, exc)
        metrics.add(storage_timeouts=1)
        if exc.settled is not None and not exc.settled.is_set():
            if on_abandoned is None:
                raise RuntimeError(f"a storage {operation} that used caller buffers was abandoned with no one to wait for it") from exc
            on_abandoned(exc)
    except Exception as exc:
        log.warning("storage %s failed: %s: %s", operation, type(exc).__name__, exc)
        metrics.add(storage_errors=1)
    return default


def leading_successes(results: list[bool] | None) -> int:
    """How many results, from the first, are True (reads use only the leading run of successes)."""
    if results is None:
        return 0
    count = 0
    for ok in results:
        if not ok:
            break
        count += 1
    return count
