"""The cost model (hicache_storage.cost): its rate fits, its load plans, the compute queue it
plans with, when it stops waiting, when the store is the slow leg, when a lookup is worth waiting
for, and what it forgets. A fake clock and speeds chosen so that every figure is exact in binary:
each plan is computed by hand.

The speeds most tests give: pages of 4 tokens and 1 KiB; compute 1,024 tokens/s (a page in
1/256 s); a slow store reads 64 KiB/s (a page in 1/64 s, 4 pages of compute), a fast one 1 MiB/s
(a page in 1/1024 s)."""

from __future__ import annotations

import math

import pytest

from hicache_storage.cost import CostConfig, CostModel, LoadPolicy, RateMeter

PAGE_TOKENS = 4
PAGE_BYTES = 1024
COMPUTE_TOKENS_PER_S = 1024.0
COMPUTE_S_PER_PAGE = PAGE_TOKENS / COMPUTE_TOKENS_PER_S  # 1/256
SLOW_READ = 64 * 1024.0
SLOW_LOAD_S_PER_PAGE = PAGE_BYTES / SLOW_READ  # 1/64
FAST_READ = 1024 * 1024.0
STORED = 100


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def given(read: float | None = SLOW_READ, compute: float | None = COMPUTE_TOKENS_PER_S, clock: FakeClock | None = None, **config: object) -> CostModel:
    """A model whose read and compute speeds are given (``None``: that leg is timed instead)."""
    return CostModel(CostConfig(read_bytes_per_s=read, compute_tokens_per_s=compute, **config), clock=clock or FakeClock())  # type: ignore[arg-type]


def plan(model: CostModel, request: str = "r", stored: int = STORED, reads_ahead_bytes: int = 0):
    return model.pages_to_load(request, stored, page_bytes=PAGE_BYTES, page_tokens=PAGE_TOKENS, reads_ahead_bytes=reads_ahead_bytes)


def ahead(model: CostModel, request: str) -> float:
    return model.device_ahead_s(request)


# --- RateMeter --------------------------------------------------------------------------------


def fit_without_latency(meter: RateMeter) -> float:
    """The meter's seconds per byte, once checked that its fit has no latency."""
    fitted = meter.fit()
    assert fitted is not None and fitted[0] == 0.0, fitted
    return fitted[1]


def test_a_meter_is_untimed_until_its_first_call():
    meter = RateMeter(0.2, FakeClock())
    assert (meter.fit(), meter.bytes_per_s(), meter.calls, meter.last_at) == (None, None, 0, None)


def test_calls_of_different_sizes_separate_the_latency_from_the_bandwidth():
    clock = FakeClock()
    meter = RateMeter(0.2, clock)
    latency, per_byte = 1 / 128, 1 / SLOW_READ
    for size in (1024, 4096, 16384, 2048, 8192):
        clock.now += 1.0
        meter.record(size, latency + size * per_byte)
    assert meter.fit() == pytest.approx((latency, per_byte), rel=1e-9)
    assert meter.bytes_per_s() == pytest.approx(SLOW_READ, rel=1e-9)
    assert (meter.calls, meter.last_at) == (5, clock.now)


@pytest.mark.parametrize("sizes", [(1024, 1024, 1024), (1000, 1040, 1020)], ids=["equal", "within 5%"])
def test_calls_alike_in_size_give_no_latency_and_their_bytes_over_their_time(sizes):
    """Too alike to separate latency from bandwidth: the rate is total bytes over total time, the
    latency included (conservative)."""
    meter = RateMeter(0.5, FakeClock())  # each earlier call weighs half the next
    seconds = [1 / 128 + size / SLOW_READ for size in sizes]
    for size, took in zip(sizes, seconds):
        meter.record(size, took)
    weights = [0.25, 0.5, 1.0]
    expected = sum(w * t for w, t in zip(weights, seconds)) / sum(w * n for w, n in zip(weights, sizes))
    assert fit_without_latency(meter) == pytest.approx(expected, rel=1e-12)


def test_a_line_with_a_negative_latency_falls_back_to_bytes_over_time():
    meter = RateMeter(0.5, FakeClock())
    meter.record(1000, 0.001)
    meter.record(2000, 0.003)  # the line through both: 2 us/byte and -1 ms of latency
    assert fit_without_latency(meter) == pytest.approx((0.5 * 0.001 + 0.003) / (0.5 * 1000 + 2000), rel=1e-12)


