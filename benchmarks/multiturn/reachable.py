"""The bound a run could reach: each round's dependencies, the machine's cores, and the best
choice between loading a stored prefix and computing it.

The simple bound (:mod:`.bound`) is the busiest leg's total, as if the legs overlapped perfectly
over the whole run. A barriered multi-turn run cannot overlap that way: a round's legs overlap
only with each other (the next round's prompts do not exist yet), a request computes only once
its prefix is on the device, L1 holds only so many requests' contexts, and the store's client
and the device <-> host copies share the machine (its cores and memory bandwidth). And the
simple bound holds the run to the hits it took: a run that loaded a page slower than computing
it is held to that slow load. This bound fixes both, round by round:

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
    starts before the first request to copy begins on the device (at once for a host hit, after
    its read otherwise), and every load and the decode tail follow; and the last request to
    read begins on the device only once every read has ended. Without these, each chain
    ran at the store's and the copies' full speed beside the others: two requests each reading
    and copying 13,000 stored tokens at the H200 grid point took 123 ms in that bound, where no
    order of the two takes less than 165 ms;
  - the store: the round's reads, and the writes the run made during it;
  - the copies: the round's loads to the device and the backups the run made during it;
  - the machine: the store's time and the copies' together, over how much they were measured to
    overlap when run at once (``Legs.overlap``: on the bench's 2-core VM a store read and a load
    share the memory bandwidth and hardly overlap; a GPU server's NIC and PCIe would);
  - device memory: each request holds its whole context from when it begins on the device (its
    copy and prefill) to its last decode step, and the prefix it found on the device from the
    round's start; the sum of context x time cannot exceed L1's tokens x the round's time;
  - L1 and the running slots one request at a time (rounds of at most ``ORDERED_REQUESTS_MAX``
    requests): requests that L1 cannot hold at once, or more than ``max_running`` of them, do
    not all run at once: one ends before another begins (``_overlap_limits``). As token-seconds
    alone, L1 let a request copy its prefix beside the decode steps of the requests that held
    the memory it needed: in the long-history bench's file run at the H200 point (grid at
    eb5e8b3) rounds 20-23, whose four contexts of 10,000-13,000 tokens fill the 32,768-token L1
    in two waves, were held to 124-177 ms and now to 135-190 ms.

  Requests that share pages (a common prefix, held once) are held to neither L1 term.

* The loads ``x`` are chosen to make that least: every term is linear in the loads and the
  times, given which request copies first, which reads last and which requests end before
  which begin; those are binary choices, so each round is a small mixed-integer linear program
  (scipy's HiGHS) solved exactly.

The bound is the sum over rounds. Its efficiency (bound / wall) is the share of what was
possible that the run got; "reachable vs L1" is L1's wall over it. The decode steps a run took
beyond the least, the scheduler's own CPU time and the backups' choice of what to write are the
engine's to account for, not the bound's.
"""

from __future__ import annotations

