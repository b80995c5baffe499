"""The bound a run could reach: each round's dependencies, the machine's cores, and the best
choice between loading a stored prefix and computing it.

The simple bound (:mod:`.bound`) is the busiest leg's total, as if the legs overlapped perfectly
over the whole run. A barriered multi-turn run cannot overlap that way: a round's legs overlap
only with each other (the next round's prompts do not exist yet), a request computes only once
its prefix is on the device, L1 holds only so many requests' contexts, and the store's client
and the device <-> host copies share the machine (its cores and memory bandwidth). And the simple bound holds the run to the hits it took: a run that loaded a
page slower than computing it is held to that slow load. This bound fixes both, round by round:

* **Per request** of a round: its prefix from L2 (``cached_host``) is copied to the device; of
  the tokens the store held (``cached_storage`` loaded plus ``stored_recomputed``), any number
  ``x`` may be loaded (read from the store, then copied) and the rest computed; the tokens no
  tier held are computed.
* **The round** takes at least the longest of:

  - the GPU: every prefill, then the decode steps the round needs at least,
    ``ceil(requests / batch) x (output - 1)``: a step decodes its batch together, a batch is at
    most ``max_running`` requests and at most as many as L1 holds at once, and a request holds
    its place from its first step to its last, so the requests fall into at most ``batch``
    sequences of requests one after another, the longest of them ``ceil(requests / batch)``
    long (counting request-steps instead, ``ceil(requests x (output - 1) / batch)``, let four
    requests of which three fit L1 decode 7 steps each in 10 steps, where no order takes under 14);
  - each request's own chain: its store read, then its time on the device (its copy to the
    device overlapped with its prefill, layer-wise: the longer of the two), then ``output - 1``
    decode steps;
  - the requests' reads and copies one after another (one store, one copy stream): no copy
    starts before the first request to copy has its prefix in host memory (at once for a host
    hit, after its read otherwise), and every load and the decode tail follow; and after the
    last read ends, its request still copies, computes and decodes. Without these, each chain
    ran at the store's and the copies' full speed beside the others: two requests each reading
    and copying 13,000 stored tokens at the H200 grid point took 123 ms in that bound, where no
    order of the two takes less than 165 ms;
  - the store: the round's reads, and the writes the run made during it;
  - the copies: the round's loads to the device and the backups the run made during it;
  - the machine: the store's time and the copies' together, over how much they were measured to
    overlap when run at once (``Legs.overlap``: on the bench's 2-core VM a store read and a load
    share the memory bandwidth and hardly overlap; a GPU server's NIC and PCIe would);
  - device memory: each request holds its whole context from its copy to its last decode step;
    the sum of context x time cannot exceed L1's tokens x the round's time (requests whose
    contexts do not fit L1 together run in waves).

* The loads ``x`` are chosen to make that least: every term is linear in the loads and the
  times, given which request copies first and which reads last; those are binary choices, so
  each round is a small mixed-integer linear program (scipy's HiGHS) solved exactly.

The bound is the sum over rounds. Its efficiency (bound / wall) is the share of what was
possible that the run got; "reachable vs L1" is L1's wall over it. The decode steps a run took
beyond the least, the scheduler's own CPU time and the backups' choice of what to write are the
engine's to account for, not the bound's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hicache_storage.benchmarks.multiturn.bound import Legs


@dataclass(frozen=True)
class RequestWork:
    """Where one request's prompt tokens came from (see ``RequestResult``), and its context."""

    from_host: int
    from_storage: int
    #: Tokens the store held that the request computed.
    stored_recomputed: int
    computed: int
    #: Tokens it holds in device memory by its end (prompt and output).
    context: int


@dataclass(frozen=True)
class Shape:
    """What the bound needs of the bench's configuration."""

    token_bytes: int
    output_tokens: int
    max_running: int
    #: Device (L1) capacity in tokens.
    device_tokens: int


@dataclass(frozen=True)
class RoundWork:
    requests: tuple[RequestWork, ...]
    #: Bytes the run wrote to the store and backed up device -> host during the round.
    storage_written: float
    backed_up: float
    #: A hybrid model's other pools moved during the round (read from L3, loaded to the device).
    side_read: float = 0.0
    side_loaded: float = 0.0