def test_recent_calls_weigh_most():
    slow, fast = 1 / SLOW_READ, 1 / FAST_READ  # seconds per byte
    meter = RateMeter(0.5, FakeClock())
    for _ in range(10):
        meter.record(PAGE_BYTES, PAGE_BYTES * slow)
    for _ in range(10):
        meter.record(PAGE_BYTES, PAGE_BYTES * fast)
    # Weights: the last ten 1, 1/2, ... 1/2^9; the ten before them 1/2^10 of those.
    old_share = 0.5**10 / (1 + 0.5**10)
    fitted = meter.fit()
    assert fitted is not None and fitted[1] == pytest.approx(old_share * slow + (1 - old_share) * fast, rel=1e-12)
    only_last = RateMeter(1.0, FakeClock())
    only_last.record(PAGE_BYTES, PAGE_BYTES * slow)
    only_last.record(2 * PAGE_BYTES, 2 * PAGE_BYTES * fast)
    assert only_last.bytes_per_s() == pytest.approx(FAST_READ, rel=1e-12), "smoothing 1: the newest call alone"


@pytest.mark.parametrize(
    "nbytes, seconds", [(0, 1.0), (-4096, 1.0), (4096, 0.0), (4096, -1.0), (4096, math.nan), (4096, math.inf)]
)
def test_bad_samples_are_ignored(nbytes, seconds):
    clock = FakeClock()
    meter = RateMeter(0.2, clock)
    meter.record(nbytes, seconds)
    assert (meter.fit(), meter.calls, meter.last_at) == (None, 0, None)
    meter.record(4096, 0.5)
    meter.record(nbytes, seconds)
    assert (meter.fit(), meter.calls) == ((0.0, 0.5 / 4096), 1), "a bad sample after a good one changes nothing"


def test_a_given_speed_is_the_fit_whatever_is_recorded():
    meter = RateMeter(0.2, FakeClock(), given_bytes_per_s=2048.0)
    assert meter.fit() == (0.0, 1 / 2048)
    meter.record(1024, 100.0)
    assert meter.fit() == (0.0, 1 / 2048) and meter.bytes_per_s() == 2048.0


# --- pages_to_load ----------------------------------------------------------------------------


def test_a_store_faster_than_compute_loads_every_page_even_on_an_idle_engine():
    load = given(read=FAST_READ)
    decided = plan(load)
    assert (decided.pages, decided.stored_pages, decided.recomputed_pages) == (STORED, STORED, 0)
    assert decided.load_s_per_page == 1 / 1024 and decided.compute_s_per_page == COMPUTE_S_PER_PAGE


def test_a_store_slower_than_compute_loads_nothing_for_an_idle_engine():
    decided = plan(given())
    assert (decided.pages, decided.recomputed_pages) == (0, STORED)
    assert (decided.load_s_per_page, decided.compute_s_per_page, decided.device_ahead_s, decided.reads_ahead_s) == (
        SLOW_LOAD_S_PER_PAGE,
        COMPUTE_S_PER_PAGE,
        0.0,
        0.0,
    )


@pytest.mark.parametrize(
    "tokens_ahead, pages",
    [
        # 512 tokens ahead = 0.5 s: pages 1..32 are read by then (32 x 1/64 s), page 33 arrives a page
        # of reading (1/64 s) after the engine could start, more than computing it (1/256 s) takes.
        (512, 32),
        # 520 tokens = 0.5078 s: page 33 arrives at 0.5156 s, 8/1024 s late: still more than a page of compute.
        (520, 32),
        # 526 tokens = 0.5137 s: page 33 arrives 2/1024 s late, less than computing it (4/1024 s): loaded.
        (526, 33),
        # More compute ahead than reading every stored page takes: every page is free.
        (10**6, STORED),
    ],
)
def test_a_slow_store_loads_the_head_that_arrives_before_the_engine_reaches_the_request(tokens_ahead, pages):
    model = given()
    model.enqueue("earlier", tokens_ahead)
    model.enqueue("r", 400)
    decided = plan(model)
    assert decided.device_ahead_s == tokens_ahead / COMPUTE_TOKENS_PER_S
    assert decided.pages == pages


