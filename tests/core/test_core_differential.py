"""The differential test: outputs (token ids and logits) are bit-identical whatever tier the KV came from.

A multi-turn workload on a device pool and a host pool too small for its history (so pages are
evicted from L1 and L2 and really come back from L3) is served with HiCache off, then with L1,
L1+L2 and L1+L2+L3, for every host layout, write policy and stop policy, on the memory and file
connectors; then again after flushing L1 and L2, from a second engine sharing the same L3, and
after restarting the engine on a persistent L3. Counters prove where the KV came from.
"""

from __future__ import annotations

import itertools
import uuid

import pytest
import torch

from hicache_core.controller import ControllerConfig, WritePolicy
from hicache_core.prefetch import PrefetchConfig, StopPolicy
from hicache_core.engine import CacheTiers, Engine, EngineConfig, Request, RequestResult, make_conversations, serve_conversations
from hicache_core.model import ModelConfig, ModeledCompute
from hicache_storage.keys import page_hashes

from pinned_cost import LOAD_AND_STORE_EVERY_PAGE

MHA = ModelConfig(vocab_size=256, hidden=32, layers=2, q_heads=4, kv_heads=2, head_dim=8, ffn=64, seed=11)
MLA = ModelConfig(vocab_size=256, hidden=32, layers=2, q_heads=4, head_dim=8, ffn=64, mla=True, latent_dim=16, seed=12)
CONVERSATIONS = make_conversations(clients=3, rounds=3, turn_tokens=24, vocab_size=256, seed=5)
NEW_TOKENS = 3
LAYOUTS = ("page_first", "layer_first", "page_first_direct")


def config(model: ModelConfig, tiers: CacheTiers, layout: str = "page_first", write: WritePolicy = WritePolicy.WRITE_THROUGH,
           stop: StopPolicy = StopPolicy.WAIT_COMPLETE, backend: str | None = None, storage_config: dict | None = None,
           **overrides: object) -> EngineConfig:
    # A generous timeout: the "timeout" policy must not expire on a loaded CI machine (expiry has its own test).
    prefetch = PrefetchConfig(threshold_tokens=8, stop_policy=stop, timeout_base_s=60.0)
    # The tests count the tokens L3 served: every page is written and read, whatever the speeds.
    controller = ControllerConfig(write_policy=write, prefetch=prefetch, cost=LOAD_AND_STORE_EVERY_PAGE)
    base = dict(
        model=model, tiers=tiers, page_size=4, device_pages=36, host_pages=48, host_ratio=None, layout=layout,
        controller=controller, storage_backend=backend, storage_config=storage_config, max_running=2,
    )
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


def assert_identical(expected: list[RequestResult], got: list[RequestResult]) -> None:
    assert len(expected) == len(got)
    for want, have in zip(expected, got):
        assert have.output_ids == want.output_ids, f"{have.rid}: token ids differ"
        assert have.logits is not None and want.logits is not None
        # Compare the bits, not the values: -0.0 vs 0.0 or a NaN payload would count as a difference.
        assert torch.equal(have.logits.view(torch.int32), want.logits.view(torch.int32)), f"{have.rid}: logits differ"


def last_round_requests(rounds: list[list[RequestResult]]) -> list[Request]:
    """The final round's prompts, rebuilt from the conversation history, to serve again."""
    histories: list[list[int]] = [[] for _ in CONVERSATIONS]
    requests = []
    for r, results in enumerate(rounds):
        for c, result in enumerate(results):
            prompt = histories[c] + CONVERSATIONS[c][r]
            histories[c] = prompt + result.output_ids
            if r == len(rounds) - 1:
                requests.append(Request(f"again-{c}", prompt, NEW_TOKENS))
    return requests


@pytest.fixture(scope="module")
def baseline() -> dict[str, list[list[RequestResult]]]:
    out = {}
    for name, model in (("mha", MHA), ("mla", MLA)):
        with Engine(config(model, CacheTiers.OFF)) as engine:
            out[name] = serve_conversations(engine, CONVERSATIONS, NEW_TOKENS)
    return out


