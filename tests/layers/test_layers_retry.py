"""The retry layer: retryable errors only, exponential backoff with full jitter, a deadline.

Pauses are recorded through a fake clock instead of slept, so the schedule is checked exactly and
no test depends on timing.
"""

import pytest

from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.errors import (
    AuthenticationError,
    BackendUnavailableError,
    ErrorStatus,
    InvalidKeyError,
    StorageError,
    StorageTimeoutError,
    ThrottledError,
)
from hicache_storage.keys import KeyScope, Namespace, PageKey
from hicache_storage.layers import RetryLayer, stack_layers
from hicache_storage.store import Store

SCOPE = KeyScope(Namespace(model="retry-tests", kv_dtype="bfloat16", page_size=16))


def keys(n: int) -> list[PageKey]:
    return SCOPE.keys([f"{i:016x}" for i in range(n)])


class Flaky(MemoryBackend):
    """Raises ``error`` from exists for the first ``failures`` calls, then answers."""

    def __init__(self, failures: int, error: Exception, clock=None, try_seconds: float = 0.0):
        super().__init__()
        self.failures, self.error, self.tries = failures, error, 0
        self.clock, self.try_seconds, self.try_starts = clock, try_seconds, []

    def _exists(self, keys):
        self.tries += 1
        if self.clock is not None:
            self.try_starts.append(self.clock.now)
            self.clock.now += self.try_seconds
        if self.tries <= self.failures:
            raise self.error
        return super()._exists(keys)


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.pauses: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def retrying(inner, **config) -> tuple[Store, FakeClock]:
    """A store over a retry layer over ``inner`` whose pauses go to a fake clock, and the clock."""
    retry = RetryLayer(inner, {"seed": 7, **config})
    clock = FakeClock()
    retry._sleep, retry._clock = clock.sleep, lambda: clock.now
    if isinstance(inner, Flaky) and inner.clock is None:
        inner.clock = clock
    return Store(retry), clock


@pytest.mark.parametrize("error", [BackendUnavailableError("refused"), StorageTimeoutError("slow"), ThrottledError("503")])
def test_retryable_errors_are_retried_until_the_call_succeeds(error):
    inner = Flaky(2, error)
    store, clock = retrying(inner, attempts=3, base_seconds=0.1, cap_seconds=10)
    assert store.exists(keys(1)) == [False]
    assert inner.tries == 3
    assert len(clock.pauses) == 2
    assert 0 <= clock.pauses[0] <= 0.1 and 0 <= clock.pauses[1] <= 0.2  # full jitter under base * 2**n
    assert store.stats()["retries"] == 2 and store.stats()["retries_exhausted"] == 0


def test_the_last_error_is_raised_when_attempts_run_out():
    error = BackendUnavailableError("refused")
    inner = Flaky(10, error)
    store, clock = retrying(inner, attempts=3)
    with pytest.raises(BackendUnavailableError) as caught:
        store.exists(keys(1))
    assert caught.value is error
    assert caught.value.status is ErrorStatus.PERSISTENT and caught.value.permanent and not caught.value.retryable
    assert "gave up after 3 tries" in caught.value.__notes__[-1]
    assert inner.tries == 3 and len(clock.pauses) == 2
    assert store.stats()["retries_exhausted"] == 1


@pytest.mark.parametrize("error", [AuthenticationError("bad password"), InvalidKeyError("bad key"), RuntimeError("bug")])
def test_permanent_errors_and_bugs_pass_through_at_once(error):
    inner = Flaky(1, error)
    store, clock = retrying(inner, attempts=5)
    with pytest.raises(type(error)):
        store.exists(keys(1))
    assert inner.tries == 1 and clock.pauses == []
    assert store.stats()["retries"] == 0


@pytest.mark.parametrize(
    ("error", "tries"),
    [
        (StorageError("EMFILE", status=ErrorStatus.TEMPORARY), 3),  # the status decides, not the class
        (BackendUnavailableError("refused", status=ErrorStatus.PERMANENT), 1),
        (StorageError("of no declared status"), 1),
    ],
)
def test_the_status_decides_what_is_retried(error, tries):
    inner = Flaky(10, error)
    store, _ = retrying(inner, attempts=3)
    with pytest.raises(StorageError):
        store.exists(keys(1))
    assert inner.tries == tries


