"""The fault matrix: whatever the storage tier does, the engine serves the tokens it would compute.

Each scenario runs the reference engine (the tiny real model, deterministic) on a multi-turn
workload whose device and host pools are too small for its history, so pages really go to and
come back from L3, in three phases on one engine:

1. **warm**: conversations A are served healthy; their pages land in L3.
2. **fault**: L1 and L2 are flushed, then A (read back from L3) and a fresh conversation B
   (written to L3) are served while the fault is injected mid-run.
3. **recovery**: the fault is cleared; the workload is served again (flushing L1/L2 before
   each pass) until tokens come from L3 again, for at least the time the store's breaker
   takes to probe it back (:func:`recovery_window_s`). A temporary fault needs nothing more; after a
   permanent one (a contract violation, bad credentials) the engine has given the store up, so
   the scenario also does what an operator would: detach it and attach a fixed store.

Every phase's outputs (token ids and the bits of every logit) must equal a run with HiCache off.
Also asserted: the engine never raises, the controller's backup and prefetch threads stay alive,
every request finishes within a generous bound derived from the configured storage timeout
(:func:`latency_bound`; no tight timing threshold), L3 hits resume after the fault clears, and the
counters show what happened. Servers that are killed or frozen are this module's own instances,
never the session fixtures'.

Set ``HICACHE_FAULT_REPORT=<file>`` to append each scenario's figures as a JSON line (the
figures in docs/reliability.md come from such a run).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from connector_matrix import connector_config
from hicache_core import CacheTiers, Engine, EngineConfig, RequestResult, make_conversations
from hicache_core import prefetch
from hicache_core.soak import serve_rounds, tiny_engine_config
from hicache_storage import KeyScope, Namespace, Store, create_backend
from hicache_storage.connector import Level
from hicache_storage.health import BreakerConfig
from hicache_storage.keys import PageKey
from hicache_storage.layers import FaultInjectionLayer, IntegrityLayer
from hicache_storage.layers.base import Layer
from hicache_storage.errors import ErrorStatus, StorageError
from hicache_storage.layers.faults import ERROR_KINDS

WARM = make_conversations(clients=3, rounds=3, turn_tokens=24, vocab_size=256, seed=5)
#: One fresh conversation writes new pages during the fault; each more costs every scenario a
#: storage timeout or two per request while a server is frozen (about 2 s each).
FRESH = make_conversations(clients=1, rounds=3, turn_tokens=24, vocab_size=256, seed=6)
WORKLOAD = WARM + FRESH
NEW_TOKENS = 3
#: The engine's storage timeout (``ControllerConfig.storage_timeout_s``): 1 s, 3 s for S3, whose
#: healthy batches of puts can take about a second on a loaded 2-core machine.
STORAGE_TIMEOUT_S = 1.0
STORAGE_TIMEOUT_S_BY_CONNECTOR = {"s3": 2.0}


def latency_bound(timeout_s: float) -> float:
    """A request waits at most for the prefetches queued ahead of it (one per request of its round,
    each an exists and one read call) and, once, a refetch; each call is bounded by the timeout
    layer at twice its timeout (waiting for a worker, then for the call). Doubled again, plus
    compute slack on a loaded 2-core machine: generous on purpose."""
    return 2 * (len(WORKLOAD) * 2 * 2 * timeout_s) + 30.0

#: Recovery serves the workload at least this many times, and goes on until L3 hits resume or
#: the breaker has had time to probe the store back (:func:`recovery_window_s`).
RECOVERY_PASSES = 4


def recovery_window_s(engine: Engine) -> float:
    """How long after the fault clears L3 hits must resume: the breaker's longest wait between
    probes, then the probe itself and the first data calls (each bounded by the timeout layer at
    twice the storage timeout), doubled for a loaded machine. Bounded by time, not passes: a
    pass of the tiny workload takes a fraction of a second on a quiet machine, well inside one
    probe backoff, so four passes alone pass or fail by the machine's speed."""
    config = engine.controller.config
    return 2 * (config.breaker.probe_backoff_max_s + 3 * 2 * (config.storage_timeout_s or 0.0))

