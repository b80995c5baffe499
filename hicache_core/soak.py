"""Soak: a long multi-turn run through the reference engine with random injected faults.

One engine (L1+L2+L3, small pools so pages really move to and from storage) serves epoch after
epoch of fresh multi-turn conversations; after each epoch L1 and L2 are flushed and the same
conversations are served again, so the second pass reads its prefix from L3. The store is
``integrity(faults(connector))``: seeded random temporary errors of several kinds, added
latency, hangs (bounded by the engine's storage timeout), corrupted and short reads, corrupted
and truncated writes. No permanent error and no wrong result count: the engine gives a store up
at its first one (by design, see :class:`hicache_core.storage_calls.StorageHealth`), which would
end the soak's storage traffic in its first seconds. Every output (token ids and logit bits) is compared with a
second engine that has HiCache off.

Watched all along, sampled every ``sample_s`` seconds from this process: RSS
(``/proc/self/status``), open file descriptors (``/proc/self/fd``), sockets among them, and
``threading.active_count()``. After the warm-up (the first ``warmup_fraction`` of the samples)
each may grow only by a small absolute margin. A watchdog thread ends the process (exit code 3,
every thread's stack on stderr) if no request completes for ``stall_s`` seconds: a deadlock
fails the run instead of hanging it.

Run::

    python -m hicache_core.soak --minutes 2 --json soak.json

Exit code 0 when every check passed, 1 when a check failed (the report says which), 3 on a stall.
Not thread-safe and not reentrant: one soak per process (it measures the whole process).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hicache_core import (
    CacheTiers,
    ControllerConfig,
    Engine,
    EngineConfig,
    ModelConfig,
    PrefetchConfig,
    Request,
    RequestResult,
    StopPolicy,
    make_conversations,
)
from hicache_storage.cost import CostConfig, LoadPolicy
from hicache_storage.registry import create_backend
from hicache_storage.layers import FaultInjectionLayer, IntegrityLayer

#: The tiny real model (deterministic on the CPU) the soak and the fault matrix run.
MODEL = ModelConfig(vocab_size=256, hidden=32, layers=2, q_heads=4, kv_heads=2, head_dim=8, ffn=64, seed=21)
STALL_EXIT_CODE = 3
#: How long the store's levels may stay open after the engine closed and injected hangs were released.
STORE_CLOSE_WAIT_S = 10.0

#: The cost model of :func:`tiny_engine_config`: every page written and every stored page read
#: (``LoadPolicy.ALL``, SGLang's behaviour). What that engine checks is that each page comes back
#: from a faulty store exactly (or is read as a miss); the default choices, made from speeds timed
#: live, would recompute the pages a store reads slower than this tiny model computes them (often,
#: and always under injected latency) and defer their backups, leaving those pages unchecked and
#: the tokens served from L3 up to the machine's load.
EVERY_PAGE = CostConfig(policy=LoadPolicy.ALL)

#: The faults of a soak: the kinds a store is kept through (temporary ones, and a connector bug
#: of no known kind), at rates that leave most calls healthy.
FAULT_ERRORS = ["unavailable", "timeout", "throttled", "capacity", "runtime"]


def fault_spec(seed: int, hang_seconds: float) -> dict[str, Any]:
    common = {"error_rate": 0.04, "errors": FAULT_ERRORS, "latency_rate": 0.05, "latency_seconds": 0.005,
              "hang_rate": 0.005, "hang_seconds": hang_seconds}
    return {
        "seed": seed,
        "exists": dict(common),
        "get": {**common, "corrupt_rate": 0.03, "short_read_rate": 0.03},
        "put": {**common, "corrupt_rate": 0.02, "truncate_write_rate": 0.02},
    }


@dataclass
class SoakConfig:
    minutes: float = 2.0
    seed: int = 0
    #: Connector under the fault layer and its config; default: the file connector on a
    #: temporary directory with an LRU capacity, so the store itself cannot grow without bound.
    backend: str = "file"
    backend_config: dict[str, Any] | None = None
    clients: int = 3
    rounds: int = 3
    turn_tokens: int = 24
    new_tokens: int = 3
    storage_timeout_s: float = 0.5
    sample_s: float = 1.0
    warmup_fraction: float = 0.3
    stall_s: float = 60.0
    #: Allowed growth after the warm-up (absolute): RSS in KiB, then counts.
    rss_margin_kib: int = 32 * 1024
    fd_margin: int = 8
    socket_margin: int = 4
    thread_margin: int = 4


@dataclass
class Sample:
    t: float
    requests: int
    rss_kib: int
    fds: int
    sockets: int
    threads: int


@dataclass
class SoakReport:
    config: dict[str, Any]
    seconds: float = 0.0
    epochs: int = 0
    requests: int = 0
    wrong_tokens: int = 0
    wrong_logits: int = 0
    storage_hit_tokens: int = 0
    max_latency_s: float = 0.0
    faults: dict[str, int] = field(default_factory=dict)
    integrity_misses: int = 0
    engine_counters: dict[str, float] = field(default_factory=dict)
    threads_alive: bool = True
    store_closed: bool = False
    growth: dict[str, int] = field(default_factory=dict)
    warmup_peak: dict[str, int] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        return data


def sample(t: float, requests: int) -> Sample:
    """This process's resources now (Linux /proc)."""
    rss = 0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
                break
    fds = sockets = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listing's own descriptor, already closed
        fds += 1
        sockets += target.startswith("socket:")
    return Sample(round(t, 2), requests, rss, fds, sockets, threading.active_count())


