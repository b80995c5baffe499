"""The store as each of vLLM's processes holds it: opened from the config, called through a breaker.

vLLM has no use for a storage error: a lookup that fails is a miss, a read that fails is a block
to recompute, a write that fails is a page not stored. So every data call goes through
:meth:`GuardedStore.call`: consecutive timeouts or temporary errors open the store's breaker
(:mod:`hicache_storage.health`), and while it is open no data call is made until a one-key probe
answers; a permanent error (bad credentials, a connector breaking the contract) detaches the
store for the life of the process, with one error logged (a persistent error, one a retry layer
gave up on, counts as temporary here). Neither reaches vLLM.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from hicache_storage.errors import ErrorStatus, StorageError
from hicache_storage.health import BreakerState, CircuitBreaker
from hicache_storage.keys import KeyScope
from hicache_storage.spec import open_store
from hicache_storage.vllm.config import VllmConnectorConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")


class GuardedStore:
    """One open store, its breaker and its health counters. Thread-safe."""

    def __init__(self, config: VllmConnectorConfig, probe_scope: KeyScope) -> None:
        breaker_config = config.breaker_config()
        self.name = config.connector
        self.store = open_store(config.store_spec())
        self._probe_key = probe_scope.key("0" * 64)
        self.breaker = CircuitBreaker(self.name, self._probe, breaker_config, on_transition=self._count_transition)
        #: breaker transitions, calls skipped while it was open, calls that failed, by operation
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self.detached = False

    def call(self, operation: str, what: str, unhealthy: T, fn: Callable[[], T]) -> T:
        """``fn()``, or ``unhealthy`` at once while the breaker is open or the store detached, or
        when it times out or fails (counted, logged; a permanent error detaches the store)."""
        if self.detached or not self.breaker.allows_call():
            self._count(f"skipped_{operation}")
            return unhealthy
        try:
            result = fn()
        except StorageError as exc:
            self._count(f"failed_{operation}")
            if exc.status is ErrorStatus.PERMANENT:
                self._detach(what, exc)
            else:
                self.breaker.record_failure(operation, exc)
                logger.warning("hicache_storage: %s failed, answered as if nothing were stored: %s", what, exc)
            return unhealthy
        self.breaker.record_success(operation)
        return result

    def close(self) -> None:
        self.breaker.close()
        self.store.close()

    def _detach(self, what: str, exc: StorageError) -> None:
        with self._lock:
            first, self.detached = not self.detached, True
        if first:
            self._count("detached")
            logger.error(
                "hicache_storage: %s failed with a permanent error; this process stops using store %s "
                "(vLLM goes on without L3): %s",
                what,
                self.name,
                exc,
            )

    def _probe(self) -> None:
        self.store.exists([self._probe_key])

    def _count(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1

    def _count_transition(self, old: BreakerState, new: BreakerState) -> None:
        self._count("breaker_opened" if new is BreakerState.OPEN else "breaker_closed")