pytestmark = pytest.mark.slow


def engine_config(tiers: CacheTiers = CacheTiers.L1_L2_L3, timeout_s: float = STORAGE_TIMEOUT_S,
                  breaker: BreakerConfig | None = None) -> EngineConfig:
    """The soak's tiny engine (:func:`hicache_core.soak.tiny_engine_config`), with L3 by default;
    ``breaker`` replaces the controller's store-health breaker config."""
    config = tiny_engine_config(tiers, timeout_s)
    if breaker is not None:
        config = replace(config, controller=replace(config.controller, breaker=breaker))
    return config


def serve(engine: Engine, conversations: list[list[list[int]]], tag: str,
          during: Callable[[], None] | None = None) -> list[RequestResult]:
    """The multi-turn workload (:func:`hicache_core.soak.serve_rounds`), ``NEW_TOKENS`` per request."""
    return serve_rounds(engine, conversations, tag, NEW_TOKENS, during)


@pytest.fixture(scope="module")
def baseline() -> dict[str, list[RequestResult]]:
    """HiCache off: what every cached run must reproduce bit for bit."""
    with Engine(engine_config(CacheTiers.OFF)) as engine:
        return {"warm": serve(engine, WARM, "off"), "workload": serve(engine, WORKLOAD, "off")}


def wrong_outputs(expected: list[RequestResult], got: list[RequestResult]) -> tuple[int, int]:
    """(token ids that differ, requests whose logits differ in any bit)."""
    assert len(expected) == len(got)
    tokens = logits = 0
    for want, have in zip(expected, got):
        tokens += sum(a != b for a, b in zip(want.output_ids, have.output_ids)) + abs(len(want.output_ids) - len(have.output_ids))
        assert want.logits is not None and have.logits is not None
        same = want.logits.shape == have.logits.shape and torch.equal(want.logits.view(torch.int32), have.logits.view(torch.int32))
        logits += not same
    return tokens, logits


