"""RequestWindow: the passes of a run, and the SWA pages a request holds during them.

The reference is a replay: take the pages each pass reads, give back those no later pass reads
and the cache does not keep, count what is held. ``peak`` counts arithmetically and ``passes``
computes where to start; both must agree with the replay for any shape of request.
"""

from __future__ import annotations

import random

import pytest
import torch

from hicache_core.hybrid.request_window import RequestWindow


def every_pass(window: RequestWindow) -> list[tuple[int, int]]:
    prefill = [(b, min(b + window.chunk, window.prompt)) for b in range(window.start, window.prompt, window.chunk)]
    return prefill + [(p, p + 1) for p in range(window.prompt, window.total)]


def replayed_peak(window: RequestWindow) -> int:
    held: set[int] = set()
    most = 0
    ps = window.page_size
    for begin, end in every_pass(window):
        held |= set(range(max(window.first(begin), window.start) // ps, -(-end // ps)))
        most = max(most, len(held))
        held = {p for p in held if (p + 1) * ps > window.first(end) or p in window.kept}
    return most


def random_window(rng: random.Random) -> RequestWindow:
    ps = rng.choice([1, 4, 16, 64])
    context = rng.randrange(0, 5 * ps)
    chunk = max(ps, context // ps * ps)
    start = rng.randrange(0, 40) * ps
    prompt = start + rng.randrange(1, 60 * ps)
    total = prompt + rng.randrange(0, 3 * ps)
    boundaries = {rng.randrange(0, total + 1) for _ in range(rng.randrange(0, 4))} | {total // ps * ps}
    return RequestWindow(ps, context, chunk, start, prompt, total, boundaries)


@pytest.mark.parametrize("seed", range(20))
def test_peak_and_passes_agree_with_a_replay_of_the_run(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        window = random_window(rng)
        assert window.peak() == replayed_peak(window), vars(window)
        passes = every_pass(window)
        since = rng.randrange(window.start, window.total + 2)
        until = rng.randrange(since, window.total + 3)
        assert list(window.passes(since, until)) == [p for p in passes if since <= p[0] < until]


@pytest.mark.parametrize("seed", range(5))
def test_a_run_holds_at_most_its_peak_and_gives_every_page_back(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        window = random_window(rng)
        ps, peak = window.page_size, window.peak()
        window.give(torch.arange(peak * ps))
        most = 0
        for begin, end in window.passes(window.start, window.total):
            window.hold(begin, end)  # raises if the peak reserved too few pages
            most = max(most, len(window.pages))
            window.advance(end)
        assert most == peak
        assert sorted(window.leftover().tolist()) == list(range(peak * ps))


def test_slots_of_a_pass_are_the_window_before_the_resume_point_then_the_requests_own_pages() -> None:
    window = RequestWindow(page_size=4, context=5, chunk=4, start=8, prompt=16, total=18, boundaries={16})
    window.give(torch.arange(100, 100 + window.peak() * 4))
    prefix = torch.arange(50, 56)  # positions [2, 8): the tree's, before the resume point
    slots = window.slots(8, 12, prefix, prefix_base=2)
    assert window.first(8) == 3
    assert slots[:5].tolist() == [51, 52, 53, 54, 55]
    own = slots[5:].tolist()
    assert len(own) == 4 and own == list(range(own[0], own[0] + 4)) and own[0] >= 100 and own[0] % 4 == 0
    later = window.slots(12, 16, prefix, prefix_base=2)  # first(12) = 7: one prefix position, then pages 2 and 3
    assert later[:1].tolist() == [55] and later[1:5].tolist() == own