class Watchdog(threading.Thread):
    """Ends the process if the completed-request count stops moving for ``stall_s`` seconds."""

    def __init__(self, stall_s: float, report_path: Path | None) -> None:
        super().__init__(name="soak-watchdog", daemon=True)
        self.stall_s = stall_s
        self.report_path = report_path
        self.progress = 0
        self._last = (0, time.monotonic())
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(min(1.0, self.stall_s / 4)):
            count, since = self._last
            now = time.monotonic()
            if self.progress != count:
                self._last = (self.progress, now)
            elif now - since > self.stall_s:
                message = f"soak stalled: no request completed for {now - since:.0f}s (after {count} requests)"
                print(message, file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                if self.report_path is not None:
                    self.report_path.write_text(json.dumps({"passed": False, "failures": [message]}))
                os._exit(STALL_EXIT_CODE)

    def stop(self) -> None:
        self._stop.set()


def serve_rounds(engine: Engine, conversations: list[list[list[int]]], tag: str, new_tokens: int,
                 during: Callable[[], None] | None = None) -> list[RequestResult]:
    """Multi-turn serving with one barrier per round: round r of every conversation (its history
    of prompts and outputs so far, then its turn) is submitted, and the engine stepped until all
    are done, calling ``during`` after every step (a fault test injects its fault from there).
    Results in (round, conversation) order."""
    histories: list[list[int]] = [[] for _ in conversations]
    out: list[RequestResult] = []
    for r in range(max(len(c) for c in conversations)):
        requests = [(c, Request(f"{tag}-c{c}-r{r}", histories[c] + list(turns[r]), new_tokens))
                    for c, turns in enumerate(conversations) if r < len(turns)]
        for _, request in requests:
            engine.submit(request)
        done: dict[str, RequestResult] = {}
        while engine.has_work():
            engine.step()
            if during is not None:
                during()
            done.update((result.rid, result) for result in engine.take_results())
        for c, request in requests:
            histories[c] = request.tokens + done[request.rid].output_ids
            out.append(done[request.rid])
    return out


def _serve(engine: Engine, conversations: list[list[list[int]]], tag: str, new_tokens: int,
           watchdog: Watchdog) -> list[RequestResult]:
    results = serve_rounds(engine, conversations, tag, new_tokens)
    watchdog.progress += len(results)
    return results


def _compare(report: SoakReport, expected: list[RequestResult], got: list[RequestResult]) -> None:
    for want, have in zip(expected, got):
        report.wrong_tokens += sum(a != b for a, b in zip(want.output_ids, have.output_ids))
        assert want.logits is not None and have.logits is not None
        report.wrong_logits += not torch.equal(want.logits.view(torch.int32), have.logits.view(torch.int32))
        report.max_latency_s = max(report.max_latency_s, have.latency_s)
        report.storage_hit_tokens += have.cached_storage


def tiny_engine_config(tiers: CacheTiers, storage_timeout_s: float | None) -> EngineConfig:
    """The engine of the soak and of the fault matrix (``tests/core/test_fault_matrix.py``): :data:`MODEL`
    on pools too small for a multi-turn history (pages of 4 tokens, 36 on the device, 48 on the
    host), so pages really go to storage and come back; write-through; prefetch from 8 tokens
    with the ``wait_complete`` stop policy (a request waits for what storage has); every page
    written and every stored page read, whatever the speeds (:data:`EVERY_PAGE`); at most 2
    requests running."""
    controller = ControllerConfig(
        prefetch=PrefetchConfig(threshold_tokens=8, stop_policy=StopPolicy.WAIT_COMPLETE),
        storage_timeout_s=storage_timeout_s,
        cost=EVERY_PAGE,
    )
    return EngineConfig(model=MODEL, tiers=tiers, page_size=4, device_pages=36, host_pages=48, host_ratio=None,
                        controller=controller, max_running=2)


def run_soak(config: SoakConfig, report_path: Path | None = None) -> SoakReport:
    """Run the soak for ``config.minutes``; the report lists every failed check (none: passed)."""
    report = SoakReport(config=asdict(config))
    with tempfile.TemporaryDirectory(prefix="hicache-soak-") as scratch:
        backend_config = config.backend_config
        if backend_config is None and config.backend == "file":
            backend_config = {"root": f"{scratch}/kv", "capacity_bytes": 8 * 2**20}
        faults = FaultInjectionLayer(create_backend(config.backend, backend_config),
                                       fault_spec(config.seed, hang_seconds=3 * config.storage_timeout_s))
        integrity = IntegrityLayer(faults)
        watchdog = Watchdog(config.stall_s, report_path)
        watchdog.start()
        started = time.monotonic()
        deadline = started + config.minutes * 60
        next_sample = started
        try:
            with Engine(tiny_engine_config(CacheTiers.OFF, config.storage_timeout_s)) as reference, \
                    Engine(tiny_engine_config(CacheTiers.L1_L2_L3, config.storage_timeout_s), storage=integrity) as engine:
                epoch = 0
                while time.monotonic() < deadline:
                    conversations = make_conversations(config.clients, config.rounds, config.turn_tokens,
                                                       MODEL.vocab_size, seed=config.seed * 1_000_003 + epoch)
                    expected = _serve(reference, conversations, f"ref{epoch}", config.new_tokens, watchdog)
                    _compare(report, expected, _serve(engine, conversations, f"e{epoch}", config.new_tokens, watchdog))
                    engine.flush_cache()
                    _compare(report, expected, _serve(engine, conversations, f"e{epoch}b", config.new_tokens, watchdog))
                    report.requests += 2 * len(expected)
                    report.threads_alive = report.threads_alive and engine.controller.threads_alive
                    epoch += 1
                    now = time.monotonic()
                    if now >= next_sample:
                        report.samples.append(sample(now - started, report.requests))
                        next_sample = now + config.sample_s
                report.epochs = epoch
                report.engine_counters = engine.metrics.snapshot()
                report.faults = {k: v for k, v in faults.event_counts().items() if k.startswith("faults_")}
                report.integrity_misses = sum(v for k, v in integrity.event_counts().items() if k.startswith("integrity_miss"))
        finally:
            # The engine is closed, but a call it gave up on may still hang in an injected fault
            # and then write into ``scratch``: let it go on now, and wait for the stack's late close.
            faults.release_hangs()
            watchdog.stop()
        report.store_closed = _wait_closed(faults, STORE_CLOSE_WAIT_S)
        report.seconds = round(time.monotonic() - started, 1)
    _check(report, config)
    return report


def _wait_closed(stack: FaultInjectionLayer, seconds: float) -> bool:
    """Whether every level of ``stack`` was closed within ``seconds`` (the engine's timeout layer
    closes them once the last call it abandoned has returned)."""
    deadline = time.monotonic() + seconds
    while not all(level.closed for level in stack.levels()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _check(report: SoakReport, config: SoakConfig) -> None:
    failures = report.failures
    if not report.store_closed:
        failures.append(f"the store was still open {STORE_CLOSE_WAIT_S:g}s after the engine closed and its hangs were released")
    if report.wrong_tokens or report.wrong_logits:
        failures.append(f"{report.wrong_tokens} wrong tokens, {report.wrong_logits} requests with wrong logits")
    if not report.threads_alive:
        failures.append("a controller thread died")
    if report.storage_hit_tokens == 0:
        failures.append("no token came from L3: the soak did not exercise storage")
    if sum(report.faults.values()) == 0:
        failures.append("no fault was injected")
    if len(report.samples) < 4:
        failures.append(f"only {len(report.samples)} resource samples: run longer")
        return
    split = max(1, int(len(report.samples) * config.warmup_fraction))
    warm, steady = report.samples[:split], report.samples[split:]
    margins = {"rss_kib": config.rss_margin_kib, "fds": config.fd_margin, "sockets": config.socket_margin,
               "threads": config.thread_margin}
    for name, margin in margins.items():
        peak = max(getattr(s, name) for s in warm)
        growth = max(getattr(s, name) for s in steady) - peak
        report.warmup_peak[name] = peak
        report.growth[name] = growth
        if growth > margin:
            failures.append(f"{name} grew by {growth} after the warm-up (allowed {margin})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hicache_core.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="how long to run (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and the faults (replayable)")
    parser.add_argument("--backend", default="file", help="connector under the faults (default: file on a temp dir)")
    parser.add_argument("--config", default=None, help="the connector's config as JSON (required unless --backend file)")
    parser.add_argument("--stall-seconds", type=float, default=60.0, help="watchdog: longest time without progress")
    parser.add_argument("--json", type=Path, default=None, help="write the full report (with samples) here")
    parser.add_argument("--verbose", action="store_true", help="log every storage warning (thousands on a long run)")
    args = parser.parse_args(argv)
    # Injected faults make the controller and the integrity layer warn on every one; the report counts them.
    logging.basicConfig(level=logging.WARNING if args.verbose else logging.ERROR)
    config = SoakConfig(minutes=args.minutes, seed=args.seed, backend=args.backend,
                        backend_config=json.loads(args.config) if args.config else None, stall_s=args.stall_seconds)
    report = run_soak(config, args.json)
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(), indent=1))
    first, last = report.samples[0] if report.samples else None, report.samples[-1] if report.samples else None
    print(f"soak {report.seconds:.0f}s, {report.epochs} epochs, {report.requests} requests, "
          f"{report.storage_hit_tokens} tokens from L3, faults {report.faults}, integrity misses {report.integrity_misses}")
    print(f"wrong tokens {report.wrong_tokens}, wrong logits {report.wrong_logits}, max latency {report.max_latency_s:.2f}s")
    if first and last:
        print(f"first/last sample: rss {first.rss_kib}/{last.rss_kib} KiB, fds {first.fds}/{last.fds}, "
              f"sockets {first.sockets}/{last.sockets}, threads {first.threads}/{last.threads}")
    print(f"growth after warm-up: {report.growth}")
    print("PASSED" if report.passed else "FAILED: " + "; ".join(report.failures))
    return 0 if report.passed else 1


if __name__ == "__main__":
    code = main()
    # Skip the interpreter's teardown: a storage call the timeout layer gave up on (an injected
    # hang, by design) can still be running on its daemon thread inside torch with the GIL
    # released, and CPython ends such threads with pthread_exit, whose unwinding through C++
    # aborts the process ("terminate called without an active exception", CPython bpo-42969)
    # after the report was written and PASSED printed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