@dataclass
class Figures:
    scenario: str
    connector: str
    wrong_tokens: int = 0
    wrong_logits: int = 0
    crashes: int = 0
    max_latency_s: float = 0.0
    recovery_s: float = 0.0
    recovery_passes: int = 0
    storage_errors: int = 0
    storage_timeouts: int = 0
    failed_batches: int = 0
    #: times the engine gave the store up during the fault (a permanent error)
    given_up: int = 0
    storage_hit_tokens_after: int = 0
    storage_timeout_s: float = STORAGE_TIMEOUT_S
    latency_bound_s: float = 0.0
    recovery_window_s: float = 0.0
    notes: str = ""

    def report(self) -> None:
        path = os.environ.get("HICACHE_FAULT_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(asdict(self)) + "\n")


def run_scenario(figures: Figures, storage: Level, baseline: dict[str, list[RequestResult]],
                 inject: Callable[[], None], clear: Callable[[], None],
                 notes: Callable[[], str] | None = None,
                 reopen: Callable[[], Level] | None = None, breaker: BreakerConfig | None = None) -> Engine:
    """The three phases (see the module docstring); ``notes`` adds details to the report;
    ``reopen`` (for permanent faults) gives the fixed store attached in place of the given-up one;
    ``breaker`` replaces the engine's breaker config. Returns the engine (closed), for its counters."""
    figures.storage_timeout_s = STORAGE_TIMEOUT_S_BY_CONNECTOR.get(figures.connector, STORAGE_TIMEOUT_S)
    figures.latency_bound_s = latency_bound(figures.storage_timeout_s)
    try:
        engine = Engine(engine_config(timeout_s=figures.storage_timeout_s, breaker=breaker), storage=storage)
    except BaseException:
        storage.close()
        raise
    try:
        _run_phases(figures, engine, baseline, inject, clear, reopen)
    except AssertionError:
        raise
    except Exception as exc:  # the engine raised: a crash, reported before the test fails on it
        figures.crashes += 1
        figures.notes = f"crashed: {type(exc).__name__}: {exc}"
        figures.report()
        raise
    if notes is not None:
        figures.notes = notes()
    figures.report()
    assert (figures.wrong_tokens, figures.wrong_logits) == (0, 0), f"{figures}"
    assert figures.max_latency_s < figures.latency_bound_s, (
        f"a request took {figures.max_latency_s:.1f}s (bound {figures.latency_bound_s:.0f}s): the timeout policy did not hold"
    )
    assert figures.storage_hit_tokens_after > 0, (
        f"L3 hits did not resume within {RECOVERY_PASSES} passes and {figures.recovery_window_s:.0f} s after the fault cleared"
    )
    if reopen is None:
        assert figures.given_up == 0, "a temporary fault made the engine give the store up"
    return engine


def _run_phases(figures: Figures, engine: Engine, baseline: dict[str, list[RequestResult]],
                inject: Callable[[], None], clear: Callable[[], None],
                reopen: Callable[[], Level] | None) -> None:
    with engine:
        warm = serve(engine, WARM, "warm")
        assert wrong_outputs(baseline["warm"], warm) == (0, 0), "healthy warm-up differs from recompute"
        engine.flush_cache()  # also waits for the warm-up's backups
        assert engine.metrics.snapshot()["storage_backup_pages"] > 0, "the warm-up must write to L3"
        before = engine.metrics.snapshot()
        injected: list[float] = []

        def maybe_inject() -> None:
            if not injected and engine.metrics.snapshot()["prefetch_issued"] > before["prefetch_issued"]:
                injected.append(time.monotonic())
                inject()

        faulted = serve(engine, WORKLOAD, "fault", maybe_inject)
        assert injected, "the fault was never injected: no prefetch was issued"
        figures.wrong_tokens, figures.wrong_logits = wrong_outputs(baseline["workload"], faulted)
        figures.max_latency_s = max(r.latency_s for r in faulted)
        assert engine.controller.threads_alive, "a controller thread died during the fault"
        figures.given_up = int(engine.metrics.snapshot()["storage_disabled"] - before["storage_disabled"])
        clear()
        if reopen is not None:
            given_up = engine.detach_storage()
            assert given_up is not None
            given_up.close()
            engine.attach_storage(reopen())
        cleared = time.monotonic()
        window = figures.recovery_window_s = recovery_window_s(engine)
        for attempt in itertools.count(1):
            if attempt > RECOVERY_PASSES and time.monotonic() - cleared > window:
                break
            engine.flush_cache()
            again = serve(engine, WORKLOAD, f"recover{attempt}")
            wrong = wrong_outputs(baseline["workload"], again)
            figures.wrong_tokens += wrong[0]
            figures.wrong_logits += wrong[1]
            figures.max_latency_s = max(figures.max_latency_s, *(r.latency_s for r in again))
            hits = sum(r.cached_storage for r in again)
            if hits > 0:
                figures.recovery_s = time.monotonic() - cleared
                figures.recovery_passes = attempt
                figures.storage_hit_tokens_after = hits
                break
        after = engine.metrics.snapshot()
        figures.storage_errors = int(after["storage_errors"] - before["storage_errors"])
        figures.storage_timeouts = int(after["storage_timeouts"] - before["storage_timeouts"])
        figures.failed_batches = int(after["storage_backup_failed_batches"] + after["prefetch_failed_batches"]
                                     - before["storage_backup_failed_batches"] - before["prefetch_failed_batches"])
        assert engine.controller.threads_alive, "a controller thread died after the fault"
        engine.tree.check_invariants()


# --- servers of our own, to kill and freeze ---------------------------------------------------


@pytest.fixture
def own_server(request, tmp_path) -> Iterator[tuple[Any, str, dict[str, Any]]]:
    """A fresh server of the parametrized kind (never a session fixture's), with a connector config."""
    kind = request.param
    if kind == "redis":
        from hicache_storage.testing.redis_server import RedisServer

        server = RedisServer()
        server.start()
        config = {"url": server.url, "prefix": "faults", "socket_timeout": 2.0, "connect_timeout": 1.0}
        name = "redis"
    elif kind == "s3":
        from hicache_storage.testing.seaweedfs import SeaweedFS

        server = SeaweedFS()
        server.start()
        config = {
            "bucket": server.bucket, "endpoint_url": server.endpoint_url, "region": server.region,
            "access_key_id": server.access_key, "secret_access_key": server.secret_key, "prefix": "faults/",
            "connect_timeout": 1.0, "read_timeout": 2.0, "max_attempts": 1,
        }
        name = "s3"
    else:
        from hicache_storage.testing.mooncake_master import MooncakeMaster

        server = MooncakeMaster()
        server.start()
        config = {**server.client_config(), "key_prefix": f"faults{uuid.uuid4().hex[:6]}/"}
        name = "mooncake"
    try:
        yield server, name, config
    finally:
        server.thaw()
        if kind == "s3":
            server.kill()  # throwaway data, and SeaweedFS takes longer to exit than stop() waits
        server.stop()


SERVERS = ["redis", "s3", "mooncake"]


@pytest.mark.services
@pytest.mark.parametrize("own_server", SERVERS, indirect=True)
def test_server_killed_mid_run_and_restarted(own_server, baseline):
    server, name, config = own_server
    figures = Figures("server SIGKILLed mid-run, restarted later", name)
    run_scenario(figures, create_backend(name, config), baseline, server.kill, server.restart)
    assert figures.storage_errors + figures.storage_timeouts > 0, "the dead server went uncounted"


@pytest.mark.services
@pytest.mark.parametrize("own_server", SERVERS, indirect=True)
def test_server_frozen_mid_run_then_thawed(own_server, baseline):
    server, name, config = own_server
    figures = Figures("server frozen (SIGSTOP) mid-run, then thawed", name)
    run_scenario(figures, create_backend(name, config), baseline, server.freeze, server.thaw)
    assert figures.storage_timeouts > 0, "calls into a frozen server must time out and be counted"


# --- the file connector: a full disk, corrupted files, a killed writer -------------------------


@pytest.fixture
def small_filesystem(tmp_path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for this test (needs root; a test that cannot mount fails, it does not skip)."""
    mount = tmp_path / "small-fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mount)], check=True, capture_output=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)


def test_disk_full_under_file_connector(small_filesystem, baseline):
    root = small_filesystem / "kv"
    filler = small_filesystem / "filler"
    storage = create_backend("file", {"root": str(root)})

    def fill() -> None:
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        chunk = b"\0" * 65536
        try:
            while True:
                os.write(fd, chunk)
        except OSError:
            pass  # ENOSPC: the disk is full now
        finally:
            os.close(fd)

    figures = Figures("disk full (tmpfs filled mid-run, then freed)", "file")
    run_scenario(figures, storage, baseline, fill, lambda: filler.unlink(),
                 lambda: f"{storage.event_counts()['puts_no_space']} page writes refused for lack of space")
    assert storage.event_counts()["puts_no_space"] > 0, "no write met the full disk"
    assert figures.failed_batches > 0, "backups refused by a full disk must count as failed batches"


def page_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and ".tmp" not in p.parts and p.name != "namespace.json")


def flip_middle_byte(data: bytearray) -> None:
    data[len(data) // 3] ^= 0x40  # an exponent bit of some float: a large, visible change


def corrupt_files(root: Path) -> int:
    """Flip one byte in every other page file, keeping its length (the length check cannot see it)."""
    files = page_files(root)[::2]
    for path in files:
        data = bytearray(path.read_bytes())
        flip_middle_byte(data)
        with open(path, "r+b") as f:
            f.write(data)
    return len(files)


def test_corrupted_files_with_integrity_are_misses(tmp_path, baseline):
    root = tmp_path / "kv"
    integrity = IntegrityLayer(create_backend("file", {"root": str(root)}))
    corrupted: list[int] = []
    figures = Figures("stored bytes corrupted behind the SDK (integrity on)", "file")
    run_scenario(figures, integrity, baseline, lambda: corrupted.append(corrupt_files(root)), lambda: None,
                 lambda: corruption_notes(corrupted, integrity))
    assert corrupted[0] > 0
    assert integrity_misses(integrity) > 0, "corrupted pages were read but integrity saw nothing"


def integrity_misses(integrity: IntegrityLayer) -> int:
    return sum(v for k, v in integrity.event_counts().items() if k.startswith("integrity_miss"))


def corruption_notes(corrupted: list[int], integrity: IntegrityLayer) -> str:
    return f"{corrupted[0]} stored pages corrupted; {integrity_misses(integrity)} integrity misses"


def test_corrupted_files_without_integrity_are_served(tmp_path, baseline):
    """Why docs/reliability.md recommends integrity: a same-length corruption passes the file
    connector's length check, and its bytes are served as KV: outputs change."""
    root = tmp_path / "kv"
    with Engine(engine_config(), storage=create_backend("file", {"root": str(root)})) as engine:
        serve(engine, WARM, "warm")
        engine.flush_cache()
        assert corrupt_files(root) > 0
        got = serve(engine, WARM, "corrupt")
        assert sum(r.cached_storage for r in got) > 0
    wrong_tokens, wrong_logits = wrong_outputs(baseline["warm"], got)
    Figures("stored bytes corrupted behind the SDK (no integrity)", "file", wrong_tokens, wrong_logits,
            notes="expected: corruption served as KV").report()
    assert wrong_logits > 0, "corrupted KV was read from L3 yet every logit matched: the corruption was not exercised"


def _raw_redis(url: str):  # type: ignore[no-untyped-def]
    import redis

    return redis.Redis.from_url(url)


@pytest.mark.services
def test_corrupted_redis_values_with_integrity_are_misses(request, tmp_path, baseline):
    name, config = connector_config(request, "redis", tmp_path)
    integrity = IntegrityLayer(create_backend(name, config))
    client = _raw_redis(config["url"])
    corrupted: list[int] = []

    def corrupt() -> None:
        keys = sorted(client.scan_iter(match=f"{config['prefix']}*", count=1000))[::2]
        for key in keys:
            value = bytearray(client.get(key))
            flip_middle_byte(value)
            client.set(key, bytes(value))
        corrupted.append(len(keys))

    figures = Figures("stored bytes corrupted behind the SDK (integrity on)", "redis")
    run_scenario(figures, integrity, baseline, corrupt, lambda: None, lambda: corruption_notes(corrupted, integrity))
    client.close()
    assert corrupted[0] > 0
    assert integrity_misses(integrity) > 0


@pytest.mark.services
def test_corrupted_s3_objects_with_integrity_are_misses(request, tmp_path, baseline):
    name, config = connector_config(request, "s3", tmp_path)
    integrity = IntegrityLayer(create_backend(name, config))
    client = request.getfixturevalue("seaweedfs").client()
    corrupted: list[int] = []

    def corrupt() -> None:
        listed = client.list_objects_v2(Bucket=config["bucket"], Prefix=config["prefix"])
        keys = sorted(o["Key"] for o in listed.get("Contents", []) if not o["Key"].endswith(".json"))[::2]
        for key in keys:
            value = bytearray(client.get_object(Bucket=config["bucket"], Key=key)["Body"].read())
            flip_middle_byte(value)
            client.put_object(Bucket=config["bucket"], Key=key, Body=bytes(value))
        corrupted.append(len(keys))

    figures = Figures("stored bytes corrupted behind the SDK (integrity on)", "s3")
    run_scenario(figures, integrity, baseline, corrupt, lambda: None, lambda: corruption_notes(corrupted, integrity))
    assert corrupted[0] > 0
    assert integrity_misses(integrity) > 0


class RecordPuts(Layer):
    """Remembers the keys stored through it, for a test to find them in a store it cannot list."""

    kind = "record-puts"

    def __init__(self, inner: Level) -> None:
        super().__init__(inner)
        self.stored: list[PageKey] = []

    def _put_from(self, keys: list[PageKey], sources):  # type: ignore[no-untyped-def]
        results = super()._put_from(keys, sources)
        self.stored += [key for key, ok in zip(keys, results) if ok]
        return results


@pytest.mark.services
def test_corrupted_mooncake_objects_with_integrity_are_misses(request, tmp_path, baseline):
    """Mooncake cannot list its keys: they are recorded on the way in, then each is read, flipped
    and upserted through the connector's own MooncakeDistributedStore client, behind the SDK."""
    name, config = connector_config(request, "mooncake", tmp_path)
    connector = create_backend(name, config)
    recorder = RecordPuts(connector)
    integrity = IntegrityLayer(recorder)
    corrupted: list[int] = []

    def corrupt() -> None:
        raw = connector._store  # the raw client, bypassing every SDK layer
        names = sorted({connector._object_key(key) for key in recorder.stored})[::2]
        for object_name in names:
            value = bytearray(raw.get(object_name))
            flip_middle_byte(value)
            assert raw.upsert(object_name, bytes(value)) == 0
        corrupted.append(len(names))

    figures = Figures("stored bytes corrupted behind the SDK (integrity on)", "mooncake")
    run_scenario(figures, integrity, baseline, corrupt, lambda: None, lambda: corruption_notes(corrupted, integrity))
    assert corrupted[0] > 0
    assert integrity_misses(integrity) > 0


WRITER = textwrap.dedent(
    """
    import sys
    from hicache_storage import KeyScope, Namespace, Store, create_backend
    root, size = sys.argv[1], int(sys.argv[2])
    scope = KeyScope(Namespace("torn", "float32", 64, "page_first"))
    store = Store(create_backend("file", {"root": root}))
    pages = [bytes([n]) * size for n in (0xA1, 0xB2)]
    n = 0
    print("ready", flush=True)
    while True:
        store.put([scope.key(f"{k:064x}") for k in range(4)], [pages[n % 2]] * 4)
        n += 1
    """
)


def test_writer_killed_mid_page_never_serves_a_torn_page(tmp_path):
    """A process rewriting 8 MiB pages through the file connector is SIGKILLed at random moments
    while it writes a page (a temp file exists: killing at any moment instead landed inside a
    write one time in four, so that none of 8 did about one run in ten); every read afterwards is
    a miss or one whole page, and the killed writer's temp file goes."""
    root = tmp_path / "kv"
    size = 8 * 2**20
    scope = KeyScope(Namespace("torn", "float32", 64, "page_first"))
    keys = [scope.key(f"{k:064x}") for k in range(4)]
    whole = {bytes([0xA1]) * size, bytes([0xB2]) * size}
    kills = mid_page = torn = 0
    gen = torch.Generator().manual_seed(3)
    for _ in range(8):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(size)], stdout=subprocess.PIPE)
        try:
            assert writer.stdout is not None and writer.stdout.readline().strip() == b"ready"
            time.sleep(0.05 + 0.3 * float(torch.rand(1, generator=gen)))
            writing = time.monotonic() + 30.0
            while not any((root / ".tmp").iterdir()) and time.monotonic() < writing:
                pass  # no sleep: a page write takes a few milliseconds
        finally:
            writer.kill()
            writer.wait()
        kills += 1
        mid_page += any((root / ".tmp").iterdir())  # a temp file left behind: it died inside a page write
        with Store(create_backend("file", {"root": str(root)})) as store:  # starting cleans the dead writer's temp files
            assert not any((root / ".tmp").iterdir()), "a new backend must remove a killed writer's temp files"
            for value in store.get(keys, size):
                torn += value is not None and value not in whole
    Figures("writer SIGKILLed in the middle of a page", "file", notes=f"{kills} kills, {mid_page} inside a page write, {torn} torn pages served").report()
    assert torn == 0, f"{torn} torn pages were served"
    assert mid_page > 0, "no kill landed inside a page write: the scenario was not exercised"


