"""How the engine keeps L3 reads, loads and compute overlapping (issue 16's efficiency work).

* A request whose pages the store lacks learns it at once: the store is asked on its own thread,
  so the answer does not wait behind another request's reads.
* Requests that cannot start yet (the head of the queue is short of memory, or ``max_running``
  run) still take their completed prefetches into the tree, so the host capacity those held goes
  to the reads still planned.
* A running request's host copies may be evicted once its KV is on the device (the host pages go
  to prefetches), never while a load or a device -> host copy uses them.
* The head of the queue that failed to get memory is not tried again until something was given
  back (a failed start costs the scheduler a match and two evictions).
* A node whose pages already reached L3 is not copied to the host again when a request extending
  it finishes (its host copy went to make room): only the new pages are.
* Under ``lpm`` a prompt goes to the tree once prefilled (under modeled compute, at a step after
  its prefill ended), so its host copy runs while the request decodes; it counts one hit, not two.

Outputs stay bit-identical to no cache throughout (the differential tests cover the policies).
"""

from __future__ import annotations

import threading
import time
import uuid

import torch

from hicache_storage.connectors.memory import MemoryBackend
from hicache_core.controller import ControllerConfig, WritePolicy
from hicache_core.engine import AdmissionOrder, CacheTiers, Engine, Request
from hicache_core.model import ModeledCompute
from hicache_core.prefetch import PrefetchConfig, StopPolicy
from hicache_core.radix_tree import RadixTree

from pinned_cost import LOAD_AND_STORE_EVERY_PAGE
from test_core_admission import MODEL, engine_config

#: A guard against a hang, never a timing assertion: a step loop gives up after this long.
DEADLINE_S = 60.0


class GatedReads(MemoryBackend):
    """The in-memory store whose reads wait while ``gate`` is closed (fault injection: a slow read)."""

    def __init__(self, store: str) -> None:
        super().__init__({"store": store})
        self.gate = threading.Event()
        self.reading = threading.Event()

    def _get_into(self, keys, targets):
        self.reading.set()
        assert self.gate.wait(DEADLINE_S), "the test never opened the gate"
        return super()._get_into(keys, targets)