import itertools
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
    #: Tokens of its prompt it found on the device (held there since the round began).
    from_device: int = 0


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
    #: Whether two of the requests share pages (a common prefix: L1 holds it once, by an amount
    #: the bound does not know, so it leaves L1's capacity out).
    shared_pages: bool = False


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
    memory ``d`` and when that begins ``s``, the round's time ``T``, which request's copy comes
    first and whose read comes last, ``a`` and ``b``, and which request ends before which
    begins, ``o``; minimize ``T``)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    requests = work.requests
    if not requests:
        return 0.0, []
    assert legs.prefill_tokens_per_s is not None and legs.decode_step_s is not None
    n = len(requests)
    # The program counts time in microseconds (``_s`` below: per token, in those units): HiGHS
    # holds a mixed-integer solution's rows to 1e-6 (its mip_feasibility_tolerance, which scipy's
    # milp does not expose). Counted in seconds, a millisecond round's bound fell 1e-6 s (0.07%)
    # below the chain of its own best loads.
    unit = 1e6
    read_s = shape.token_bytes / _speed(legs.storage_read) * unit  # per token read from the store
    copy_s = shape.token_bytes / legs.load * unit  # per token copied host -> device
    compute_s = unit / legs.prefill_tokens_per_s
    step = legs.decode_step_s * unit
    steps = max(shape.output_tokens - 1, 0)
    tail = steps * step
    # the modeled GPU runs prefills and decode steps one after another, and a request's steps are
    # passes of their own: a round of fewer requests than max_running still takes all of them. A
    # step decodes only requests resident in L1 together: at most max_running, and at most as
    # many as fit (smallest prompts first); each stays from its first step to its last, so the
    # requests run in at most ``batch`` lanes, one of them ceil(n / batch) requests long
    # (with pages shared between requests, L1 holds more of them at once than their contexts say)
    memory = not work.shared_pages
    batch = min(shape.max_running, _fit_together([r.context - steps for r in requests], shape.device_tokens) if memory else n)
    decodes = math.ceil(n / batch) * steps * step
    held = [float(r.from_storage + r.stored_recomputed) for r in requests]
    computed = [float(r.computed + r.from_storage) for r in requests]  # computed when nothing is loaded
    host = [float(r.from_host) for r in requests]
    intervals = _overlap_limits(requests, shape) if memory and n <= ORDERED_REQUESTS_MAX else []
    pairs = sorted({pair for limit in intervals for pair in limit})
    program = _Program(x=n, d=n, T=1, a=n, b=n, s=n, o=len(pairs))
    row, one = program.row, program.one
    order = {pair: k for k, pair in enumerate(pairs)}

    for i in range(n):
        # device time: the copy of its prefix and its prefill overlap (layer-wise), so it holds
        # memory at least as long as the longer of the two
        row(x=one(i, copy_s), d=one(i, -1.0), rhs=-host[i] * copy_s)
        row(x=one(i, -compute_s), d=one(i, -1.0), rhs=-computed[i] * compute_s)
        # its own chain: the store read, then device time from ``s``, then the decode tail
        row(x=one(i, read_s), s=one(i, -1.0), rhs=0.0)
        row(d=one(i, 1.0), s=one(i, 1.0), T=[-1.0], rhs=-tail)
    gpu = sum(computed) * compute_s + decodes
    row(x=[-compute_s] * n, T=[-1.0], rhs=-gpu)
    # the store alone: the round's reads, and the writes the run made during it
    fixed_store = (work.storage_written / _speed(legs.storage_write) + work.side_read / _speed(legs.storage_read)) * unit
    row(x=[read_s] * n, T=[-1.0], rhs=-fixed_store)
    # the copies alone: loads to the device, and the run's backups during the round
    fixed_copies = sum(host) * copy_s + (work.backed_up / legs.backup + work.side_loaded / legs.load) * unit
    row(x=[copy_s] * n, T=[-1.0], rhs=-fixed_copies)
    # the machine: the store and the copies overlap only as much as they were measured to
    row(x=[read_s + copy_s] * n, T=[-legs.overlap], rhs=-(fixed_store + fixed_copies))
    contexts = [float(r.context) for r in requests]
    if memory:
        # device memory: each request holds its context through its device time and decode
        # tail, and the prefix it found on the device from the round's start until then
        row(d=contexts, s=[float(r.from_device) for r in requests], T=[-float(shape.device_tokens)], rhs=-tail * sum(contexts))
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
        sum(held) * (read_s + copy_s) + sum(host) * copy_s + sum(computed) * compute_s + decodes + n * tail + fixed_store + fixed_copies
    )
    can_copy = [host[i] + held[i] > 0 for i in range(n)]
    can_read = [held[i] > 0 for i in range(n)]
    loads_copied = [copy_s] * n
    for i in range(n):
        if can_copy[i]:
            # (a) with i first: from when it begins on the device (after its own read, if it
            # loads stored pages), every load, then the tail
            row(x=loads_copied, s=one(i, 1.0), T=[-1.0], a=one(i, big), rhs=big - tail - sum(host) * copy_s)
            if host[i] == 0:  # first to copy with nothing in host memory: it loads something
                row(x=one(i, -1.0), a=one(i, 1.0), rhs=0.0)
        if can_read[i]:
            # (b) with i last to read: it begins on the device (its chain: then its device time
            # and decode tail) only once every read has ended
            row(x=[read_s] * n, s=one(i, -1.0), b=one(i, big), rhs=big)
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
    # L1 and the running slots one request at a time (see ``_overlap_limits``): o_ij = 1 means
    # request i ends (its device time and decode tail) before j begins; then of every set of
    # holdings that cannot all be held at once, at least one pair does not overlap
    for (i, j), k in order.items():
        begins = [1.0 if m == i else -1.0 if m == j else 0.0 for m in range(n)]  # s_i - s_j
        row(d=one(i, 1.0), s=begins, o=program.one(k, big, len(pairs)), rhs=big - tail)
        if (j, i) in order and i < j:
            row(o=[1.0 if m in (k, order[(j, i)]) else 0.0 for m in range(len(pairs))], rhs=1.0)
    for limit in intervals:
        row(o=[1.0 if pair in limit else 0.0 for pair in pairs], rhs=math.inf, low=1.0)
    objective = program.vector(T=[1.0])
    upper = program.vector(x=held, d=[math.inf] * n, T=[math.inf], a=first, b=last, s=[math.inf] * n, o=[1.0] * len(pairs))
    integrality = program.vector(a=[1] * n, b=[1] * n, o=[1] * len(pairs))
    result = milp(
        objective,
        constraints=LinearConstraint(program.rows, program.lows, program.highs),
        bounds=Bounds([0.0] * program.size, upper),
        integrality=integrality,
        options={"mip_rel_gap": 1e-9},
    )
    if not result.success:
        raise RuntimeError(f"the reachable bound's program for a round found no solution: {result.message}")
    return float(result.x[program.start["T"]]) / unit, [float(v) for v in result.x[:n]]