def test_reads_queued_ahead_shrink_the_head():
    model = given()
    model.enqueue("earlier", 512)  # 0.5 s of compute ahead: 32 pages of reading
    decided = plan(model, reads_ahead_bytes=8 * PAGE_BYTES)  # 8 pages' reads go first: 0.125 s
    assert decided.reads_ahead_s == 0.125
    assert decided.pages == 32 - 8


def test_the_reads_latency_delays_the_head():
    """Reads timed (not given) with 1/128 s of latency per call: the head ready by 0.5 s is
    (0.5 - 1/128) / (1/64) = 31.5, so 31 pages (page 32 is 1/128 s late, more than a page of compute)."""
    clock = FakeClock()
    model = given(read=None, clock=clock)
    for pages in (1, 4, 16):
        model.record_read(pages * PAGE_BYTES, 1 / 128 + pages * SLOW_LOAD_S_PER_PAGE)
    model.enqueue("earlier", 512)
    decided = plan(model)
    assert decided.load_s_per_page == pytest.approx(SLOW_LOAD_S_PER_PAGE, rel=1e-9)
    assert decided.pages == 31


def test_work_already_on_the_accelerator_counts_as_compute_ahead():
    model = given()
    model.busy_for_s = lambda: 0.5
    assert plan(model).pages == 32
    model.busy_for_s = lambda: -3.0  # ended a while ago
    assert plan(model).pages == 0


#: A store that reads a page in 2/1024 s and a device copy of 3/1024 s: each faster than computing
#: the page (4/1024 s), together slower (the fast-GPU case).
READ_2 = PAGE_BYTES / (2 / 1024)
COPY_3 = PAGE_BYTES / (3 / 1024)


def test_copies_overlapping_the_compute_of_the_rest_load_the_head_that_compute_hides():
    """Reading ``x`` pages takes 2x/1024 s; then the copy of those (3x/1024 s) and the compute of
    the rest (4(100 - x)/1024 s) overlap layer by layer: the least of
    2x + max(3x, 4(100 - x)) is at x = 400/7 = 57.1, 57 pages (286/1024 s; 58 take 290), where
    loading all takes 500 and computing all 400."""
    model = given(read=READ_2, copy_bytes_per_s=COPY_3)
    model.enqueue("r", STORED * PAGE_TOKENS)
    decided = plan(model)
    assert decided.load_s_per_page == pytest.approx(5 / 1024) and decided.pages == 57


def test_what_a_request_computes_and_copies_anyway_moves_the_balance():
    """10 pages no tier holds and 20 held in host memory: 2x + max(3(20 + x), 4(10 + 100 - x)) is
    least at x = 380/7 = 54.3: 54 pages (332/1024 s; 55 take 335)."""
    model = given(read=READ_2, copy_bytes_per_s=COPY_3)
    model.enqueue("r", (STORED + 10) * PAGE_TOKENS, 20 * PAGE_BYTES)
    assert plan(model).pages == 54
    model.enqueue("r", (STORED + 10) * PAGE_TOKENS)  # without it: 2x + max(3x, 4(110 - x)), 63 (315; 62 take 316)
    assert plan(model).pages == 63


@pytest.mark.parametrize(
    "cuts, pages",
    [
        # 2x + max(3x, 4(100 - x)) at the cuts only: 0 -> 400, 50 -> 300, 100 -> 500: 50
        ((50,), 50),
        # 60 -> 2 x 60 + 180 = 300, a tie with 50: the more pages
        ((50, 60), 60),
        # 80 -> 160 + 240 = 400, a tie with none at all: loading all takes 500
        ((80,), 80),
        # 90 -> 180 + 270 = 450; none takes 400
        ((90,), 0),
        ((), 0),  # only none or all: 400 against 500
    ],
)
def test_a_load_that_may_stop_only_at_given_cuts_is_planned_among_them(cuts, pages):
    """A hybrid model resumes only where every pool holds state: between cuts, loading fewer
    pages means computing from the cut before. The plan of the test above (57 pages) is not a
    cut; among the cuts the least of 2x + max(3x, 4(100 - x)) wins, in 1/1024 s."""
    model = given(read=READ_2, copy_bytes_per_s=COPY_3)
    model.enqueue("r", STORED * PAGE_TOKENS)
    decided = model.pages_to_load("r", STORED, page_bytes=PAGE_BYTES, page_tokens=PAGE_TOKENS, cuts=cuts)
    assert decided.pages == pages


