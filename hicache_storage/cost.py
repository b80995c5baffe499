"""Load or recompute: what a stored prefix costs to load against what it costs to compute.

An engine that finds the rest of a prompt's prefix in storage can load those pages or compute
them. Loading pays only for the pages that arrive before computing would have produced them,
and that depends on speeds no configuration knows in advance: the store's (a local NVMe reads
a page in a fraction of a millisecond, an object store over a busy link in tens), the
engine's compute (a GPU prefills 10-100x faster than a CPU stand-in) and what is already queued
on each. :class:`CostModel` learns them from the calls the engine makes and plans each load:

* **Rates.** Each leg (store reads, store writes, host -> device copies) is a :class:`RateMeter`
  fit to the calls timed on it: ``seconds = latency + bytes x seconds_per_byte``, recent calls
  weighing most. The compute rate is the engine's (given, or fit the same way from prefills).
* **A plan per prefix** (:meth:`CostModel.pages_to_load`). Page ``k`` of a stored prefix
  (head first) is ready to use once the reads queued before it, the call's latency and ``k``
  pages of reading and copying are done; the engine reaches the request once the compute queued
  ahead of it is done. Loading ``x`` pages and computing the rest finishes at
  ``max(compute ahead, ready(x)) + (stored - x) x compute per page``: when a page loads faster
  than it computes, every stored page is loaded; when it loads slower, only the head that is
  ready before the engine could start on it (reading it costs nothing then), which is none on
  an idle engine. The rest is recomputed.
* **When to stop waiting** (:meth:`CostModel.keep_waiting`): a read that runs slower than
  planned is abandoned for computing once the pages still to come would arrive after computing
  them would be done.
* **Whether writes should yield** (:meth:`CostModel.store_is_slow_leg`): when loading a page
  costs more than computing it, reads are what the store's time is for (a backup helps only
  the loads of tomorrow), so an engine lets its backups wait behind reads and backs up
  selectively.

Until a leg has been timed the model assumes it is fast (every stored page is loaded, as a
plain threshold policy would), so the first loads measure it; a leg not timed for
``CostConfig.forget_after_s`` is assumed fast again, so a store that got faster is noticed.

Thread-safe: the engine's scheduler, prefetch and backup threads share one model.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass


class LoadPolicy(str, enum.Enum):
    """Which stored pages of a prefix an engine loads."""

    #: The pages that arrive before computing them would be done (:class:`CostModel`).
    COST = "cost"
    #: Every stored page the prefetch threshold lets through (SGLang's behaviour).
    ALL = "all"


@dataclass(frozen=True)
class CostConfig:
    policy: LoadPolicy = LoadPolicy.COST
    #: Weight of the newest call in a leg's fit (exponential decay of the older ones).
    smoothing: float = 0.2
    #: A leg not timed for this long is assumed fast again (its next loads measure it anew).
    forget_after_s: float = 30.0
    #: Speeds known in advance (bytes per second), used instead of timing the leg: for a
    #: deployment that wants the same plan every time, or to plan before the first call.
    read_bytes_per_s: float | None = None
    write_bytes_per_s: float | None = None
    copy_bytes_per_s: float | None = None
    #: The engine's prefill rate in tokens per second, if known in advance (else the engine's
    #: own figure, or its prefills timed).
    compute_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"CostConfig.smoothing must be in (0, 1], got {self.smoothing}")
        if self.forget_after_s <= 0:
            raise ValueError(f"CostConfig.forget_after_s must be positive, got {self.forget_after_s}")
        for name in ("read_bytes_per_s", "write_bytes_per_s", "copy_bytes_per_s", "compute_tokens_per_s"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"CostConfig.{name} must be a positive finite speed, or None to measure it; got {value}")


class RateMeter:
    """``seconds = latency + bytes x seconds_per_byte`` for one leg, fit to its timed calls.

    A decayed least-squares fit: each call adds ``(bytes, seconds)`` with weight 1 and the
    earlier ones decay by ``1 - smoothing``. When the calls seen are too alike in size to
    separate latency from bandwidth, the latency is 0 and the rate is their total bytes over
    their total time (a conservative rate: it includes the latency). ``None`` until timed.
    """

    def __init__(self, smoothing: float, clock: Callable[[], float] = time.monotonic, *, given_bytes_per_s: float | None = None) -> None:
        self._decay = 1.0 - smoothing
        self._clock = clock
        #: A speed known in advance: the fit is always ``(0, 1 / given)`` and never forgotten.
        self.given = given_bytes_per_s
        self._lock = threading.Lock()
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self.calls = 0
        self.last_at: float | None = None

    def record(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        n, t = float(nbytes), float(seconds)
        with self._lock:
            d = self._decay
            self._w = self._w * d + 1.0
            self._n = self._n * d + n
            self._t = self._t * d + t
            self._nn = self._nn * d + n * n
            self._nt = self._nt * d + n * t
            self.calls += 1
            self.last_at = self._clock()

    def fit(self) -> tuple[float, float] | None:
        """``(latency_s, seconds_per_byte)``, or None before the first call."""
        if self.given is not None:
            return 0.0, 1.0 / self.given
        with self._lock:
            if self._w == 0.0 or self._n == 0.0:
                return None
            mean_n, mean_t = self._n / self._w, self._t / self._w
            var_n = self._nn / self._w - mean_n * mean_n
            if var_n > (0.05 * mean_n) ** 2:
                slope = (self._nt / self._w - mean_n * mean_t) / var_n
                latency = mean_t - slope * mean_n
                if slope > 0 and latency >= 0:
                    return latency, slope
            return 0.0, self._t / self._n

    def bytes_per_s(self) -> float | None:
        fitted = self.fit()
        return None if fitted is None else 1.0 / fitted[1]


@dataclass(frozen=True)
class LoadPlan:
    """What :meth:`CostModel.pages_to_load` decided for one prefix, and from what."""

    pages: int
    stored_pages: int
    #: Seconds to read and copy one page, and to compute one (``None``: not timed yet).
    load_s_per_page: float | None
    compute_s_per_page: float | None
    #: Seconds of compute queued ahead of the request, and of reads queued ahead of its own.
    compute_ahead_s: float
    reads_ahead_s: float

    @property
    def recomputed_pages(self) -> int:
        return self.stored_pages - self.pages


class CostModel:
    """Speeds of one engine's legs, the compute queued on it, and its load plans (see the module)."""

    def __init__(self, config: CostConfig | None = None, *, compute_tokens_per_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """``compute_tokens_per_s``: the engine's own prefill rate, when it knows it (the
        config's, if given, comes first; without either, prefills are timed)."""
        self.config = config or CostConfig()
        if compute_tokens_per_s is not None and not compute_tokens_per_s > 0:
            raise ValueError(f"compute_tokens_per_s must be positive, got {compute_tokens_per_s}")
        self._clock = clock
        config = self.config
        self.reads = RateMeter(config.smoothing, clock, given_bytes_per_s=config.read_bytes_per_s)
        self.writes = RateMeter(config.smoothing, clock, given_bytes_per_s=config.write_bytes_per_s)
        self.copies = RateMeter(config.smoothing, clock, given_bytes_per_s=config.copy_bytes_per_s)
        self._compute = RateMeter(self.config.smoothing, clock)
        self._given_rate = self.config.compute_tokens_per_s or compute_tokens_per_s
        self._lock = threading.Lock()
        #: Requests whose compute is queued but not started, in arrival order: tokens each.
        self._queue: OrderedDict[Hashable, int] = OrderedDict()
        #: Stored pages recent plans were offered and loaded (decayed sums, like a leg's fit).
        self._offered = self._loaded = 0.0
        #: When the work already started on the engine's accelerator ends (a callable, so an
        #: engine can report it live); 0 for an engine that computes synchronously.
        self.busy_for_s: Callable[[], float] = lambda: 0.0

    # --- what the engine measures ------------------------------------------------------------

    def record_read(self, nbytes: int, seconds: float) -> None:
        self.reads.record(nbytes, seconds)

    def record_write(self, nbytes: int, seconds: float) -> None:
        self.writes.record(nbytes, seconds)

    def record_copy(self, nbytes: int, seconds: float) -> None:
        """A host -> device load of ``nbytes`` took ``seconds`` (the second leg of a page's load)."""
        self.copies.record(nbytes, seconds)

    def record_compute(self, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` took ``seconds`` (ignored when the rate was given)."""
        self._compute.record(tokens, seconds)

    @property
    def compute_tokens_per_s(self) -> float | None:
        if self._given_rate is not None:
            return self._given_rate
        return self._compute.bytes_per_s()

    # --- the compute queued ahead -------------------------------------------------------------

    def enqueue(self, request: Hashable, tokens: int) -> None:
        """``request`` will compute ``tokens`` (before any of its stored pages are planned)."""
        with self._lock:
            self._queue[request] = max(0, tokens)

    def will_load(self, request: Hashable, tokens: int) -> None:
        """``request`` loads ``tokens`` it was queued to compute."""
        with self._lock:
            if request in self._queue:
                self._queue[request] = max(0, self._queue[request] - tokens)

    def started(self, request: Hashable) -> None:
        """``request``'s compute is on the accelerator now (part of ``busy_for_s``), or dropped."""
        with self._lock:
            self._queue.pop(request, None)

    def compute_ahead_s(self, request: Hashable) -> float:
        """Seconds until the engine could start on ``request``: the accelerator's work under way
        plus the compute of the requests queued before it (0 while the rate is unknown)."""
        rate = self.compute_tokens_per_s
        if rate is None:
            return 0.0
        with self._lock:
            ahead = 0
            for queued, tokens in self._queue.items():
                if queued == request:
                    break
                ahead += tokens
        return max(0.0, self.busy_for_s()) + ahead / rate

    # --- decisions ----------------------------------------------------------------------------

    @property
    def reads_timed(self) -> bool:
        """Whether the store's reads were timed recently enough to plan with (``forget_after_s``)."""
        return self._fresh_fit(self.reads) is not None

    def load_s_per_page(self, page_bytes: int) -> float | None:
        """Seconds to read one page from the store and copy it to the device; None until timed
        (or forgotten: see ``forget_after_s``)."""
        read = self._fresh_fit(self.reads)
        if read is None:
            return None
        copy = self._fresh_fit(self.copies)
        return page_bytes * (read[1] + (copy[1] if copy is not None else 0.0))

    def compute_s_per_page(self, page_tokens: int) -> float | None:
        rate = self.compute_tokens_per_s
        return None if rate is None else page_tokens / rate

    def pages_to_load(
        self, request: Hashable, stored_pages: int, *, page_bytes: int, page_tokens: int, reads_ahead_bytes: int = 0
    ) -> LoadPlan:
        """How many of ``stored_pages`` (the head of the rest of ``request``'s prefix) to load.

        ``reads_ahead_bytes``: reads queued on the store before this one. With
        :attr:`LoadPolicy.ALL`, or a leg not timed yet, every stored page.
        """
        load = self.load_s_per_page(page_bytes)
        compute = self.compute_s_per_page(page_tokens)
        ahead = self.compute_ahead_s(request)
        read_fit = self._fresh_fit(self.reads)
        reads_ahead = 0.0 if read_fit is None else reads_ahead_bytes * read_fit[1]

        def plan(pages: int) -> LoadPlan:
            return LoadPlan(pages, stored_pages, load, compute, ahead, reads_ahead)

        if self.config.policy is LoadPolicy.ALL or stored_pages <= 0 or load is None or compute is None or load <= compute:
            return plan(max(0, stored_pages))
        assert read_fit is not None
        latency = read_fit[0]
        # Pages ready before the engine reaches the request cost nothing; past that, each loads
        # slower than it computes. The best cut is the last page ready by then or the one after
        # it (whose excess over the engine's start may still be less than one page of compute).
        ready_by = ahead - reads_ahead - latency
        free = min(stored_pages, max(0, math.floor(ready_by / load))) if ready_by > 0 else 0

        def finish(pages: int) -> float:
            ready = reads_ahead + latency + pages * load if pages else 0.0
            return max(ahead, ready) + (stored_pages - pages) * compute

        best = min((free, min(free + 1, stored_pages)), key=finish)
        return plan(best)

    def note_plan(self, stored_pages: int, loaded_pages: int) -> None:
        """What a plan the engine acted on chose: ``loaded_pages`` of the ``stored_pages`` it could
        have asked the store for (a prefetch's whole range: the share of what requests want from
        L3 that loads take, which writes follow)."""
        if stored_pages <= 0:
            return
        decay = 1.0 - self.config.smoothing
        with self._lock:
            self._offered = self._offered * decay + stored_pages
            self._loaded = self._loaded * decay + min(loaded_pages, stored_pages)

    def load_share(self, page_bytes: int, page_tokens: int) -> float:
        """The share of what requests want from L3 that loads take, which a backup's worth
        follows: 1 while the store is not the slow leg (every stored page is loaded); else the
        share recent plans loaded (only the head a busy engine's compute hides, none on an idle
        one), or before any plan what the speeds suggest, compute over load per page (a store
        ``k`` times slower: ``1 / k``)."""
        if not self.store_is_slow_leg(page_bytes, page_tokens):
            return 1.0
        with self._lock:
            if self._offered > 0:
                return self._loaded / self._offered
        load = self.load_s_per_page(page_bytes)
        compute = self.compute_s_per_page(page_tokens)
        assert load is not None and compute is not None  # both timed: the store is the slow leg
        return compute / load

    def keep_waiting(self, request: Hashable, pages_left: int, *, page_bytes: int, page_tokens: int, seconds_per_page: float | None) -> bool:
        """Whether ``request`` should keep waiting for the ``pages_left`` pages still being read
        rather than compute them now: yes while they arrive (at ``seconds_per_page``, the read's
        own pace so far, or the model's) before computing them would be done.

        With :attr:`LoadPolicy.ALL`, or untimed legs, always (the stop policy decides).
        """
        if self.config.policy is LoadPolicy.ALL or pages_left <= 0:
            return self.config.policy is LoadPolicy.ALL
        compute = self.compute_s_per_page(page_tokens)
        pace = seconds_per_page if seconds_per_page is not None else self.load_s_per_page(page_bytes)
        if compute is None or pace is None:
            return True
        copy = self._fresh_fit(self.copies)
        per_page = pace + (page_bytes * copy[1] if copy is not None and seconds_per_page is not None else 0.0)
        return pages_left * per_page <= self.compute_ahead_s(request) + pages_left * compute

    @property
    def adaptive(self) -> bool:
        """Whether the engine adapts to the speeds (:attr:`LoadPolicy.COST`); with
        :attr:`LoadPolicy.ALL` it loads and writes as SGLang does, whatever they are."""
        return self.config.policy is LoadPolicy.COST

    def write_s_per_byte(self) -> float | None:
        """Seconds per byte written to the store (None until timed, or forgotten)."""
        fitted = self._fresh_fit(self.writes)
        return None if fitted is None else fitted[1]

    def store_is_slow_leg(self, page_bytes: int, page_tokens: int) -> bool:
        """Whether loading a page of ``page_bytes`` takes longer than computing its
        ``page_tokens`` (False until both were timed, and always with :attr:`LoadPolicy.ALL`)."""
        if not self.adaptive:
            return False
        load = self.load_s_per_page(page_bytes)
        compute = self.compute_s_per_page(page_tokens)
        return load is not None and compute is not None and load > compute

    def _fresh_fit(self, meter: RateMeter) -> tuple[float, float] | None:
        if meter.given is not None:
            return meter.fit()
        last = meter.last_at
        if last is None or self._clock() - last > self.config.forget_after_s:
            return None
        return meter.fit()