#: What the writer engine's process needs to import this module: its folder, and the helpers it imports.
IMPORT_PATH = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "helpers")]

ENGINE_WRITER = textwrap.dedent(
    """
    import sys
    sys.path[:0] = sys.argv[2:]
    from test_fault_matrix import Engine, engine_config, serve, WORKLOAD
    from hicache_storage import create_backend
    with Engine(engine_config(), storage=create_backend("file", {"root": sys.argv[1]})) as engine:
        while True:
            serve(engine, WORKLOAD, "child")
            engine.flush_cache()
    """
)


def test_engine_killed_while_writing_then_served_from_its_pages(tmp_path, baseline):
    """An engine process is SIGKILLed while it backs pages up; a new engine on the same root serves
    bit-identical outputs and reads the pages the dead one published."""
    root = tmp_path / "kv"
    child = subprocess.Popen([sys.executable, "-c", ENGINE_WRITER, str(root), *IMPORT_PATH])
    try:
        deadline = time.monotonic() + 120
        while (len(page_files(root)) if root.exists() else 0) < 20:
            assert child.poll() is None, "the writer engine exited"
            assert time.monotonic() < deadline, "the writer engine published no pages"
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    figures = Figures("engine process SIGKILLed while writing; a new engine reads its pages", "file")
    started = time.monotonic()
    with Engine(engine_config(), storage=create_backend("file", {"root": str(root)})) as engine:
        got = serve(engine, WORKLOAD, "after-kill")
        figures.wrong_tokens, figures.wrong_logits = wrong_outputs(baseline["workload"], got)
        figures.max_latency_s = max(r.latency_s for r in got)
        figures.storage_hit_tokens_after = sum(r.cached_storage for r in got)
        figures.recovery_s = time.monotonic() - started
        assert engine.controller.threads_alive
    figures.report()
    assert (figures.wrong_tokens, figures.wrong_logits) == (0, 0)
    assert figures.storage_hit_tokens_after > 0, "the dead engine's published pages were not used"