def check_rounds(expected: list[list[RequestResult]], got: list[list[RequestResult]]) -> None:
    for want, have in zip(expected, got):
        assert_identical(want, have)


@pytest.mark.parametrize("tiers", [CacheTiers.L1, CacheTiers.L1_L2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_l1_and_l2_match_recompute(baseline, tiers, layout):
    with Engine(config(MHA, tiers, layout)) as engine:
        rounds = serve_conversations(engine, CONVERSATIONS, NEW_TOKENS)
        snapshot = engine.metrics.snapshot()
        engine.tree.check_invariants()
    check_rounds(baseline["mha"], rounds)
    assert snapshot["device_evicted_tokens"] > 0, "the workload must overflow L1"
    assert snapshot["device_hit_tokens"] > 0
    if tiers is CacheTiers.L1_L2:
        assert snapshot["host_hit_tokens"] > 0 and snapshot["load_back_tokens"] > 0


def run_l3_scenario(baseline_rounds, model: ModelConfig, layout: str, write: WritePolicy, stop: StopPolicy,
                    backend: str, storage_config: dict, *, restart: bool) -> None:
    cfg = config(model, CacheTiers.L1_L2_L3, layout, write, stop, backend, storage_config)
    expected_again = [
        RequestResult(f"again-{c}", 0, r.output_ids, r.logits) for c, r in enumerate(baseline_rounds[-1])
    ]
    again = last_round_requests(baseline_rounds)
    with Engine(cfg) as engine:
        rounds = serve_conversations(engine, CONVERSATIONS, NEW_TOKENS)
        check_rounds(baseline_rounds, rounds)
        engine.drain()
        snapshot = engine.metrics.snapshot()
        assert snapshot["device_evicted_tokens"] > 0
        assert snapshot["storage_backup_pages"] > 0, "the run must write to L3"
        # Flush L1 and L2: everything must come back from L3.
        engine.flush_cache()
        assert engine.tree.token_counts() == {"device": 0, "host": 0, "nodes": 0}
        assert engine.device_pool.allocator.free_pages == engine.device_pool.num_pages, "device pages leaked"
        assert engine.host_pool.allocator.free_pages == engine.host_pool.num_pages, "host pages leaked"
        flushed = engine.serve(again)
        assert_identical(expected_again, flushed)
        engine.tree.check_invariants()
        if stop is not StopPolicy.BEST_EFFORT:  # best effort may legitimately take nothing
            assert sum(r.cached_storage for r in flushed) > 0, "nothing was restored from L3"
            assert engine.metrics.snapshot()["prefetch_pages"] > 0
        # A second engine sharing the same L3.
        with Engine(cfg) as second:
            shared = second.serve(again)
        assert_identical(expected_again, shared)
        if stop is not StopPolicy.BEST_EFFORT:
            assert sum(r.cached_storage for r in shared) > 0
    if restart:
        with Engine(cfg) as restarted:
            after = restarted.serve(again)
        assert_identical(expected_again, after)
        if stop is not StopPolicy.BEST_EFFORT:
            assert sum(r.cached_storage for r in after) > 0


@pytest.mark.parametrize(
    "layout,write,stop",
    list(itertools.product(LAYOUTS, list(WritePolicy), list(StopPolicy))),
    ids=lambda v: v.value if hasattr(v, "value") else v,
)
def test_l3_memory_connector(baseline, layout, write, stop):
    store = {"store": f"differential-{uuid.uuid4().hex}"}
    run_l3_scenario(baseline["mha"], MHA, layout, write, stop, "memory", store, restart=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,write,stop",
    list(itertools.product(LAYOUTS, list(WritePolicy), list(StopPolicy))),
    ids=lambda v: v.value if hasattr(v, "value") else v,
)
def test_l3_file_connector_with_restart(baseline, tmp_path, layout, write, stop):
    run_l3_scenario(baseline["mha"], MHA, layout, write, stop, "file", {"root": str(tmp_path)}, restart=True)


def test_modeled_compute_moves_real_kv_through_every_tier(tmp_path):
    """Modeled compute: no forward pass, but pages really go to L3 and come back after a flush."""
    model = ModelConfig(vocab_size=1000, layers=4, q_heads=8, kv_heads=2, head_dim=32, dtype=torch.bfloat16)
    cfg = config(model, CacheTiers.L1_L2_L3, backend="file", storage_config={"root": str(tmp_path)},
                 compute=ModeledCompute(prefill_tokens_per_s=1e7, decode_step_s=1e-5))
    again = [Request(f"m{c}", turns[0] + turns[1], NEW_TOKENS) for c, turns in enumerate(CONVERSATIONS)]
    with Engine(cfg) as engine:
        first = engine.serve(again)
        assert all(r.logits is None and len(r.output_ids) == NEW_TOKENS for r in first)
        engine.flush_cache()
        second = engine.serve(again)
        assert [r.output_ids for r in second] == [r.output_ids for r in first]
        assert all(r.cached_storage > 0 and r.ttft_s > 0 for r in second)
        snapshot = engine.metrics.snapshot()
        assert snapshot["storage_backup_bytes"] > 0 and snapshot["prefetch_bytes"] > 0 and snapshot["load_back_bytes"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_all_tiers(baseline, tmp_path, layout):
    with Engine(config(MLA, CacheTiers.L1_L2, layout)) as engine:
        check_rounds(baseline["mla"], serve_conversations(engine, CONVERSATIONS, NEW_TOKENS))
    run_l3_scenario(baseline["mla"], MLA, layout, WritePolicy.WRITE_THROUGH, StopPolicy.WAIT_COMPLETE, "file",
                    {"root": str(tmp_path)}, restart=True)


@pytest.mark.parametrize("write", list(WritePolicy), ids=lambda w: w.value)
def test_buffer_only_mode(baseline, write):
    store = {"store": f"buffer-only-{uuid.uuid4().hex}"}
    cfg = config(MHA, CacheTiers.L1_L2_L3, write=write, backend="memory", storage_config=store, host_pages=24)
    cfg.controller = ControllerConfig(
        write_policy=write, buffer_only=True, prefetch=PrefetchConfig(threshold_tokens=8, stop_policy=StopPolicy.WAIT_COMPLETE),
        cost=LOAD_AND_STORE_EVERY_PAGE,
    )
    again = last_round_requests(baseline["mha"])
    with Engine(cfg) as engine:
        check_rounds(baseline["mha"], serve_conversations(engine, CONVERSATIONS, NEW_TOKENS))
        engine.flush_cache()
        flushed = engine.serve(again)
        assert_identical([RequestResult(r.rid, 0, b.output_ids, b.logits) for r, b in zip(again, baseline["mha"][-1])], flushed)
        engine.controller.drain()
        snapshot = engine.metrics.snapshot()
        assert snapshot["host_hit_tokens"] == 0, "buffer-only mode serves no L2 hits"
        assert sum(r.cached_storage for r in flushed) > 0, "the flushed history must come back from L3"
        assert engine.tree.token_counts()["host"] == 0, "staging pages are freed once their I/O is done"


def test_a_node_split_while_its_host_copy_is_in_flight_is_stored_whole(tmp_path):
    """The next request matches half of the first's node and splits it before the first's
    device -> host copy is acknowledged (acks come at the next step): every page of the first's
    prefix still reaches L3, the upper half included (it used to be left out)."""
    cfg = config(MHA, CacheTiers.L1_L2_L3, backend="file", storage_config={"root": str(tmp_path)})
    first = CONVERSATIONS[0][0] + CONVERSATIONS[0][1]
    with Engine(cfg) as engine:
        engine.serve([Request("first", first, NEW_TOKENS)])
        engine.serve([Request("half", first[:24] + CONVERSATIONS[1][0], NEW_TOKENS)])
        engine.drain()
        store = engine.controller.store
        assert store is not None
        hashes = page_hashes(first, 4)
        assert store.store.prefix_exists(store.keys("kv", hashes)) == len(hashes)


class _FakeClock:
    """perf_counter and sleep on a clock that only sleeps move."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, 0

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1


class _FakeLoad:
    """A layer-wise load whose layer ``i`` lands at ``landed[i]`` on the fake clock (``failed``: its wait raises)."""

    def __init__(self, clock: _FakeClock, landed: list[float], failed: bool = False) -> None:
        self.clock, self.times, self.failed, self.waited = clock, landed, failed, []
        self.layers = len(landed)

    def ready(self, layer: int) -> bool:
        return self.times[layer] <= self.clock.now

    def wait(self, layer: int) -> None:
        self.waited.append(layer)
        self.clock.now = max(self.clock.now, self.times[layer])
        if self.failed:
            raise RuntimeError(f"loading layer {layer} from the host pool failed")

    def landed_at(self, layer: int) -> float:
        return self.times[layer]

    def landed(self) -> bool:
        return self.ready(self.layers - 1)


def _fake_clock(monkeypatch: pytest.MonkeyPatch) -> _FakeClock:
    import hicache_core.model as model

    clock = _FakeClock()
    monkeypatch.setattr(model.time, "perf_counter", lambda: clock.now)
    monkeypatch.setattr(model.time, "sleep", clock.sleep)
    return clock


@pytest.mark.parametrize("landed", [[0.0] * 6, [0.0, 0.0, 5.0, 5.0, 5.0, 9.5], [3.0] * 6, [0.0] * 5 + [100.0]], ids=str)
def test_a_modeled_prefill_is_queued_layer_by_layer_each_layer_after_its_load_and_the_scheduler_waits_for_neither(monkeypatch, landed):
    """Layer i computes from max(layer i-1 done, layer i landed); the scheduler does not wait for
    the compute or the loads: the prefill's end is known once every layer has landed (meanwhile
    ``free_at`` counts the layers still in flight as landing now); the next prefill queues after
    it; waiting for every result (``wait``) waits for the loads, then the compute."""
    clock = _fake_clock(monkeypatch)
    gpu = ModeledCompute(prefill_tokens_per_s=1.0, decode_step_s=0.0).gpu()
    load = _FakeLoad(clock, landed)
    prefill = gpu.prefill(12, 6, load)  # 2 s per layer
    expected = estimate = 0.0
    for layer in range(6):
        expected = max(expected, landed[layer]) + 2.0
        estimate = max(estimate, min(landed[layer], 0.0)) + 2.0  # (not landed yet: as if now, at 0)
    assert clock.now == 0.0 and clock.sleeps == 0, "queued, not waited for"
    assert (prefill.end is None) == (max(landed) > 0.0)
    assert gpu.free_at == pytest.approx(estimate)
    second = gpu.prefill(12, 6, None)
    assert gpu.free_at == pytest.approx(estimate + 12.0), "queued after the first"
    assert gpu.end_of(prefill) == pytest.approx(expected) and clock.now == max(landed), "waited for the loads only"
    assert gpu.end_of(second) == pytest.approx(expected + 12.0)
    gpu.wait()
    assert clock.now == pytest.approx(expected + 12.0) and gpu.queued_for() == 0.0


def test_a_decode_step_queued_after_a_prefill_whose_loads_are_in_flight_is_pending_until_they_land(monkeypatch):
    """The step's inputs include the prefill's first token: the scheduler learns when the step
    ends only once the loads the prefill reads have landed (meanwhile it is pending, estimated
    as if they landed now), and then at its exact time."""
    clock = _fake_clock(monkeypatch)
    gpu = ModeledCompute(prefill_tokens_per_s=1.0, decode_step_s=3.0).gpu()
    load = _FakeLoad(clock, [10.0, 10.0])
    gpu.prefill(2, 2, load)  # 1 s a layer, after its layers land at 10: ends at 12
    gpu.decode_step(started=0.0)  # 12 -> 15
    assert gpu.step_pending() == pytest.approx(5.0), "as if the loads landed now: 0 + 2 + 3"
    clock.now = 14.0
    assert gpu.step_pending() == pytest.approx(1.0), "landed at 10: the step ends at 15"
    clock.now = 15.0
    assert gpu.step_pending() == 0.0


def test_a_prefill_whose_load_failed_raises_where_the_scheduler_next_asks_for_the_step(monkeypatch):
    clock = _fake_clock(monkeypatch)
    gpu = ModeledCompute(prefill_tokens_per_s=1.0, decode_step_s=0.0).gpu()
    gpu.prefill(2, 2, _FakeLoad(clock, [5.0, 5.0], failed=True))
    gpu.decode_step(started=0.0)
    assert gpu.step_pending() > 0.0, "in flight"
    clock.now = 5.0
    with pytest.raises(RuntimeError, match="host pool failed"):
        gpu.step_pending()


def test_a_modeled_decode_step_is_queued_after_the_work_before_it_and_awaited_before_the_next(monkeypatch):
    """The scheduler's work for a step (admitting, bookkeeping, finishing requests) overlaps the
    GPU: a step starts when both it began and the queued work ended, and the scheduler learns
    when it ends (the next step reads its tokens) instead of sleeping through it."""
    clock = _fake_clock(monkeypatch)
    gpu = ModeledCompute(prefill_tokens_per_s=1.0, decode_step_s=3.0).gpu()
    clock.now = 10.0
    gpu.decode_step(started=9.0)  # its bookkeeping began a second ago
    assert (gpu.free_at, clock.now, clock.sleeps) == (pytest.approx(12.0), 10.0, 0), "not waited for yet"
    gpu.prefill(2, 1, None)  # a request admitted meanwhile: queued after the step, 12 -> 14
    assert gpu.step_pending() == pytest.approx(2.0), "the step ends at 12, the prefill after it"
    clock.now = 12.0
    assert gpu.step_pending() == 0.0
    gpu.decode_step(started=12.0)  # after the prefill: 14 -> 17
    assert gpu.step_pending() == pytest.approx(5.0)
    clock.now = 17.0
    gpu.decode_step(started=20.0)  # the scheduler was late: the step starts when it began
    gpu.wait()
    assert clock.now == pytest.approx(23.0)


def test_the_scheduler_goes_on_while_a_requests_copy_to_the_device_is_in_flight():
    """Under modeled compute a request's prefill waits for its copy on the modeled GPU, not on
    the scheduler: while one request's copy from host memory is held up, the next request is
    matched and started (its prefill queued behind). The host pages the copy reads stay
    protected until it has landed; the first token of the request comes after that."""
    import threading
    import time

    cfg = config(MHA, CacheTiers.L1_L2, compute=ModeledCompute(prefill_tokens_per_s=1e6, decode_step_s=1e-4))
    first, other = CONVERSATIONS[0][0], CONVERSATIONS[1][0]
    again = first + CONVERSATIONS[0][1]
    with Engine(cfg) as engine:
        engine.serve([Request("first", first, NEW_TOKENS)])
        engine.drain()
        engine.tree.evict_device(1 << 62, None)  # its pages are on the host only now
        transfers = engine.controller.transfers
        assert transfers is not None
        gate, original = threading.Event(), transfers._load_layer

        def held_up(layer, device_indices, host_indices):
            gate.wait(timeout=20)
            original(layer, device_indices, host_indices)

        transfers._load_layer = held_up
        try:
            started, submitted = time.monotonic(), time.perf_counter()
            before = engine.metrics.snapshot()["prompt_tokens"]
            engine.submit(Request("again", again, NEW_TOKENS))
            engine.submit(Request("other", other, NEW_TOKENS))
            while engine.metrics.snapshot()["prompt_tokens"] - before < len(again) + len(other) and time.monotonic() - started < 15:
                engine.step()
            assert engine.metrics.snapshot()["prompt_tokens"] - before == len(again) + len(other), "both started"
            assert not gate.is_set() and time.monotonic() - started < 15, "while the copy was held up"
            assert engine.metrics.snapshot()["host_hit_tokens"] > 0 and engine.controller.io_pending, "its host pages still protected"
            opened = time.perf_counter()
            gate.set()
            while engine.has_work():
                engine.step()
            results = {r.rid: r for r in engine.take_results()}
        finally:
            gate.set()
            transfers._load_layer = original
        assert results["again"].cached_host > 0
        assert submitted + results["again"].ttft_s >= opened, "its first token came after the copy landed"
        engine.drain()
        assert not engine.controller.io_pending, "released once landed"
