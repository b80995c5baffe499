"""The store breaker (hicache_storage.health): opens on consecutive failures, probes on a backoff,
closes when a probe answers; one log line and one transition per change. Fake clock, probes run
inline: no sleeps, no threads."""

import logging

import pytest

from hicache_storage.errors import StorageTimeoutError
from hicache_storage.health import BreakerConfig, BreakerState, CircuitBreaker


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Probe:
    def __init__(self) -> None:
        self.answers = False
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if not self.answers:
            raise StorageTimeoutError("no answer")


def make(failures=3, backoff=1.0, backoff_max=8.0):
    clock, probe, transitions = FakeClock(), Probe(), []
    breaker = CircuitBreaker(
        "store",
        probe,
        BreakerConfig(failures_to_open=failures, probe_backoff_s=backoff, probe_backoff_max_s=backoff_max),
        clock=clock,
        run_probe=lambda run: run(),
        on_transition=lambda old, new: transitions.append((old, new)),
    )
    return breaker, clock, probe, transitions


def fail(breaker, times, operation="get"):
    for _ in range(times):
        breaker.record_failure(operation, StorageTimeoutError("slow"))


def test_consecutive_failures_of_one_operation_open_it_and_a_success_resets_the_count():
    breaker, _, _, transitions = make(failures=3)
    fail(breaker, 2)
    breaker.record_success("get")
    fail(breaker, 2)
    fail(breaker, 2, "put")
    assert breaker.state is BreakerState.CLOSED and breaker.allows_call()
    fail(breaker, 1)
    assert breaker.state is BreakerState.OPEN and not breaker.allows_call()
    assert transitions == [(BreakerState.CLOSED, BreakerState.OPEN)]


def test_probes_run_on_a_doubling_backoff_and_the_first_answer_closes_it(caplog):
    breaker, clock, probe, transitions = make(failures=1, backoff=1.0, backoff_max=4.0)
    with caplog.at_level(logging.INFO, logger="hicache_storage.health"):
        fail(breaker, 1)
        assert not breaker.allows_call() and probe.calls == 0, "no probe before the backoff"
        due = []
        for _ in range(4):
            clock.now += breaker.backoff_s
            due.append(breaker.backoff_s)
            assert not breaker.allows_call()
        assert due == [1.0, 2.0, 4.0, 4.0] and probe.calls == 4, "each failed probe doubles the wait, up to the max"
        probe.answers = True
        clock.now += breaker.backoff_s
        assert not breaker.allows_call(), "the call that started the probe is not made"
        assert breaker.state is BreakerState.CLOSED and breaker.allows_call()
    assert transitions == [(BreakerState.CLOSED, BreakerState.OPEN), (BreakerState.OPEN, BreakerState.CLOSED)]
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 2 and "unhealthy" in lines[0] and "answers again" in lines[1]


def test_reopening_before_the_operation_succeeds_probes_less_often_until_it_does():
    breaker, clock, probe, _ = make(failures=1, backoff=1.0, backoff_max=8.0)
    probe.answers = True
    waits = []
    for _ in range(3):
        fail(breaker, 1)
        waits.append(breaker.backoff_s)
        clock.now += breaker.backoff_s
        breaker.allows_call()
        assert breaker.state is BreakerState.CLOSED
    assert waits == [1.0, 2.0, 4.0], "a probe that answers while reads still hang must not make the breaker flap fast"
    breaker.record_success("put")
    assert breaker.backoff_s == 4.0, "another operation's success says nothing about the one that failed"
    breaker.record_success("get")
    assert breaker.backoff_s == 1.0


def test_one_probe_at_a_time_and_none_after_close():
    started = []
    clock = FakeClock()
    breaker = CircuitBreaker("store", lambda: None, BreakerConfig(failures_to_open=1, probe_backoff_s=1.0),
                             clock=clock, run_probe=started.append)
    fail(breaker, 1)
    clock.now += 5
    breaker.allows_call()
    breaker.allows_call()
    assert len(started) == 1, "a probe still running is not started again"
    started[0]()
    assert breaker.state is BreakerState.CLOSED
    fail(breaker, 1)
    breaker.close()
    clock.now += 100
    assert not breaker.allows_call() and len(started) == 1


@pytest.mark.parametrize(("config", "match"), [
    ({"failures_to_open": 0}, "failures_to_open"),
    ({"probe_backoff_s": 0.0}, "probe_backoff_s"),
    ({"probe_backoff_s": 5.0, "probe_backoff_max_s": 1.0}, "probe_backoff_max_s"),
])
def test_bad_configs_say_what_is_expected(config, match):
    with pytest.raises(ValueError, match=match):
        BreakerConfig(**config)