# --- faults the store cannot be made to show on demand: the fault layer over the real store --


def paused_faults(storage: Level, faults: dict[str, Any]) -> FaultInjectionLayer:
    """The fault layer over ``storage``, paused: the scenario's inject resumes it, clear pauses it."""
    return FaultInjectionLayer(storage, {"seed": 1, "enabled": False, **faults})


@pytest.mark.services
@pytest.mark.parametrize("label", ["file", "redis", "s3", "mooncake"])
def test_page_deleted_between_exists_and_get(request, tmp_path, baseline, label, monkeypatch):
    """Half the pages ``exists`` reports are deleted (through the real store) right after it, so
    the reads that follow find them gone: a page evicted between exists and get. The engine
    remembers only the last page it wrote (as if another engine had written the rest), so it
    looks up the pages it reads rather than only those past what it knows stored."""
    monkeypatch.setattr(prefetch, "STORED_PAGES_REMEMBERED", 1)
    name, config = connector_config(request, label, tmp_path)
    store = paused_faults(create_backend(name, config), {"exists": {"vanish_rate": 0.5}})
    figures = Figures("page deleted between exists and get", label)
    run_scenario(figures, store, baseline, store.resume, store.pause,
                 lambda: f"{store.event_counts()['faults_vanish']} pages deleted after exists")
    assert store.event_counts()["faults_vanish"] > 0, "no page was deleted under a reader"
    assert figures.failed_batches > 0, "reads that found pages gone must count as failed batches"