def test_an_error_an_inner_retry_gave_up_on_is_not_retried_again():
    inner = Flaky(100, BackendUnavailableError("down"))
    store, _ = retrying(RetryLayer(inner, {"attempts": 2, "base_seconds": 0.001}), attempts=5)
    with pytest.raises(BackendUnavailableError) as caught:
        store.exists(keys(1))
    assert inner.tries == 2 and caught.value.status is ErrorStatus.PERSISTENT


def test_no_retry_starts_after_the_deadline():
    inner = Flaky(1000, BackendUnavailableError("down"), try_seconds=0.5)
    store, clock = retrying(inner, attempts=100, base_seconds=1.0, cap_seconds=1.0, deadline_seconds=5.0)
    start = clock.now
    with pytest.raises(BackendUnavailableError):
        store.exists(keys(1))
    assert 2 <= inner.tries < 100, "the deadline, not the attempt count, must stop it"
    assert all(t < start + 5.0 for t in inner.try_starts)
    assert clock.now - inner.try_seconds <= start + 5.0
    assert store.stats()["retries_exhausted"] == 1


def test_backoff_grows_exponentially_up_to_the_cap_with_full_jitter():
    store = RetryLayer(MemoryBackend(), {"base_seconds": 0.01, "cap_seconds": 0.5, "seed": 3})
    for retry, bound in [(1, 0.01), (2, 0.02), (4, 0.08), (6, 0.32), (7, 0.5), (30, 0.5)]:
        draws = [store.backoff(retry) for _ in range(300)]
        assert all(0 <= d <= bound for d in draws)
        assert max(draws) > bound / 2 and min(draws) < bound / 2, "full jitter spreads over the whole range"


def test_the_same_seed_gives_the_same_schedule():
    first = RetryLayer(MemoryBackend(), {"seed": 11})
    second = RetryLayer(MemoryBackend(), {"seed": 11})
    assert [first.backoff(n) for n in range(1, 8)] == [second.backoff(n) for n in range(1, 8)]


def test_retry_hides_injected_retryable_faults_from_a_workload():
    store = Store(
        stack_layers(
            MemoryBackend(),
            [
                {"kind": "faults", "seed": 5, "put": {"error_rate": 0.4}, "get": {"error_rate": 0.4, "errors": ["throttled"]}},
                {"kind": "retry", "attempts": 50, "base_seconds": 0.0001, "cap_seconds": 0.0005, "deadline_seconds": None},
            ],
        )
    )
    pages = [bytes([i]) * 32 for i in range(40)]
    for i, page in enumerate(pages):
        assert store.put(keys(40)[i : i + 1], [page]) == [True]
        assert store.get(keys(40)[i : i + 1], 32) == [page]
    stats = store.stats()
    assert stats["faults_error"] > 0
    assert stats["retries"] == stats["faults_error"], "every injected error was retried, nothing more"


def test_only_the_configured_operations_are_retried():
    store = Store(
        stack_layers(
            MemoryBackend(),
            [
                {"kind": "faults", "put": {"error_rate": 1.0}, "exists": {"error_rate": 1.0}},
                {"kind": "retry", "attempts": 3, "base_seconds": 0.0001, "operations": ["exists"]},
            ],
        )
    )
    with pytest.raises(BackendUnavailableError):
        store.put(keys(1), [b"x"])
    assert store.stats()["retries"] == 0
    with pytest.raises(BackendUnavailableError):
        store.exists(keys(1))
    assert store.stats()["retries"] == 2


def test_an_unknown_operation_to_retry_is_a_config_error():
    from hicache_storage.errors import ConfigError

    with pytest.raises(ConfigError, match="operations"):
        RetryLayer(MemoryBackend(), {"operations": ["gets"]})