def step_until(engine: Engine, done, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        engine.step()


def prompt(seed: int, tokens: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (tokens,), generator=generator).tolist()


def stored(store: str, *prompts: list[int]) -> None:
    """Serve ``prompts`` once on a fresh engine so that L3 (the named memory store) holds them."""
    with Engine(engine_config(CacheTiers.L1_L2_L3, store=store)) as engine:
        engine.serve([Request(f"warm-{i}", p, 1) for i, p in enumerate(prompts)])
        engine.drain()


def test_a_request_the_store_cannot_serve_does_not_wait_behind_another_requests_reads():
    store = f"pipeline-{uuid.uuid4().hex}"
    history = prompt(1, 40)
    stored(store, history)
    backend = GatedReads(store)
    # Host capacity for both reads at once (a rate-limited op is not asked about until it fits).
    with Engine(engine_config(CacheTiers.L1_L2_L3, store=store, host_pages=64), storage=backend) as engine:
        engine.submit(Request("from-l3", history + prompt(2, 4), 2))
        assert backend.reading.wait(DEADLINE_S), "the stored history was never read"
        engine.submit(Request("new", prompt(3, 40), 2))  # long enough to be looked up in L3, not there
        step_until(engine, lambda: "new" in engine._done, "the new request")
        assert engine.has_work(), "the request reading from L3 finished although its read is still held"
        backend.gate.set()
        step_until(engine, lambda: not engine.has_work(), "the request reading from L3")
        results = {r.rid: r for r in engine.take_results()}
    assert results["from-l3"].cached_storage == 40 and results["new"].cached_storage == 0


def test_requests_behind_a_blocked_queue_take_their_completed_prefetches_so_the_next_reads_start():
    store = f"pipeline-{uuid.uuid4().hex}"
    histories = [prompt(10 + i, 40) for i in range(3)]
    stored(store, *histories)
    # One request at a time, and prefetch capacity for one 10-page read at a time.
    prefetch = PrefetchConfig(threshold_tokens=8, stop_policy=StopPolicy.WAIT_COMPLETE, timeout_base_s=60.0, capacity_pages=10)
    # It counts the tokens L3 served: every page is written and read, whatever the speeds.
    controller = ControllerConfig(prefetch=prefetch, cost=LOAD_AND_STORE_EVERY_PAGE)
    config = engine_config(CacheTiers.L1_L2_L3, store=store, max_running=1, controller=controller)
    with Engine(config) as engine:
        engine.submit(Request("running", prompt(9, 20), 40))  # decodes for a while: the queue is blocked
        step_until(engine, lambda: bool(engine._running), "the first request to start")
        for i, history in enumerate(histories):
            engine.submit(Request(f"waiting-{i}", history + prompt(20 + i, 4), 1))
        ops = [live.prefetch for live in engine.admission.waiting]
        # Each read completes and is taken into the tree while the first request still runs, so
        # the capacity goes to the next read: all three are read before anything else starts.
        step_until(engine, lambda: all(live.prefetch is None for live in engine.admission.waiting), "the three reads")
        assert [live.request.rid for live in engine._running] == ["running"]
        assert all(op.completed_pages == 10 for op in ops)
        step_until(engine, lambda: not engine.has_work(), "every request")
        results = {r.rid: r for r in engine.take_results()}
    assert all(results[f"waiting-{i}"].cached_storage == 40 for i in range(3))


def test_a_running_requests_host_copy_may_go_once_on_the_device_but_not_while_read():
    freed: list[torch.Tensor] = []
    tree = RadixTree(4, free_device=lambda slots: None, free_host=freed.append)
    inserted = tree.insert(list(range(8)), torch.arange(8))
    node = inserted.last_node
    node.host_value = torch.arange(100, 108)
    tree.lock(node)  # a running request reads it: on the device
    tree.protect_host(node, 0)  # a load or a copy still uses the host pages
    assert tree.evict_host(8) == 0 and node.host_value is not None
    tree.release_host(node, 0)
    assert tree.evict_host(8) == 8 and node.host_value is None and node.device_value is not None
    assert torch.equal(freed[0], torch.arange(100, 108))
    node.device_value, node.host_value = None, torch.arange(200, 208)  # host only: the lock keeps it
    assert tree.evict_host(8) == 0 and node.host_value is not None



def test_io_on_the_newest_turn_keeps_only_its_own_host_pages_and_a_split_keeps_both_parts():
    """A storage backup of a conversation's newest pages used to protect the host copy of its
    whole history (``host_ref`` is taken along the path): a prefetch then found no host page to
    evict while the history sat on the device. I/O holds only the pages it reads (``host_io``)."""
    freed: list[torch.Tensor] = []
    tree = RadixTree(4, free_device=lambda slots: None, free_host=freed.append)
    history = tree.insert(list(range(8)), torch.arange(8)).last_node
    turn = tree.insert(list(range(16)), torch.arange(16)).last_node
    history.host_value, turn.host_value = torch.arange(100, 108), torch.arange(108, 116)
    tree.protect_host(turn, 8)  # the newest turn's backup is in flight
    tree.check_invariants()
    assert tree.evict_host(16) == 8, "the history's host copy goes, the turn's stays"
    assert history.host_value is None and history.device_value is not None and turn.host_value is not None
    # The backed-up node is split (a request diverges in its middle): both parts stay protected.
    tree.insert([*range(12), 99, 99, 99, 99], torch.arange(16, 32))
    upper = turn.parent
    assert upper is not history and len(upper.key) == len(turn.key) == 4 and upper.host_io == turn.host_io == 1
    assert tree.evict_host(16) == 0
    tree.release_host(turn, 8)
    tree.check_invariants()
    assert upper.host_io == turn.host_io == 0 and history.host_ref == 0
    assert tree.evict_host(16) == 8 and upper.host_value is None and turn.host_value is None


def test_a_history_without_a_host_copy_leaves_the_device_while_its_newest_turn_is_backed_up():
    """The newest turn's storage backup used to keep the whole conversation on the device (the
    history, without a host copy, could only go with the turn). The backup owns its pinned pages
    and hashes, so the subtree goes and the backup completes detached."""
    freed_device: list[torch.Tensor] = []
    freed_host: list[torch.Tensor] = []
    tree = RadixTree(4, free_device=freed_device.append, free_host=freed_host.append)
    shared = tree.insert(list(range(4)), torch.arange(4)).last_node
    history = tree.insert(list(range(12)), torch.arange(12)).last_node
    turn = tree.insert(list(range(16)), torch.arange(16)).last_node
    shared.host_value, turn.host_value = torch.arange(100, 104), torch.arange(112, 116)
    tree.protect_host(turn, 12)  # the turn's storage backup is in flight
    assert tree.evict_device(16) == 16, "the turn, then the history (deleted with the turn), then the shared prefix"
    tree.check_invariants()
    assert not tree.in_tree(history) and not tree.in_tree(turn)
    assert shared.host_ref == 0 and shared.host_value is not None, "the survivors no longer count the backup"
    assert torch.equal(freed_host[0], torch.arange(112, 116)), "the allocator defers it while the backup pins it"
    tree.release_host(turn, 12)  # the backup returns: touches only the detached node
    tree.check_invariants()
    assert turn.host_ref == turn.host_io == 0 and tree.releases > 0

def test_a_head_short_of_memory_is_retried_only_after_something_was_given_back():
    config = engine_config(CacheTiers.L1_L2, device_pages=12, max_running=2)
    with Engine(config) as engine:
        attempts: list[str] = []
        start = engine._start

        def counted(live):
            attempts.append(live.request.rid)
            return start(live)

        engine._start = counted  # type: ignore[method-assign]
        engine.submit(Request("big-1", prompt(30, 24), 20))  # 11 of the 12 pages
        engine.submit(Request("big-2", prompt(31, 24), 20))  # cannot start until big-1 ends
        step_until(engine, lambda: attempts.count("big-2") >= 1, "the second request's first attempt")
        for _ in range(10):  # decode steps of big-1 give nothing back
            engine.step()
        assert attempts.count("big-2") == 1
        step_until(engine, lambda: not engine.has_work(), "both requests")
        assert len(engine.take_results()) == 2


def test_a_node_already_in_l3_is_not_copied_to_the_host_again_after_its_host_copy_went():
    store = f"pipeline-{uuid.uuid4().hex}"
    first = prompt(40, 40)
    with Engine(engine_config(CacheTiers.L1_L2_L3, store=store)) as engine:
        engine.serve([Request("first", first, 1)])
        engine.drain()
        stored_pages = engine.metrics.snapshot()["host_backup_pages"]
        engine.tree.evict_host(1 << 30)  # the host copies go; the KV stays on the device and in L3
        result = engine.serve([Request("longer", first + prompt(41, 12), 1)])[0]
        engine.drain()
        backed_up = engine.metrics.snapshot()["host_backup_pages"] - stored_pages
    assert result.cached_device == 40
    assert backed_up == 3, "only the three new pages are copied to the host (and stored)"


def test_a_head_short_of_memory_takes_the_device_prefix_pinned_by_a_request_behind_it():
    """A waiting request pins its matched prefix, on the device too. Behind the head of the
    queue it cannot start first, so when the head is short of device memory and that pin is
    what stands in its way, the pin goes: the head starts beside the running request instead of
    waiting for it to finish (the long-history bench's late rounds ran in three waves where two
    fit). The request behind gets its prefix back from the host. In arrival order (``fcfs``): by
    the most cached tokens (``lpm``) the request with the history would be tried first."""
    store = f"pipeline-{uuid.uuid4().hex}"
    history = prompt(30, 40)  # 10 pages
    extension = prompt(31, 16)
    stored(store, history + extension)  # L3 holds the history and its extension
    # 32 device pages of 4 tokens
    config = engine_config(CacheTiers.L1_L2_L3, store=store, device_pages=32, admission_order=AdmissionOrder.FCFS)
    with Engine(config) as engine:
        engine.serve([Request("history", history, 1)])  # the history is on the device (10 pages)
        engine.submit(Request("running", prompt(32, 20), 60))  # 20 + 59 tokens: 20 pages, for 59 steps
        step_until(engine, lambda: bool(engine._running), "the running request to start")
        engine.submit(Request("head", prompt(33, 36), 2))  # 37 tokens: 10 pages; 2 are free
        engine.submit(Request("behind", history + extension + prompt(34, 4), 1))  # its prefetch pins the history
        for live in engine.admission.waiting:
            assert live.prefetch is not None and live.prefetch.done.wait(DEADLINE_S), live.request.rid
        for _ in range(10):  # the running request needs 59 steps: it is still running after these
            engine.step()
            if any(live.request.rid == "head" for live in engine._running):
                break
        assert sorted(live.request.rid for live in engine._running) == ["head", "running"]
        step_until(engine, lambda: not engine.has_work(), "every request")
        results = {r.rid: r for r in engine.take_results()}
    behind = results["behind"]
    assert behind.cached_device + behind.cached_host + behind.cached_storage == 40 + 16, "its prefix came back from a tier"


def test_a_head_that_would_not_fit_even_so_leaves_the_pins_behind_it_alone():
    """The pins behind a head short of memory go only when that makes room for it. A head with
    nothing to copy (no cached prefix, or all of it on the device) was once answered "fits" at
    once: each step it took another waiting request's pin, still could not start, and the
    prefixes behind it left the device for nothing."""
    store = f"pipeline-{uuid.uuid4().hex}"
    history = prompt(50, 40)  # 10 pages
    extension = prompt(51, 16)
    stored(store, history + extension)
    with Engine(engine_config(CacheTiers.L1_L2_L3, store=store, device_pages=32)) as engine:
        engine.serve([Request("history", history, 1)])  # the history is on the device (10 pages)
        engine.submit(Request("running", prompt(52, 20), 60))  # 20 pages, for 59 steps
        step_until(engine, lambda: bool(engine._running), "the running request to start")
        engine.submit(Request("head", prompt(53, 52), 2))  # 53 tokens: 14 pages; 2 free, 10 more pinned behind it
        engine.submit(Request("behind", history + extension + prompt(54, 4), 1))  # its prefetch pins the history
        for live in engine.admission.waiting:
            assert live.prefetch is not None and live.prefetch.done.wait(DEADLINE_S), live.request.rid
        for _ in range(10):  # the running request needs 59 steps: it is still running after these
            engine.step()
        assert [live.request.rid for live in engine._running] == ["running"]
        behind = next(live for live in engine.admission.waiting if live.request.rid == "behind")
        assert behind.pinned is not None, "its pin could not have made room for the head: it stays"
        assert engine.tree.match_prefix(history).device_hit_length == 40, "the history stayed on the device"
        step_until(engine, lambda: not engine.has_work(), "every request")
        results = {r.rid: r for r in engine.take_results()}
    assert sorted(results) == ["behind", "head", "running"]
    assert results["behind"].cached_device + results["behind"].cached_host + results["behind"].cached_storage == 40 + 16


def test_a_head_short_of_memory_takes_the_device_prefix_pinned_by_a_request_whose_read_is_in_flight():
    """The same, with the read of the request behind still in flight (a slow store): its pin goes
    too. Its read's pages hang from that prefix, which keeps its host copy, so once the read
    lands the request behind still loads its whole prompt from the tiers. Before, the head waited
    for that read: in the long-history bench three requests' device prefixes filled L1 while two
    of them read their last turn from the store, and the third, all of its prefix on the device,
    waited for a read with nothing running. In arrival order, as the test before: by the most
    cached tokens the request reading would be ahead of the head, and its pin kept (releasing
    the pins of requests ahead that still read cost the long-history bench with S3 at the H200
    point the hits ``lpm`` gains: 11.9 -> 13.6 s, two runs each)."""
    store = f"pipeline-{uuid.uuid4().hex}"
    history = prompt(40, 40)  # 10 pages
    extension = prompt(41, 16)
    stored(store, history + extension)
    backend = GatedReads(store)
    backend.gate.set()
    config = engine_config(CacheTiers.L1_L2_L3, store=store, device_pages=32, admission_order=AdmissionOrder.FCFS)
    with Engine(config, storage=backend) as engine:
        engine.serve([Request("history", history, 1)])  # the history is on the device (10 pages)
        engine.drain()
        backend.gate.clear()
        backend.reading.clear()
        engine.submit(Request("running", prompt(42, 20), 60))  # 20 pages, for 59 steps
        step_until(engine, lambda: bool(engine._running), "the running request to start")
        engine.submit(Request("head", prompt(43, 36), 2))  # 10 pages; 2 are free
        engine.submit(Request("behind", history + extension + prompt(44, 4), 1))  # its prefetch pins the history
        assert backend.reading.wait(DEADLINE_S), "the extension was never read"
        for _ in range(10):  # the running request needs 59 steps: it is still running after these
            engine.step()
            if any(live.request.rid == "head" for live in engine._running):
                break
        assert sorted(live.request.rid for live in engine._running) == ["head", "running"]
        waiting = engine.admission.waiting
        assert [live.request.rid for live in waiting] == ["behind"] and waiting[0].prefetch is not None, "its read is held"
        backend.gate.set()
        step_until(engine, lambda: not engine.has_work(), "every request")
        results = {r.rid: r for r in engine.take_results()}
    behind = results["behind"]
    assert behind.cached_storage == 16, "the read it was waiting for was used"
    assert behind.cached_device + behind.cached_host + behind.cached_storage == 40 + 16, "its prefix came back from a tier"


def test_a_prompt_goes_to_the_tree_after_its_prefill_and_its_host_copy_starts_while_it_decodes():
    """As SGLang's ``cache_unfinished_req``: once prefilled, the prompt's pages are the tree's
    (another request matches them on the device) and write-through copies them to the host
    while the request still decodes, not after it."""
    first = prompt(50, 40)
    with Engine(engine_config(CacheTiers.L1_L2, admission_order=AdmissionOrder.LPM)) as engine:
        engine.submit(Request("long", first, 12))
        step_until(engine, lambda: bool(engine._running), "the request's start")
        assert engine.tree.device_hit_length(first) == 40
        engine.drain()  # (no step: the request has 11 tokens to go)
        assert engine._running and engine.metrics.snapshot()["host_backup_pages"] == 10
        shared = engine.serve([Request("same-prompt", first + [1, 2, 3, 4], 1)])[0]
        assert shared.cached_device == 40, "it started beside the first request and matched its prompt"
        engine.drain()
        # then the first request's 2 output pages and the other's new page; no page copied twice
        assert engine.metrics.snapshot()["host_backup_pages"] == 10 + 2 + 1


def test_a_prompt_sent_once_counts_one_hit_though_it_is_inserted_twice():
    """The prompt goes to the tree after its prefill and the whole sequence at its end: the
    second insert counts no hit on the prompt's pages, so ``write_through_selective`` (at one hit:
    a new page has none) backs up a prompt sent twice, not one sent once."""
    selective = ControllerConfig(write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE, selective_hits=1)
    config = engine_config(CacheTiers.L1_L2, controller=selective, admission_order=AdmissionOrder.LPM)
    once, twice = prompt(51, 40), prompt(52, 40)
    with Engine(config) as engine:
        engine.serve([Request("once", once, 5)])
        engine.serve([Request("twice-1", twice, 5)])
        engine.drain()
        assert engine.metrics.snapshot()["host_backup_pages"] == 0
        engine.serve([Request("twice-2", twice, 1)])
        engine.drain()
        assert engine.metrics.snapshot()["host_backup_pages"] == 10


def test_under_modeled_compute_a_prompt_goes_to_the_tree_only_once_its_prefill_has_ended():
    """The host copy of a prompt must not start before the modeled GPU computed its KV (a real
    GPU's stream order gives this): the prompt is taken only at a step after its prefill ends."""
    prefill = 0.3
    config = engine_config(CacheTiers.L1_L2, compute=ModeledCompute(prefill_tokens_per_s=40 / prefill, decode_step_s=0.05),
                           admission_order=AdmissionOrder.LPM)
    tokens = prompt(53, 41)
    with Engine(config) as engine:
        gpu = engine.runner.gpu
        taken: list[tuple[float, float]] = []
        cache_prompt = engine._cache_prompt

        def recorded(live):
            taken.append((time.perf_counter(), gpu.end_of(live.prefill)))
            cache_prompt(live)

        engine._cache_prompt = recorded  # type: ignore[method-assign]
        result = engine.serve([Request("modeled", tokens, 3)])[0]
    assert len(taken) == 1, "a request finishing after a decode step had its prompt taken before its end"
    at, prefill_end = taken[0]
    assert at >= prefill_end
    assert result.cached_tokens == 0