def test_copies_queued_ahead_count_as_device_work_ahead():
    """A request ahead computing 256 tokens (0.25 s) and copying 1 MiB at 1 MiB/s (1 s) holds
    the device for the longer of the two: they overlap layer by layer."""
    model = given(copy_bytes_per_s=FAST_READ)
    model.enqueue("a", 256, 512 * PAGE_BYTES)
    model.enqueue("b", 0)
    assert ahead(model, "b") == 0.5
    model.will_load("a", 0, 512 * PAGE_BYTES)
    assert ahead(model, "b") == 1.0
    assert ahead(given(), "b") == 0.0 and ahead(model, "a") == 0.0


def test_a_request_ahead_that_copies_while_another_computes_holds_the_device_for_neither_alone():
    """The copy stream and the compute are separate: a request ahead that only computes (256
    tokens, 0.25 s) and one after it that only copies (256 KiB at 1 MiB/s, 0.25 s) are done
    together at 0.25 s, the copy beside the compute, not one after the other (0.5 s)."""
    model = given(copy_bytes_per_s=FAST_READ)
    model.enqueue("computes", 256)
    model.enqueue("copies", 0, 256 * PAGE_BYTES)
    model.enqueue("r", 0)
    assert ahead(model, "r") == 0.25
    # the other way round: the compute waits for its own copy to land, 0.25 s + 0.25 s
    other = given(copy_bytes_per_s=FAST_READ)
    other.enqueue("copies then computes", 256, 256 * PAGE_BYTES)
    other.enqueue("r", 0)
    assert ahead(other, "r") == 0.25, "a request's compute and its own copy overlap layer by layer"


def test_a_request_copies_beside_the_compute_queued_ahead_of_it_and_loads_more_of_its_head():
    """Compute ahead of the request 0.25 s; a fast store (a page read in 1/1024 s) and copies as
    slow as the compute (1/256 s a page). The request's copy starts once its read is done, beside
    the device's work ahead, and its compute after that work: finish(x) is the later of
    0.25 + (101 - x)/256 and x/1024 + x/256 (one page no tier holds), least at 73 pages
    (0.359375 s; 74 take 0.36133). Charged after the work ahead, the copies balanced the compute
    at 51 pages (0.25 + 51/256 = 0.449 s)."""
    model = given(read=FAST_READ, copy_bytes_per_s=PAGE_BYTES * 256.0)
    model.enqueue("earlier", 256)
    model.enqueue("r", (STORED + 1) * PAGE_TOKENS)
    assert plan(model).pages == 73


def test_load_policy_all_loads_every_stored_page_whatever_the_speeds():
    model = given(policy=LoadPolicy.ALL)
    assert plan(model).pages == STORED and plan(model).load_s_per_page == SLOW_LOAD_S_PER_PAGE


def test_untimed_legs_load_every_stored_page():
    """Until a leg is timed the store is assumed fast: the first loads measure it."""
    assert plan(given(read=None)).pages == STORED, "reads never timed"
    assert plan(given(compute=None)).pages == STORED, "compute never timed"
    assert plan(given(read=None, compute=None)).load_s_per_page is None


def test_nothing_stored_loads_nothing():
    assert plan(given(read=FAST_READ), stored=0).pages == 0
    assert plan(given(), stored=0).pages == 0


# --- the compute queue ------------------------------------------------------------------------


def test_only_requests_queued_before_count_as_compute_ahead():
    model = given()
    for request, tokens in (("a", 512), ("b", 256), ("c", 128)):
        model.enqueue(request, tokens)
    assert [ahead(model, r) for r in ("a", "b", "c")] == [0.0, 0.5, 0.75]
    assert ahead(model, "not queued") == 0.875, "a request not queued yet is behind every queued one"
    model.enqueue("a", 1024)  # queued again: its place in line stays
    assert [ahead(model, r) for r in ("a", "b")] == [0.0, 1.0]