@dataclass(frozen=True)
class Reachable:
    bound_s: float
    wall_s: float
    efficiency: float
    #: L1's wall time over this bound (None without an L1 run).
    bound_vs_l1: float | None
    #: Tokens the best choice loads from the store and computes instead, of those it held.
    best_loaded_tokens: int
    best_recomputed_tokens: int
    #: Each round's bound, seconds.
    rounds_s: tuple[float, ...]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def reachable_bound(rounds: Sequence[RoundWork], legs: Legs, shape: Shape, *, wall_s: float, l1_wall_s: float | None) -> Reachable | None:
    """The bound of a run served as ``rounds`` (see the module); None without modeled compute."""
    if legs.prefill_tokens_per_s is None or legs.decode_step_s is None:
        return None
    times: list[float] = []
    loaded = recomputed = 0.0
    for work in rounds:
        seconds, loads = _round_bound(work, legs, shape)
        times.append(seconds)
        loaded += sum(loads)
        recomputed += sum(r.from_storage + r.stored_recomputed for r in work.requests) - sum(loads)
    bound = sum(times)
    return Reachable(
        bound_s=bound,
        wall_s=wall_s,
        efficiency=bound / wall_s if wall_s > 0 else 0.0,
        bound_vs_l1=l1_wall_s / bound if l1_wall_s is not None and bound > 0 else None,
        best_loaded_tokens=round(loaded),
        best_recomputed_tokens=round(recomputed),
        rounds_s=tuple(times),
    )


def _speed(value: float | None) -> float:
    return math.inf if value is None else value


