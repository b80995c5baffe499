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
* **A plan per prefix** (:meth:`CostModel.pages_to_load`). A request's prefix must be read
  from the store before it starts; then, layer by layer, its copy to the device and the compute
  of the tokens it did not load overlap (a layer computes once that layer's KV has landed). The
  copies run on their own stream, beside the compute of the requests before it. So loading
  ``x`` of its ``stored`` pages finishes at the later of
  ``max(device ahead, ready(x)) + compute(stored - x + new)`` and
  ``max(copies ahead, ready(x)) + copy(x)``: ``ready(x)`` is the reads queued before it, the
  call's latency and ``x`` pages of reading; the device and the copies ahead are what the engine
  must do for the requests queued before it (each copies after the copies before it, and
  computes after the compute before it and not before its own copy has landed; charged as one
  leg, a copy waited for the compute ahead: file at the H200 point, three runs each alternated,
  4.65-4.67 s then, 4.50-4.65 s now). The plan takes the ``x`` that finishes first: every
  stored page when the copies and reads are cheap, none (or only the head read while the
  engine is busy, which costs nothing) when reading a page is slower than computing it, and in
  between as many as the compute of the rest hides the copy of (a store and a device copy each
  faster than compute, together slower: the fast-GPU case).
* **When to stop waiting** (:meth:`CostModel.keep_waiting`): a read that runs slower than
  planned is abandoned for computing once the pages still to come would arrive after computing
  them would be done (before its first pages arrive: what is left of the model's time for the
  read, and past that time, rent or buy).
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
from collections.abc import Callable, Collection, Hashable
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
    #: Seconds of device work (compute, not before each request's copy) queued ahead of the
    #: request, and of reads queued ahead of its own.
    device_ahead_s: float
    reads_ahead_s: float
    #: Seconds the request finishes sooner with this plan than computing every stored page
    #: (``None``: not known, with :attr:`LoadPolicy.ALL` or a leg not timed).
    saved_s: float | None = None

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
        #: Requests queued but not started, in arrival order: the tokens each will compute and
        #: the bytes it will copy to the device.
        self._queue: OrderedDict[Hashable, _Queued] = OrderedDict()
        #: Stored pages recent plans were offered and loaded (decayed sums, like a leg's fit).
        self._offered = self._loaded = 0.0
        #: Lookups of pages the engine did not know stored (decayed sums, like a leg's fit):
        #: those made, those that found any such page, and their seconds.
        self._lookups = self._lookups_found = self._lookup_s = 0.0
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

    # --- the device work queued ahead ---------------------------------------------------------

    def enqueue(self, request: Hashable, tokens: int, copy_bytes: int = 0) -> None:
        """``request`` will compute ``tokens`` and copy ``copy_bytes`` from host memory to the
        device (its prefix held there), before any of its stored pages are planned. Queued
        again (a refetch), it keeps its place in line."""
        with self._lock:
            self._queue[request] = _Queued(max(0, tokens), max(0, copy_bytes))

    def will_load(self, request: Hashable, tokens: int, nbytes: int = 0) -> None:
        """``request`` loads ``tokens`` it was queued to compute: ``nbytes`` read from the store
        and copied to the device."""
        with self._lock:
            queued = self._queue.get(request)
            if queued is not None:
                queued.tokens = max(0, queued.tokens - tokens)
                queued.copy_bytes += max(0, nbytes)

    def started(self, request: Hashable) -> None:
        """``request``'s compute is on the accelerator now (part of ``busy_for_s``), or dropped."""
        with self._lock:
            self._queue.pop(request, None)

    def device_ahead_s(self, request: Hashable) -> float:
        """Seconds until the engine could start on ``request``: the accelerator's work under way,
        then the requests queued before it, each computing after the one before and not before
        its copies to the device have landed (the copies, on their own stream, one after
        another; a request's copy and compute overlap layer by layer); 0 while the compute rate
        is unknown."""
        return self._queued_ahead(request)[0]

    def _queued_ahead(self, request: Hashable) -> tuple[float, float, _Queued | None]:
        """When the device's compute and its copy stream are done with the requests queued before
        ``request`` (seconds from now), and its own queue entry. Each request ahead copies after
        the copies before it, and computes after the compute before it and not before its copy
        has landed (layer by layer: its compute ends no sooner than its copy)."""
        rate = self.compute_tokens_per_s
        copy = self._fresh_fit(self.copies)
        copy_s_per_byte = copy[1] if copy is not None else 0.0
        device = copies = 0.0
        own: _Queued | None = None
        with self._lock:
            for queued, entry in self._queue.items():
                if queued == request:
                    own = _Queued(entry.tokens, entry.copy_bytes)
                    break
                if rate is not None:
                    copies += entry.copy_bytes * copy_s_per_byte
                    device = max(device + entry.tokens / rate, copies)
        if rate is None:
            return 0.0, 0.0, own
        busy = max(0.0, self.busy_for_s())
        return busy + device, copies, own

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
        self,
        request: Hashable,
        stored_pages: int,
        *,
        page_bytes: int,
        page_tokens: int,
        reads_ahead_bytes: int = 0,
        cuts: Collection[int] | None = None,
    ) -> LoadPlan:
        """How many of ``stored_pages`` (the head of the rest of ``request``'s prefix) to load:
        the count that finishes the request first (see the module).

        ``reads_ahead_bytes``: reads queued on the store before this one. ``cuts``: where a load
        may stop, when not after any page (a hybrid model resumes only where every pool holds
        state: loading fewer pages than a cut means computing from the cut before); none, or
        ``stored_pages``, always may. With :attr:`LoadPolicy.ALL`, or the reads or the compute
        not timed yet, every stored page (untimed copies count as free).
        """
        load = self.load_s_per_page(page_bytes)
        compute = self.compute_s_per_page(page_tokens)
        ahead, copies_ahead, own = self._queued_ahead(request)
        read_fit = self._fresh_fit(self.reads)
        reads_ahead = 0.0 if read_fit is None else reads_ahead_bytes * read_fit[1]

        def plan(pages: int, saved_s: float | None = None) -> LoadPlan:
            return LoadPlan(pages, stored_pages, load, compute, ahead, reads_ahead, saved_s)

        if self.config.policy is LoadPolicy.ALL or stored_pages <= 0 or load is None or compute is None:
            return plan(max(0, stored_pages))
        assert read_fit is not None
        latency, read = read_fit[0], page_bytes * read_fit[1]
        copy_fit = self._fresh_fit(self.copies)
        copy = page_bytes * copy_fit[1] if copy_fit is not None else 0.0
        # What the request computes and copies whatever the plan: the tokens no tier holds, and
        # its prefix held in host memory (unknown for a request not queued: none).
        new_s = max(0, own.tokens - stored_pages * page_tokens) / page_tokens * compute if own is not None else 0.0
        host_s = own.copy_bytes / page_bytes * copy if own is not None else 0.0

        def finish(pages: int) -> float:
            ready = reads_ahead + latency + pages * read if pages else 0.0
            computed = max(ahead, ready) + new_s + (stored_pages - pages) * compute
            copied = max(copies_ahead, ready) + host_s + pages * copy
            return max(computed, copied)

        # finish is piecewise linear in the pages loaded, the larger of two pieces each: the
        # compute of the rest starts once the device is done with the requests ahead, or once
        # the read is, and the copy once the copy stream is, or once the read is. Its least is
        # at an end or where two pieces meet: the last page read before the engine reaches the
        # request (reading it costs nothing), or where the copies of the loaded pages end as the
        # compute of the rest does (past it, each page loaded lengthens the copies).
        candidates = {0, stored_pages}
        if cuts is not None:
            # only where a load may stop: computing "the rest" from an earlier cut costs what
            # ``finish`` charges for it (the one page the balance point would leave to the
            # compute is, for a hybrid model, every page back to the cut before)
            candidates.update(cut for cut in cuts if 0 < cut < stored_pages)
            best = min(candidates, key=lambda pages: (finish(pages), -pages))
            return plan(best, finish(0) - finish(best))
        computing = new_s + stored_pages * compute
        first = reads_ahead + latency  # (the read's own start, when it loads anything)
        pieces = [
            (ahead + computing, -compute),
            (first + computing, read - compute),
            (copies_ahead + host_s, copy),
            (first + host_s, read + copy),
        ]
        for k, (a0, a1) in enumerate(pieces):
            for b0, b1 in pieces[k + 1 :]:
                if a1 != b1:
                    point = (b0 - a0) / (a1 - b1)
                    candidates.update(min(stored_pages, max(0, bound)) for bound in (math.floor(point), math.ceil(point)))
        # the most pages among the quickest: a tie is better spent on what is stored
        best = min(candidates, key=lambda pages: (finish(pages), -pages))
        return plan(best, finish(0) - finish(best))

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

    def record_lookup(self, seconds: float, *, found: bool) -> None:
        """A lookup of pages only another engine could have written took ``seconds``;
        ``found``: the store held some of them."""
        if not seconds >= 0 or not math.isfinite(seconds):
            return
        decay = 1.0 - self.config.smoothing
        with self._lock:
            self._lookups = self._lookups * decay + 1.0
            self._lookups_found = self._lookups_found * decay + float(found)
            self._lookup_s = self._lookup_s * decay + seconds

    def lookup_pays(self, saved_s: float | None) -> bool:
        """Whether a request should wait for a lookup of pages only another engine could have
        written (the engine neither stored them nor queued them for a backup: mostly a
        conversation's new turn), for a plan that finishes ``saved_s`` sooner if the store holds
        them: yes when the share of recent such lookups that found any (with one more counted
        as found, so a store that starts holding others' pages is noticed by the larger plans)
        times ``saved_s`` is at least a lookup's mean time. With one engine per store at the
        long-history bench's H200 point every request waited for such a lookup and none found
        anything; skipping them, S3 went 13.9 -> 12.0 s (docs/load-or-recompute.md). Always with
        :attr:`LoadPolicy.ALL`, before any lookup was timed, or when ``saved_s`` is not known."""
        if not self.adaptive or saved_s is None:
            return True
        with self._lock:
            if self._lookups == 0.0:
                return True
            share = (self._lookups_found + 1.0) / (self._lookups + 1.0)
            mean_s = self._lookup_s / self._lookups
        return share * saved_s >= mean_s

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

    def keep_waiting(
        self,
        request: Hashable,
        pages_left: int,
        *,
        page_bytes: int,
        page_tokens: int,
        seconds_per_page: float | None,
        waited_s: float = 0.0,
    ) -> bool:
        """Whether ``request`` should keep waiting for the ``pages_left`` pages still being read
        rather than compute them now: yes while they arrive (at ``seconds_per_page``, the read's
        own pace so far) and are copied before computing them would be done.

        Before any page has arrived (no pace: ``seconds_per_page`` None) the read has run for
        ``waited_s`` of the model's time for them: what is left of that counts, not all of it. A
        first batch in flight is every page of a read of one batch: counted whole, a Mooncake
        read of 143 pages that had run 193 of its 203 ms was given up at parity (load ~ compute)
        and all 9,152 tokens recomputed. A read running past the model's time is waited for
        while it is late by less than computing the pages instead would take beyond copying
        them (rent or buy: at most twice the better of the two).

        With :attr:`LoadPolicy.ALL`, or untimed legs, always (the stop policy decides).
        """
        if self.config.policy is LoadPolicy.ALL or pages_left <= 0:
            return self.config.policy is LoadPolicy.ALL
        compute = self.compute_s_per_page(page_tokens)
        read = self._fresh_fit(self.reads)
        if compute is None or (seconds_per_page is None and read is None):
            return True
        copy = self._fresh_fit(self.copies)
        copying = pages_left * page_bytes * copy[1] if copy is not None else 0.0
        computing = self.device_ahead_s(request) + pages_left * compute
        if seconds_per_page is not None:
            return pages_left * seconds_per_page + copying <= computing
        assert read is not None
        reading = pages_left * page_bytes * read[1]
        if waited_s <= reading:
            return reading - waited_s + copying <= computing
        return waited_s - reading <= computing - copying

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


@dataclass
class _Queued:
    """A request queued on the engine: the tokens it will compute, the bytes it will copy."""

    tokens: int
    copy_bytes: int