@pytest.mark.services
def test_backend_returning_wrong_result_counts(request, tmp_path, baseline, caplog):
    """A contract violation is permanent: the engine gives the store up at the first one (one per
    thread at most), says so in one error line, and uses the store again once re-attached."""
    name, config = connector_config(request, "redis", tmp_path)
    miscount = paused_faults(create_backend(name, config), {
        "exists": {"wrong_count_rate": 1.0},
        "get": {"wrong_count_rate": 1.0},
        "put": {"wrong_count_rate": 1.0},
    })
    figures = Figures("backend returns the wrong number of results", "redis")
    with caplog.at_level(logging.ERROR, logger="hicache_core"):
        run_scenario(figures, miscount, baseline, miscount.resume, miscount.pause,
                     lambda: f"{miscount.event_counts()['faults_wrong_count']} calls answered with a wrong count; store given up",
                     reopen=lambda: create_backend(name, config))
    assert 1 <= miscount.event_counts()["faults_wrong_count"] <= 2, "calls went on after the first contract violation"
    assert figures.given_up == 1 and figures.storage_errors > 0
    [line] = [r.getMessage() for r in caplog.records if "disabled" in r.getMessage()]
    assert "BackendContractError" in line


class RoundRobin(Layer):
    """Sends call n (of any operation) to ``targets[n % len(targets)]``: every target gets its turn."""

    kind = "round-robin"

    def __init__(self, inner: Level, targets: list[Level]) -> None:
        super().__init__(inner)
        self.targets = targets
        self._next = itertools.count()

    def _target(self) -> Level:
        return self.targets[next(self._next) % len(self.targets)]

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        return self._target().hook_exists(keys)

    def _get_into(self, keys, targets):  # type: ignore[no-untyped-def]
        return self._target().hook_get_into(keys, targets)

    def _put_from(self, keys, sources):  # type: ignore[no-untyped-def]
        return self._target().hook_put_from(keys, sources)