def test_what_a_request_will_load_leaves_the_compute_ahead_of_the_others():
    model = given()
    model.enqueue("a", 512)
    model.enqueue("b", 256)
    model.will_load("a", 256)
    assert ahead(model, "b") == 0.25
    model.will_load("a", 10**6)
    assert ahead(model, "b") == 0.0, "never below nothing"
    model.will_load("unknown", 64)  # nothing queued for it: nothing changes
    model.enqueue("c", -5)
    assert ahead(model, "c") == 0.25


def test_a_started_request_leaves_the_queue():
    model = given()
    model.enqueue("a", 512)
    model.enqueue("b", 256)
    model.started("a")  # its compute is on the accelerator now: busy_for_s counts it
    assert ahead(model, "b") == 0.0
    model.started("a")
    model.started("never queued")
    assert ahead(model, "c") == 0.25


def test_compute_ahead_is_nothing_while_the_compute_rate_is_unknown():
    model = given(compute=None)
    model.enqueue("a", 512)
    model.busy_for_s = lambda: 2.0
    assert ahead(model, "b") == 0.0


def test_the_compute_rate_given_comes_first_then_the_engines_then_prefills_timed():
    assert CostModel(CostConfig(compute_tokens_per_s=10.0), compute_tokens_per_s=20.0).compute_tokens_per_s == 10.0
    engine_rate = CostModel(compute_tokens_per_s=20.0)
    engine_rate.record_compute(1000, 1.0)
    assert engine_rate.compute_tokens_per_s == 20.0, "a known rate is not replaced by timings"
    timed = CostModel(clock=FakeClock())
    assert timed.compute_tokens_per_s is None and timed.compute_s_per_page(PAGE_TOKENS) is None
    timed.record_compute(512, 0.25)
    assert timed.compute_tokens_per_s == 2048.0


# --- keep_waiting -----------------------------------------------------------------------------


def keep_waiting(model: CostModel, pages_left: int, pace: float | None) -> bool:
    return model.keep_waiting("r", pages_left, page_bytes=PAGE_BYTES, page_tokens=PAGE_TOKENS, seconds_per_page=pace)


def test_keep_waiting_while_the_pages_to_come_arrive_before_computing_them_would_be_done():
    idle = given()
    # 10 pages at 1/64 s arrive in 0.15625 s; computing them takes 10/256 = 0.0390625 s.
    assert not keep_waiting(idle, 10, SLOW_LOAD_S_PER_PAGE)
    busy = given()
    busy.enqueue("earlier", 128)  # 0.125 s ahead: computing them is done at 0.1640625 s
    busy.enqueue("r", 400)
    assert keep_waiting(busy, 10, SLOW_LOAD_S_PER_PAGE)
    assert keep_waiting(busy, 10, None) and not keep_waiting(idle, 10, None), "no pace yet: the model's own"
    assert keep_waiting(idle, 10, 1 / 1024), "a read running fast"


def test_a_read_with_no_page_arrived_yet_counts_only_what_is_left_of_the_models_time_for_it():
    """A first batch in flight is every page of a one-batch read: 10 pages at the slow store's
    1/64 s take 0.15625 s, against 10/256 = 0.0390625 s to compute them on an idle engine. Asked
    at the start it is not worth waiting for; 0.14 s into it, 0.015625 s are left: it is."""
    idle = given()

    def after(waited_s: float) -> bool:
        return idle.keep_waiting("r", 10, page_bytes=PAGE_BYTES, page_tokens=PAGE_TOKENS, seconds_per_page=None, waited_s=waited_s)

    assert not keep_waiting(idle, 10, None) and not after(0.0)
    assert not after(0.1), "0.05625 s left"
    assert after(0.14)
    # past the model's time, late by less than computing the pages would take: still waited for
    # (rent or buy); late by more: given up
    assert after(0.15625 + 0.03)
    assert not after(0.15625 + 0.04)


def test_a_reads_own_pace_adds_the_copy_to_the_device():
    """8 pages at 1/128 s each arrive in 0.0625 s; with copies timed at 1/256 s a page, in
    0.09375 s. Computing them is done at 48/1024 + 8/256 = 0.078125 s."""
    without_copies, with_copies = given(), given()
    with_copies.record_copy(4 * PAGE_BYTES, 4 / 256)
    for model in (without_copies, with_copies):
        model.enqueue("earlier", 48)
        model.enqueue("r", 400)
    assert keep_waiting(without_copies, 8, 1 / 128)
    assert not keep_waiting(with_copies, 8, 1 / 128)