def _round_bound(work: RoundWork, legs: Legs, shape: Shape) -> tuple[float, list[float]]:
    """The least time of one round over every choice of loads, and the loads that reach it: a
    mixed-integer linear program (variables: each request's loads ``x``, its time holding device
    memory ``d``, the round's time ``T``, and which request's copy comes first and whose read
    comes last, ``a`` and ``b``; minimize ``T``)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    requests = work.requests
    if not requests:
        return 0.0, []
    assert legs.prefill_tokens_per_s is not None and legs.decode_step_s is not None
    n = len(requests)
    read_s = shape.token_bytes / _speed(legs.storage_read)  # seconds per token read from the store
    copy_s = shape.token_bytes / legs.load  # seconds per token copied host -> device
    compute_s = 1.0 / legs.prefill_tokens_per_s
    step = legs.decode_step_s
    steps = max(shape.output_tokens - 1, 0)
    tail = steps * step
    # the modeled GPU runs prefills and decode steps one after another, and a request's steps are
    # passes of their own: a round of fewer requests than max_running still takes all of them. A
    # step decodes only requests resident in L1 together: at most max_running, and at most as
    # many as fit (smallest prompts first); each stays from its first step to its last, so the
    # requests run in at most ``batch`` lanes, one of them ceil(n / batch) requests long
    batch = min(shape.max_running, _fit_together([r.context - steps for r in requests], shape.device_tokens))
    decodes = math.ceil(n / batch) * steps * step
    held = [float(r.from_storage + r.stored_recomputed) for r in requests]
    computed = [float(r.computed + r.from_storage) for r in requests]  # computed when nothing is loaded
    host = [float(r.from_host) for r in requests]
    # Variables: x_0..x_{n-1}, d_0..d_{n-1}, T, a_0..a_{n-1}, b_0..b_{n-1}. Rows: low <= A @ v <= high.
    rows: list[list[float]] = []
    lows: list[float] = []
    highs: list[float] = []

    def row(x: Sequence[float] = (), d: Sequence[float] = (), t: float = 0.0, a: Sequence[float] = (), b: Sequence[float] = (), *, rhs: float, low: float = -math.inf) -> None:
        rows.append([*(x or [0.0] * n), *(d or [0.0] * n), t, *(a or [0.0] * n), *(b or [0.0] * n)])
        lows.append(low)
        highs.append(rhs)

    def one(i: int, value: float) -> list[float]:
        return [value if j == i else 0.0 for j in range(n)]

    for i in range(n):
        # device time: the copy of its prefix and its prefill overlap (layer-wise), so it holds
        # memory at least as long as the longer of the two
        row(x=one(i, copy_s), d=one(i, -1.0), rhs=-host[i] * copy_s)
        row(x=one(i, -compute_s), d=one(i, -1.0), rhs=-computed[i] * compute_s)
        # its own chain: the store read, then device time, then the decode tail
        row(x=one(i, read_s), d=one(i, 1.0), t=-1.0, rhs=-tail)
    gpu = sum(computed) * compute_s + decodes
    row(x=[-compute_s] * n, t=-1.0, rhs=-gpu)
    # the store alone: the round's reads, and the writes the run made during it
    fixed_store = work.storage_written / _speed(legs.storage_write) + work.side_read / _speed(legs.storage_read)
    row(x=[read_s] * n, t=-1.0, rhs=-fixed_store)
    # the copies alone: loads to the device, and the run's backups during the round
    fixed_copies = sum(host) * copy_s + work.backed_up / legs.backup + work.side_loaded / legs.load
    row(x=[copy_s] * n, t=-1.0, rhs=-fixed_copies)
    # the machine: the store and the copies overlap only as much as they were measured to
    row(x=[read_s + copy_s] * n, t=-legs.overlap, rhs=-(fixed_store + fixed_copies))
    # device memory: each request holds its context through its device time and decode tail
    contexts = [float(r.context) for r in requests]
    row(d=contexts, t=-float(shape.device_tokens), rhs=-tail * sum(contexts))
    # The store reads one request's pages after another's, and the copies run one after another
    # too: the chains above let every request read and copy at the store's and the copies' full
    # speed at once. So (a) no copy starts before the first request to copy has its prefix in
    # host memory (at once for one with a host hit, after its read for one loading only stored
    # pages), and every load and the last one's decode tail follow; (b) after the last read ends,
    # its request still copies and computes (its ``d``) and decodes. Which request is first (a)
    # and last (b) is the program's to choose: binary ``a`` and ``b``, at most one each, and one
    # whenever anything is copied or read. ``big`` exceeds any right-hand side, so a row whose
    # request is not chosen holds for every T >= 0.
    big = 1.0 + 2.0 * (
        sum(held) * (read_s + copy_s) + sum(host) * copy_s + sum(computed) * compute_s + decodes + tail + fixed_store + fixed_copies
    )
    can_copy = [host[i] + held[i] > 0 for i in range(n)]
    can_read = [held[i] > 0 for i in range(n)]
    loads_copied = [copy_s] * n
    for i in range(n):
        if can_copy[i]:
            # (a) with i first: its own read (none with a host hit), then every load, then the tail
            head = one(i, read_s) if host[i] == 0 else [0.0] * n
            row(x=[h + c for h, c in zip(head, loads_copied)], t=-1.0, a=one(i, big), rhs=big - tail - sum(host) * copy_s)
            if host[i] == 0:  # first to copy with nothing in host memory: it loads something
                row(x=one(i, -1.0), a=one(i, 1.0), rhs=0.0)
        if can_read[i]:
            # (b) with i last to read: every read, then its device time and decode tail
            row(x=[read_s] * n, d=one(i, 1.0), t=-1.0, b=one(i, big), rhs=big - tail)
            row(x=one(i, -1.0), b=one(i, 1.0), rhs=0.0)  # last to read: it reads something
    first = [1.0 if can_copy[i] else 0.0 for i in range(n)]
    last = [1.0 if can_read[i] else 0.0 for i in range(n)]
    # one first copy if a host hit is copied (else at most one), one last read at most; any load
    # needs both (x_i <= held_i x sum(a), x_i <= held_i x sum(b))
    row(a=first, rhs=1.0, low=1.0 if sum(host) > 0 else 0.0)
    row(b=last, rhs=1.0)
    for i in range(n):
        if held[i] > 0:
            row(x=one(i, 1.0), a=[-held[i] * f for f in first], rhs=0.0)
            row(x=one(i, 1.0), b=[-held[i] * f for f in last], rhs=0.0)
    objective = [0.0] * (2 * n) + [1.0] + [0.0] * (2 * n)
    upper = [*held, *([math.inf] * n), math.inf, *first, *last]
    integrality = [0] * (2 * n + 1) + [1] * (2 * n)
    result = milp(
        objective,
        constraints=LinearConstraint(rows, lows, highs),
        bounds=Bounds([0.0] * (4 * n + 1), upper),
        integrality=integrality,
        options={"mip_rel_gap": 1e-9},
    )
    if not result.success:
        raise RuntimeError(f"the reachable bound's program for a round found no solution: {result.message}")
    return float(result.x[2 * n]), [float(v) for v in result.x[:n]]


def _fit_together(prompts: Sequence[int], device_tokens: int) -> int:
    """The most of these requests L1 holds at once (at least one: a request always fits alone)."""
    total = count = 0
    for size in sorted(prompts):
        total += size
        if total > device_tokens:
            break
        count += 1
    return max(count, 1)