def kept_through(kind: str) -> bool:
    """Whether the engine keeps calling a store that raises this fault kind (temporary, or no StorageError)."""
    error = ERROR_KINDS[kind]
    return not issubclass(error, StorageError) or error.default_status is ErrorStatus.TEMPORARY


TEMPORARY_KINDS = [kind for kind in ERROR_KINDS if kept_through(kind)]
PERMANENT_KINDS = [kind for kind in ERROR_KINDS if not kept_through(kind)]


def test_every_error_kind(tmp_path, baseline):
    """While the fault is on, storage calls take turns raising each error kind the engine keeps a
    store through (every temporary StorageError kind, and a RuntimeError for a connector bug).
    The breaker is kept shut (it would stop the calls after three failures, and how many kinds got
    their turn would then depend on timing): what each kind does to the breaker is
    tests/core/test_core_store_health.py's."""
    inner = create_backend("file", {"root": str(tmp_path / "kv")})
    erring = {
        kind: paused_faults(inner, {"seed": 2, **{op: {"error_rate": 1.0, "errors": [kind]} for op in ("exists", "get", "put")}})
        for kind in TEMPORARY_KINDS
    }

    def inject() -> None:
        for layer in erring.values():
            layer.resume()

    def clear() -> None:
        for layer in erring.values():
            layer.pause()

    store = RoundRobin(inner, list(erring.values()))
    figures = Figures("every error kind raised, in turn, by every call", "file")
    raised = lambda: [kind for kind, w in erring.items() if w.event_counts()["faults_error"] > 0]  # noqa: E731
    run_scenario(figures, store, baseline, inject, clear,
                 lambda: f"{sum(w.event_counts()['faults_error'] for w in erring.values())} calls raised; kinds: {len(raised())} of {len(erring)}",
                 breaker=BreakerConfig(failures_to_open=1_000_000))
    assert raised() == TEMPORARY_KINDS, f"not every error kind was raised: {raised()}"
    assert figures.storage_errors > 0 and figures.storage_timeouts > 0, "errors and timeouts must both be counted"


@pytest.mark.parametrize("kind", PERMANENT_KINDS)
def test_a_permanent_error_kind_gives_the_store_up_until_reattached(tmp_path, baseline, kind):
    """Each permanent kind: the engine stops calling the store after its first one (one per thread
    at most), serves on as without L3, and serves hits again from the store re-attached."""
    config = {"root": str(tmp_path / "kv")}
    erring = paused_faults(create_backend("file", config),
                           {"seed": 2, **{op: {"error_rate": 1.0, "errors": [kind]} for op in ("exists", "get", "put")}})
    figures = Figures(f"permanent error kind {kind!r} on every call", "file")
    run_scenario(figures, erring, baseline, erring.resume, erring.pause,
                 lambda: f"{erring.event_counts()['faults_error']} calls raised; store given up",
                 reopen=lambda: create_backend("file", config))
    assert 1 <= erring.event_counts()["faults_error"] <= 2, "calls went on after the first permanent error"
    assert figures.given_up == 1