def test_keep_waiting_under_load_policy_all_or_untimed_legs_always_and_for_nothing_never():
    assert keep_waiting(given(policy=LoadPolicy.ALL), 10**6, 10.0), "the stop policy decides"
    assert keep_waiting(given(policy=LoadPolicy.ALL), 0, None)
    assert keep_waiting(given(compute=None), 10**6, 10.0) and keep_waiting(given(read=None), 10**6, None)
    assert not keep_waiting(given(), 0, SLOW_LOAD_S_PER_PAGE), "no page left to wait for"


# --- store_is_slow_leg ------------------------------------------------------------------------


def slow_leg(model: CostModel) -> bool:
    return model.store_is_slow_leg(PAGE_BYTES, PAGE_TOKENS)


def test_the_store_is_the_slow_leg_when_loading_a_page_takes_longer_than_computing_it():
    assert slow_leg(given())
    assert not slow_leg(given(read=FAST_READ))
    assert not slow_leg(given(read=PAGE_BYTES / COMPUTE_S_PER_PAGE)), "as fast as compute: not slower"
    copies_slow = given(read=FAST_READ)
    copies_slow.record_copy(PAGE_BYTES, 1 / 64)  # the copy to the device is the slow half of a load
    assert slow_leg(copies_slow)


def test_the_store_is_not_the_slow_leg_until_both_legs_were_timed():
    clock = FakeClock()
    model = CostModel(clock=clock)
    assert not slow_leg(model)
    model.record_read(PAGE_BYTES, 1.0)
    assert not slow_leg(model), "compute not timed"
    model.record_compute(PAGE_TOKENS, 0.001)
    assert slow_leg(model)


# --- forget_after_s ---------------------------------------------------------------------------


def test_a_leg_not_timed_for_forget_after_s_is_untimed_again():
    clock = FakeClock()
    model = given(read=None, clock=clock, forget_after_s=30.0)
    model.record_read(PAGE_BYTES, SLOW_LOAD_S_PER_PAGE)
    model.record_copy(PAGE_BYTES, 1 / 256)
    clock.now += 30.0
    assert model.reads_timed and model.load_s_per_page(PAGE_BYTES) == SLOW_LOAD_S_PER_PAGE + 1 / 256
    assert plan(model).pages == 0 and slow_leg(model)
    clock.now += 0.001
    assert not model.reads_timed and model.load_s_per_page(PAGE_BYTES) is None
    assert plan(model).pages == STORED and not slow_leg(model), "assumed fast: the next loads measure it"
    model.record_read(PAGE_BYTES, SLOW_LOAD_S_PER_PAGE)
    assert model.load_s_per_page(PAGE_BYTES) == SLOW_LOAD_S_PER_PAGE, "timed again; the copies are still forgotten"


def test_given_speeds_are_never_forgotten():
    clock = FakeClock()
    model = given(clock=clock, copy_bytes_per_s=FAST_READ, forget_after_s=1.0)
    clock.now += 10**6
    assert model.reads_timed and model.load_s_per_page(PAGE_BYTES) == SLOW_LOAD_S_PER_PAGE + 1 / 1024
    assert plan(model).pages == 0


# --- CostConfig -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("smoothing", 0.0, "CostConfig.smoothing must be in (0, 1], got 0.0"),
        ("smoothing", 1.5, "CostConfig.smoothing must be in (0, 1], got 1.5"),
        ("forget_after_s", 0.0, "CostConfig.forget_after_s must be positive, got 0.0"),
        ("forget_after_s", -1.0, "CostConfig.forget_after_s must be positive, got -1.0"),
        ("read_bytes_per_s", 0.0, "CostConfig.read_bytes_per_s must be a positive finite speed, or None to measure it; got 0.0"),
        ("write_bytes_per_s", -1.0, "CostConfig.write_bytes_per_s must be a positive finite speed, or None to measure it; got -1.0"),
        ("copy_bytes_per_s", math.nan, "CostConfig.copy_bytes_per_s must be a positive finite speed, or None to measure it; got nan"),
        ("compute_tokens_per_s", 0, "CostConfig.compute_tokens_per_s must be a positive finite speed, or None to measure it; got 0"),
        ("read_bytes_per_s", math.inf, "CostConfig.read_bytes_per_s must be a positive finite speed, or None to measure it; got inf"),
    ],
)
def test_a_bad_cost_config_names_the_field_and_the_value(field, value, message):
    with pytest.raises(ValueError) as raised:
        CostConfig(**{field: value})
    assert str(raised.value) == message


