"""How the core calls storage from its threads: never raising, reading only leading successes,
not calling a store its breaker holds open, and giving a store up, saying so once, when it fails
in a way retrying cannot fix."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from hicache_storage.errors import StorageError, StorageTimeoutError
from hicache_storage.health import CircuitBreaker

from hicache_core.metrics import CacheMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")
D = TypeVar("D")


class StorageHealth:
    """Whether the core may still call one attached store; shared by the backup and prefetch threads.

    A store that raised a permanent or persistent :class:`~hicache_storage.errors.StorageError`
    (bad credentials, a connector breaking the contract, an outage the retry layer gave up on) is
    *failed*: the threads skip every later backup and prefetch without calling it, so requests
    compute what storage would have served. The first such error is logged once, as an error
    naming the store, what failed and how to get it back, and counted in ``storage_disabled``;
    every one in ``storage_permanent_errors``. A new attachment starts healthy. Thread-safe.

    Timeouts and temporary errors go to ``breaker`` (:class:`~hicache_storage.health.CircuitBreaker`)
    when there is one: while it is open no data call is made (``storage_skipped_calls``).
    """

    def __init__(self, metrics: CacheMetrics, store: str, breaker: CircuitBreaker | None = None) -> None:
        self.metrics = metrics
        self.store = store
        self.breaker = breaker
        self._lock = threading.Lock()
        self._failure: StorageError | None = None

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def allows_call(self) -> bool:
        """Whether a data call may be made now: the store is not given up and its breaker is closed
        (asking an open breaker may start its probe). Counts a refusal in ``storage_skipped_calls``."""
        if self.failed:
            return False
        if self.breaker is None or self.breaker.allows_call():
            return True
        self.metrics.add(storage_skipped_calls=1)
        return False

    @property
    def failure(self) -> StorageError | None:
        """The error that made the core give the store up, or None while it is in use."""
        return self._failure

    def give_up(self, exc: StorageError, operation: str) -> None:
        """Stop using the store over ``exc`` (a permanent or persistent error of ``operation``)."""
        self.metrics.add(storage_permanent_errors=1)
        with self._lock:
            first = self._failure is None
            if first:
                self._failure = exc
        if first:
            self.metrics.add(storage_disabled=1)
            log.error(
                "storage %s disabled: %s failed with a %s %s: %s. Requests go on without L3 (they compute "
                "what it would have served) and the store is not called again; fix the cause, then detach "
                "and re-attach the storage (Engine.detach_storage / attach_storage) to use it again",
                self.store,
                operation,
                exc.status.value,
                type(exc).__name__,
                exc,
            )
        else:
            log.debug("storage %s (already disabled) %s failed: %s", self.store, operation, exc)


def guarded_call(
    metrics: CacheMetrics,
    call: Callable[[], T],
    default: D,
    operation: str,
    on_abandoned: Callable[[StorageTimeoutError], None] | None = None,
    *,
    health: StorageHealth | None = None,
) -> T | D:
    """Run one storage call; any exception is logged, counted and replaced by ``default``.

    The backup and prefetch threads go through this, so no backend failure can end them. A
    timeout whose call may still use the caller's buffers (a zero-copy timeout: ``settled`` is
    set) is handed to ``on_abandoned``, which must keep those buffers untouched until it settles.
    With ``health``, a store already given up or whose breaker is open is not called (``default``
    at once); a permanent or persistent error gives it up (:meth:`StorageHealth.give_up`) instead
    of a warning per call; timeouts and temporary errors are warned about and recorded by the
    breaker (the store stays in use until it opens), an answer resets the breaker's count.
    Exceptions that are no ``StorageError`` (a connector bug) are warned about and nothing more.
    """
    if health is not None and not health.allows_call():
        return default
    breaker = health.breaker if health is not None else None
    try:
        result = call()
    except StorageTimeoutError as exc:
        log.warning("storage %s timed out: %s", operation, exc)
        metrics.add(storage_timeouts=1)
        if exc.settled is not None and not exc.settled.is_set():
            if on_abandoned is None:
                raise RuntimeError(f"a storage {operation} that used caller buffers was abandoned with no one to wait for it") from exc
            on_abandoned(exc)
        if health is not None and exc.permanent:  # a timeout the retry layer gave up on
            health.give_up(exc, operation)
        elif breaker is not None:
            breaker.record_failure(operation, exc)
    except StorageError as exc:
        metrics.add(storage_errors=1)
        if health is not None and exc.permanent:
            health.give_up(exc, operation)
        else:
            log.warning("storage %s failed: %s: %s", operation, type(exc).__name__, exc)
            if breaker is not None:
                breaker.record_failure(operation, exc)
    except Exception as exc:
        log.warning("storage %s failed: %s: %s", operation, type(exc).__name__, exc)
        metrics.add(storage_errors=1)
    else:
        if breaker is not None:
            breaker.record_success(operation)
        return result
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
