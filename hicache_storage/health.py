"""Store health as a state: a circuit breaker a caller holds for one store.

A store that times out or fails temporarily again and again is not called for data until it
answers again. The breaker is *closed* while calls go through. ``failures_to_open`` consecutive
timeouts or temporary errors of one operation (``get``, ``put``, ``exists``...) *open* it: the
caller makes no data call (a lookup answers "nothing stored" at once, a write is skipped), and
a cheap *probe* (one call the caller supplies, such as an ``exists`` of one key) runs on a
backoff, off the caller's thread. When a probe answers, the breaker closes and calls resume.

The backoff starts at ``probe_backoff_s`` and doubles at each opening, up to
``probe_backoff_max_s``; it starts over once the operation that opened the breaker succeeds
again. So a store whose reads hang while its probe answers (a half-broken server) is retried
ever more rarely instead of every ``probe_backoff_s``.

Each transition is one log line (a warning when it opens, info when it closes) and one call of
``on_transition``, where a caller counts it. Permanent errors are not the breaker's business:
retrying cannot fix them, so a caller stops using the store for good (see
:mod:`hicache_storage.errors`).

Use::

    breaker = CircuitBreaker("redis", probe=lambda: store.exists([probe_key]))
    if breaker.allows_call():
        try:
            results = store.get_into(keys, targets)
        except StorageError as exc:
            if not exc.permanent:
                breaker.record_failure("get", exc)
        else:
            breaker.record_success("get")

Thread-safe: any thread may ask and record.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


class BreakerState(str, enum.Enum):
    #: Data calls go through.
    CLOSED = "closed"
    #: No data calls; a probe runs on a backoff.
    OPEN = "open"


@dataclass(frozen=True)
class BreakerConfig:
    #: Consecutive timeouts or temporary errors of one operation that open the breaker.
    failures_to_open: int = 3
    #: Wait before the first probe after the breaker opens.
    probe_backoff_s: float = 0.5
    #: The longest wait between probes.
    probe_backoff_max_s: float = 5.0

    def __post_init__(self) -> None:
        if self.failures_to_open < 1:
            raise ValueError(f"failures_to_open must be at least 1, got {self.failures_to_open}")
        if not 0 < self.probe_backoff_s <= self.probe_backoff_max_s:
            raise ValueError(
                f"need 0 < probe_backoff_s <= probe_backoff_max_s, got {self.probe_backoff_s} and {self.probe_backoff_max_s}"
            )


def _probe_on_a_thread(probe: Callable[[], None]) -> None:
    threading.Thread(target=probe, name="hicache-store-probe", daemon=True).start()


class CircuitBreaker:
    """Whether one store may be called for data now (see the module docstring).

    ``probe`` makes one cheap call to the store: returning means it answered, raising means it
    did not. It should be bounded (a store behind a timeout layer); one that never returns keeps
    the breaker open. ``run_probe`` starts a probe off the caller's thread (a daemon thread by
    default; a test passes ``lambda probe: probe()``), ``clock`` is the time source (seconds),
    ``on_transition(old, new)`` runs after each change of state.
    """

    def __init__(
        self,
        store: str,
        probe: Callable[[], object],
        config: BreakerConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        run_probe: Callable[[Callable[[], None]], None] = _probe_on_a_thread,
        on_transition: Callable[[BreakerState, BreakerState], None] | None = None,
    ) -> None:
        self.store = store
        self.config = config or BreakerConfig()
        self._probe = probe
        self._clock = clock
        self._run_probe = run_probe
        self._on_transition = on_transition
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        #: Consecutive failures per operation since its last success.
        self._failures: dict[str, int] = {}
        #: The operation whose failures opened the breaker last; its next success resets the backoff.
        self._opened_by: str | None = None
        self._backoff = self.config.probe_backoff_s
        self._next_probe_at = 0.0
        self._opened_at = 0.0
        self._probing = False
        self._closed_for_good = False

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def backoff_s(self) -> float:
        """The wait before the next probe while open (the next opening's, while closed)."""
        return self._backoff

    def allows_call(self) -> bool:
        """Whether a data call may be made now. While open: False, and a probe starts if one is
        due and none is running."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            start = not self._probing and not self._closed_for_good and self._clock() >= self._next_probe_at
            if start:
                self._probing = True
        if start:
            self._run_probe(self._probe_once)
        return False

    def record_success(self, operation: str) -> None:
        """A data call of ``operation`` answered (misses and per-key failures are answers)."""
        with self._lock:
            self._failures.pop(operation, None)
            if operation == self._opened_by and self._state is BreakerState.CLOSED:
                self._opened_by = None
                self._backoff = self.config.probe_backoff_s

    def record_failure(self, operation: str, error: BaseException) -> None:
        """A data call of ``operation`` timed out or failed temporarily."""
        with self._lock:
            count = self._failures[operation] = self._failures.get(operation, 0) + 1
            if self._state is not BreakerState.CLOSED or count < self.config.failures_to_open:
                return
            if self._opened_by is not None:  # reopened before the operation succeeded once: probe less often
                self._backoff = min(2 * self._backoff, self.config.probe_backoff_max_s)
            self._opened_by = operation
            self._failures.clear()
            self._opened_at = self._clock()
            self._next_probe_at = self._opened_at + self._backoff
            self._state = BreakerState.OPEN
            backoff = self._backoff
        log.warning(
            "storage %s unhealthy: %d consecutive %s calls timed out or failed temporarily (last: %s: %s); "
            "no data calls until a probe answers (first probe in %.3g s)",
            self.store,
            count,
            operation,
            type(error).__name__,
            error,
            backoff,
        )
        self._transition(BreakerState.CLOSED, BreakerState.OPEN)

    def close(self) -> None:
        """No more probes (one running finishes on its own); the caller is done with the store."""
        with self._lock:
            self._closed_for_good = True

    def _probe_once(self) -> None:
        try:
            self._probe()
        except Exception as exc:
            with self._lock:
                self._probing = False
                self._backoff = min(2 * self._backoff, self.config.probe_backoff_max_s)
                self._next_probe_at = self._clock() + self._backoff
                backoff = self._backoff
            log.debug("storage %s probe failed (%s: %s); next in %.3g s", self.store, type(exc).__name__, exc, backoff)
            return
        with self._lock:
            self._probing = False
            if self._state is not BreakerState.OPEN:
                return
            self._state = BreakerState.CLOSED
            self._failures.clear()
            was_open = self._clock() - self._opened_at
        log.info("storage %s answers again after %.3g s unhealthy; data calls resume", self.store, was_open)
        self._transition(BreakerState.OPEN, BreakerState.CLOSED)

    def _transition(self, old: BreakerState, new: BreakerState) -> None:
        if self._on_transition is not None:
            try:
                self._on_transition(old, new)
            except Exception:  # a caller's counter must not break the breaker
                log.exception("the breaker's on_transition callback failed")