def test_an_engine_rate_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match=r"^compute_tokens_per_s must be positive, got 0.0$"):
        CostModel(compute_tokens_per_s=0.0)


def test_the_default_is_the_cost_policy_and_the_policies_read_from_their_names():
    assert CostConfig().policy is LoadPolicy.COST
    assert [LoadPolicy(name) for name in ("cost", "all")] == [LoadPolicy.COST, LoadPolicy.ALL]


# --- the share of what requests want from L3 that loads take (the write side follows it) ----------


def test_load_share_is_one_while_the_store_is_not_the_slow_leg_and_under_load_policy_all():
    fast = CostModel(CostConfig(read_bytes_per_s=1e9), compute_tokens_per_s=1000.0)
    assert fast.load_share(page_bytes=1000, page_tokens=1) == 1.0  # 1 us to load, 1 ms to compute
    every = CostModel(CostConfig(policy=LoadPolicy.ALL, read_bytes_per_s=1.0), compute_tokens_per_s=1000.0)
    assert every.load_share(page_bytes=1000, page_tokens=1) == 1.0


def test_load_share_before_any_plan_is_compute_over_load_then_what_plans_loaded():
    # A page loads in 4 s (1000 B at 250 B/s) and computes in 1 s: a quarter before any plan.
    model = CostModel(CostConfig(read_bytes_per_s=250.0, smoothing=0.5), compute_tokens_per_s=1.0)
    assert model.load_share(page_bytes=1000, page_tokens=1) == 0.25
    model.note_plan(100, 10)
    assert model.load_share(page_bytes=1000, page_tokens=1) == 0.1
    model.note_plan(100, 50)  # decayed sums: (10 * 0.5 + 50) / (100 * 0.5 + 100)
    assert model.load_share(page_bytes=1000, page_tokens=1) == pytest.approx(55 / 150)
    model.note_plan(0, 0)  # nothing wanted from L3: no evidence either way
    assert model.load_share(page_bytes=1000, page_tokens=1) == pytest.approx(55 / 150)


# --- lookups of pages only another engine could have written ----------------------------------


def test_a_plan_says_how_much_sooner_it_finishes_than_computing_every_stored_page():
    # Idle engine, fast store: 100 pages computed take 100/256 s, read 100/1024 s.
    assert plan(given(read=FAST_READ)).saved_s == 100 / 256 - 100 / 1024
    assert plan(given()).saved_s == 0.0, "a slow store on an idle engine: nothing loaded, nothing saved"
    assert plan(given(read=None)).saved_s is None, "reads not timed: not known"
    assert plan(given(policy=LoadPolicy.ALL)).saved_s is None


def test_a_lookup_is_waited_for_while_the_share_that_found_pages_pays_for_its_time():
    model = given(read=FAST_READ, smoothing=0.5)
    assert model.lookup_pays(0.0) and model.lookup_pays(None), "no lookup timed yet: ask"
    model.record_lookup(0.125, found=False)  # share (0 + 1) / (1 + 1), a lookup 0.125 s
    assert model.lookup_pays(0.25) and not model.lookup_pays(0.24)
    model.record_lookup(0.125, found=False)  # (0 + 1) / (1.5 + 1)
    assert model.lookup_pays(0.32) and not model.lookup_pays(0.3)
    assert model.lookup_pays(None), "a plan whose gain is not known still asks"
    model.record_lookup(0.125, found=True)  # (1 + 1) / (1.75 + 1): a found page makes asking pay again
    assert model.lookup_pays(0.18) and not model.lookup_pays(0.17)


def test_lookups_always_pay_under_load_policy_all_and_bad_timings_are_ignored():
    every = given(policy=LoadPolicy.ALL)
    every.record_lookup(10.0, found=False)
    assert every.lookup_pays(0.0)
    model = given(read=FAST_READ)
    for seconds in (-1.0, math.nan, math.inf):
        model.record_lookup(seconds, found=False)
    assert model.lookup_pays(0.0), "no lookup was recorded"