#: Rounds of at most this many requests are held to L1 and the running slots one request at a
#: time (``_overlap_limits``); larger ones, whose sets of requests that cannot run at once are
#: too many to list, to L1 as token-seconds only.
ORDERED_REQUESTS_MAX = 8


def _overlap_limits(requests: Sequence[RequestWork], shape: Shape) -> list[frozenset[tuple[int, int]]]:
    """Which holdings cannot all overlap in time, each as the ordered pairs ``(i, j)`` ("request
    ``i`` ends before ``j`` begins") of which at least one must hold.

    A request holds a running slot and the rest of its context (``F_i``: all but the prefix it
    found on the device) from when it begins on the device to its last decode step, and that
    prefix (``R_i``) from the round's start to the same end. Holdings are intervals of time,
    and intervals of which every two overlap share a point (Helly's theorem in one dimension):
    so a set of them whose tokens exceed L1, or ``max_running`` + 1 requests' slots, must
    contain two that do not overlap. ``F_i`` and ``F_j`` do not when either ends before the other begins; ``R_i``
    and ``F_j`` only when ``i`` ends before ``j`` begins (``R_i`` is held from the start); two
    ``R``s always overlap. Only minimal sets are listed (any larger one contains one)."""
    n = len(requests)
    # (request, "F" the rest of its context or "R" the prefix it found on the device, tokens)
    items = [(i, "F", r.context - r.from_device) for i, r in enumerate(requests)]
    items += [(i, "R", r.from_device) for i, r in enumerate(requests) if r.from_device > 0]
    limits: set[frozenset[tuple[int, int]]] = set()

    def apart(p: tuple[int, str, int], q: tuple[int, str, int]) -> list[tuple[int, int]]:
        (i, kind_i, _), (j, kind_j, _) = p, q
        if i == j or kind_i == kind_j == "R":
            return []
        if kind_i == kind_j == "F":
            return [(i, j), (j, i)]
        return [(i, j)] if kind_i == "R" else [(j, i)]

    def add(chosen: Sequence[tuple[int, str, int]]) -> None:
        pairs = frozenset(pair for a, p in enumerate(chosen) for q in chosen[a + 1 :] for pair in apart(p, q))
        if pairs:  # (a set that could never be held at once has no pair to order: L1 held it, so it cannot occur)
            limits.add(pairs)

    for size in range(2, len(items) + 1):
        for chosen in itertools.combinations(items, size):
            tokens = sum(item[2] for item in chosen)
            if tokens > shape.device_tokens >= tokens - min(item[2] for item in chosen):
                add(chosen)
    if n > shape.max_running:
        for chosen in itertools.combinations([item for item in items if item[1] == "F"], shape.max_running + 1):
            add(chosen)
    return sorted(limits, key=sorted)


class _Program:
    """Rows ``low <= A @ v <= high`` over named blocks of variables, laid out in the order given."""

    def __init__(self, **sizes: int) -> None:
        self.start: dict[str, int] = {}
        self.size = 0
        for name, count in sizes.items():
            self.start[name] = self.size
            self.size += count
        self.sizes = sizes
        self.rows: list[list[float]] = []
        self.lows: list[float] = []
        self.highs: list[float] = []

    def vector(self, **blocks: Sequence[float]) -> list[float]:
        out = [0.0] * self.size
        for name, values in blocks.items():
            if len(values) != self.sizes[name]:
                raise ValueError(f"block {name} has {self.sizes[name]} variables, got {len(values)} values")
            out[self.start[name] : self.start[name] + len(values)] = values
        return out

    def row(self, *, rhs: float, low: float = -math.inf, **blocks: Sequence[float]) -> None:
        self.rows.append(self.vector(**blocks))
        self.lows.append(low)
        self.highs.append(rhs)

    def one(self, i: int, value: float, count: int | None = None) -> list[float]:
        """A block's coefficients: ``value`` at ``i``, 0 elsewhere (``count``: the block's size, the requests' by default)."""
        size = self.sizes["x"] if count is None else count
        return [value if j == i else 0.0 for j in range(size)]


def _fit_together(prompts: Sequence[int], device_tokens: int) -> int:
    """The most of these requests L1 holds at once (at least one: a request always fits alone)."""
    total = count = 0
    for size in sorted(prompts):
        total += size
        if total > device_tokens:
            break
        count += 1
    return max(count, 1)
