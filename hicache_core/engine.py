"""The reference engine: a minimal scheduler serving (multi-turn) requests through the HiCache core.

Per request: match the prompt in the radix tree, prefetch from storage when the storage part is
long enough, wait by the stop policy, load the host part back layer by layer, prefill the rest,
decode greedily, insert the sequence into the tree (the write policy backs it up). Requests run
interleaved, at most ``max_running`` at a time; a request that is not ready (prefetch pending) is
skipped, not waited for.

Each request carries one :class:`~hicache_core.token_sequence.TokenSequence` (its prompt, then
its outputs as they come): every tree call and prefetch plan of the request reads it, so a
page is hashed once and tree lookups take the page-hash path. A request of a session continues
the session's last sequence when its prompt starts with it (``EngineConfig.session_sequences``).

Use::

    engine = Engine(EngineConfig(tiers=CacheTiers.L1_L2_L3, storage_backend="file",
                                 storage_config={"root": "/tmp/kv"}))
    results = engine.serve([Request("a", tokens, max_new_tokens=8)])
    results[0].output_ids, results[0].cached_storage, results[0].ttft_s
    engine.metrics.snapshot()

``EngineConfig.compute`` set to a :class:`~hicache_core.model.ModeledCompute` replaces the
forward pass by its modeled cost, taken on a :class:`~hicache_core.model.ModeledGPU` that the
scheduler queues work on as on a real one (overlapped with its own work, waited for at decode
steps), while every KV movement stays real. Single-threaded: call an engine from one thread.

Every model runs here: a FULL-only one (:class:`~hicache_core.model.ModelConfig`) and a hybrid
one (:class:`~hicache_core.hybrid.model.HybridModelConfig`: sliding-window and recurrent layers
and a draft model), whose components' state the tree, the controller and the prefetcher move
with the FULL KV (see :mod:`hicache_core.runner` and :mod:`hicache_core.side_pools`). A request
resumes at the deepest boundary every component accepts (``RadixTree.resume_point``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from hicache_storage.connector import Level
from hicache_storage.keys import KeyScope, Namespace, Shard
from hicache_storage.spec import open_store, store_spec
from hicache_storage.store import Store

from hicache_core.admission import Admission
from hicache_core.controller import CacheController
from hicache_core.metrics import CacheMetrics
from hicache_core.op_thread import Wakeup
from hicache_core.pools import DevicePool, HostPool
from hicache_core.radix_tree import RadixTree
from hicache_core.requests import AdmissionOrder, CacheTiers, EngineCapacityError, EngineConfig, HybridPools, Live, Request, RequestResult
from hicache_core.runner import make_runner
from hicache_core.sessions import SessionTable
from hicache_core.token_sequence import TokenSequence
from hicache_core.tp import TPContext
from hicache_core.transfer import LayerLoad
from hicache_core.tree_node import InsertResult, MatchResult, TreeNode

#: How long before the modeled device runs out of queued work the scheduler queues the next
#: decode step while requests wait to start.
DECODE_LEAD_S = 0.001
#: The longest the scheduler waits between steps without being notified (see ``Wakeup``).
WAIT_LONGEST_S = 0.002


class Engine:
    """Serves requests through the tiers ``config`` selects. Owns ``storage`` (closes it on ``close``)."""

    def __init__(self, config: EngineConfig, storage: Store | Level | None = None) -> None:
        if config.controller.buffer_only and not config.tiers.storage:
            raise ValueError("buffer-only mode stages pages for storage: it needs tiers L1+L2+L3")
        self.config = config
        self.tp = config.tp or TPContext()
        self.runner = make_runner(config)
        geometry = self.runner.geometry
        self.device_pool = DevicePool(geometry, config.device_pages, config.page_size, config.device)
        self.host_pool: HostPool | None = None
        if config.tiers.host:
            self.host_pool = HostPool(
                geometry,
                config.page_size,
                config.layout,
                num_pages=config.host_pages,
                ratio=config.host_ratio if config.host_pages is None and config.host_bytes is None else None,
                size_bytes=config.host_bytes,
                device_pool=self.device_pool,
            )
        self.metrics = CacheMetrics()
        #: What the scheduler waits on between steps: notified as copies, loads, prefetches and
        #: backups end (the controller's, and the components' copies).
        self.wakeup = Wakeup()
        self.tree = RadixTree(
            config.page_size,
            free_device=self.device_pool.allocator.free,
            free_host=self.host_pool.allocator.free if self.host_pool else None,
            components=self.runner.build(self.device_pool, self.host_pool, self.wakeup),
        )
        self.runner.attach(self.tree)
        self.controller = CacheController(
            config.controller,
            self.tree,
            self.device_pool,
            self.host_pool,
            metrics=self.metrics,
            tp=self.tp,
            compute_tokens_per_s=config.compute.prefill_tokens_per_s if config.compute is not None else None,
            wakeup=self.wakeup,
        )
        gpu = self.runner.gpu
        if gpu is not None:  # the work queued on the modeled GPU is compute ahead of any new request
            self.controller.cost.busy_for_s = gpu.queued_for
        self.sessions = SessionTable(self.tree)
        self._running: list[Live] = []
        self.admission = Admission(config, self.tree, self.controller, self._running)
        self._prefilled: set[int] = set()
        #: Running requests whose prompt goes to the tree once the modeled GPU has computed it
        #: (``_cache_prompt``), in the order their prefills were queued.
        self._prompts_computing: list[Live] = []
        self._done: dict[str, RequestResult] = {}
        #: Session id -> the sequence its last finished request reached (see ``_sequence_for``).
        self._session_sequences: OrderedDict[str, TokenSequence] = OrderedDict()
        if config.tiers.storage:
            if storage is None:
                if config.storage_backend is None:
                    raise ValueError("tiers L1+L2+L3 need storage: pass a backend or set storage_backend")
                storage = open_store(store_spec(config.storage_backend, config.storage_config, config.storage_layers))
            self.attach_storage(storage)

    # --- public API ---------------------------------------------------------------------------

    @property
    def key_scope(self) -> KeyScope:
        """Where this engine's pages live in storage: model, dtype, page size, layout, tenant, shard."""
        c = self.config
        namespace = Namespace(
            c.model.name, self.runner.geometry.dtype_name, c.page_size, c.layout, revision=c.revision, tenant=c.tenant
        )
        shard = Shard(tp_rank=self.tp.rank, tp_size=self.tp.size, replicated=self.runner.replicated)
        return KeyScope(namespace, shard, self.runner.kv_part)

    def attach_storage(self, storage: Store | Level) -> None:
        """Start using ``storage`` (a store, or a connector or layer to hold one over) as L3 at
        runtime (with tensor parallelism: on every rank at once)."""
        self.controller.attach_storage(storage, self.key_scope)

    def detach_storage(self) -> Store | None:
        """Stop using L3 after draining its in-flight work; returns the store for the caller to close."""
        return self.controller.detach_storage()

    def serve(self, requests: Sequence[Request]) -> list[RequestResult]:
        """Run ``requests`` (and any already submitted) to completion; their results in order."""
        for request in requests:
            self.submit(request)
        while self.has_work():
            self.step()
        return [self._done.pop(r.rid) for r in requests]

    def submit(self, request: Request) -> None:
        """Queue ``request``: it is matched now and its storage prefetch issued (or planned).

        Raises :class:`EngineCapacityError` for a request that would not fit even an empty
        device pool; any other request is served, however long it has to wait for memory.
        """
        request.check()
        self.admission.check_fits(request)
        self.runner.check_fits(request)
        live = Live(request, RequestResult(request.rid, len(request.tokens)), time.perf_counter(), self._sequence_for(request))
        if request.session_id is not None:
            live.session = self.sessions.ticket(request.session_id)
        if self.config.tiers is not CacheTiers.OFF:
            self.admission.plan_prefetch(live)
        self.admission.enqueue(live)

    def close_session(self, session_id: str) -> bool:
        """End a session: its cached prefixes become ordinary LRU data (nothing is deleted), and
        its requests still running add no reference when they finish. Returns whether it was open."""
        self._session_sequences.pop(session_id, None)
        return self.sessions.close(session_id)

    def take_results(self) -> list[RequestResult]:
        """Results of the requests finished since the last call (for drivers using ``submit``/``step``)."""
        done = list(self._done.values())
        self._done.clear()
        return done

    def has_work(self) -> bool:
        return bool(self.admission.waiting or self._running)

    def step(self) -> None:
        """One scheduling round: apply finished I/O, admit ready requests (prefill), decode one token each."""
        self.controller.poll()
        self._cache_computed_prompts()
        admitted = self.admission.admit(self._start, self._started, self._fits if self.config.tiers is not CacheTiers.OFF else None)
        gpu = self.runner.gpu
        if gpu is not None and self._running:
            pending = gpu.step_pending()
            if self.admission.waiting:
                # Prefill first: a step queued now would start only when the work queued before
                # it ends, and a request admitted meanwhile would prefill after it and join the
                # batch one step later. Queued just before the device is free, the step takes
                # every request admitted until then: the long-history bench's rounds, whose
                # requests start a few ms apart as their storage lookups return, decoded one
                # more step than their batch needs (5 ms of each ~100 ms round at h200-7b).
                pending = max(pending, gpu.queued_for() - DECODE_LEAD_S)
            # The modeled GPU still runs the last decode step, whose tokens this one reads: keep
            # admitting (and preparing) requests until it is done, as an overlap scheduler does.
            # Ranks agree, so that they decode the same steps.
            if self.tp.scheduler.all_max(int(pending > 0)):
                if not admitted:
                    self.wakeup.wait(min(max(pending, 0.0001), WAIT_LONGEST_S))
                return
        decoded = False
        step_started = time.perf_counter()
        for live in list(self._running):
            if id(live) in self._prefilled:
                self._prefilled.discard(id(live))
                continue
            self._decode(live)
            decoded = True
        if decoded:
            self.metrics.add(decode_steps=1)
            if gpu is not None:
                # Continuous batching: one decode step serves every running request at once.
                gpu.decode_step(step_started)
        if gpu is not None and not self.has_work():
            gpu.wait()  # the last results exist once the modeled GPU has computed them
        elif not (admitted or decoded):
            self.wakeup.wait(WAIT_LONGEST_S)

    def drain(self) -> None:
        """Wait until every device -> host copy and storage backup in flight has completed.

        Backups run in the background: counters such as ``storage_backup_pages`` are final only
        after this (or ``flush_cache``, which drains first).
        """
        self.controller.drain()

    def flush_cache(self) -> None:
        """Empty L1 and L2 after finishing every backup; L3 keeps its pages. No request may be running."""
        if self.has_work():
            raise RuntimeError("flush_cache needs an idle engine")
        self.controller.flush()

    def close(self) -> None:
        self.controller.close()
        self.runner.close()
        if self.host_pool is not None:
            self.host_pool.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- scheduling ---------------------------------------------------------------------------

    def _sequence_for(self, request: Request) -> TokenSequence:
        """The request's token sequence. A request continuing its session's last finished
        sequence (the previous turn's prompt and outputs, then new tokens) shares its page hashes,
        so a conversation's pages are hashed once, not once per turn."""
        if request.session_id is not None:
            if request.session_id not in self.sessions:  # closed (by the caller or the table's cap)
                self._session_sequences.pop(request.session_id, None)
            previous = self._session_sequences.get(request.session_id)
            if previous is not None:
                continued = previous.continuation(request.tokens)
                if continued is not None:
                    return continued
        return TokenSequence(self.config.page_size, request.tokens)

    def _keep_session_sequence(self, live: Live) -> None:
        """Keep the finished request's sequence for its session's next turn, unless the session
        was closed while the request ran (a closed session keeps nothing)."""
        limit = self.config.session_sequences
        if live.session is None or limit <= 0 or not self.sessions.is_current(live.session):
            return
        session_id = live.session.session_id
        self._session_sequences[session_id] = live.sequence
        self._session_sequences.move_to_end(session_id)
        while len(self._session_sequences) > limit:
            self._session_sequences.popitem(last=False)

    def _start(self, live: Live) -> bool:
        """Place the request's KV (cached prefix + new slots) and prefill; False if device memory is short."""
        request, result = live.request, live.result
        inserted = live.storage_tokens
        load: LayerLoad | None = None
        device_hit = matched = 0
        node = self.tree.root  # resuming at the root needs no lock (it is never evicted)
        if self.config.tiers is not CacheTiers.OFF:
            match, resume = self._resume_point(live)
            if not self._may_fit(live, match, resume):
                return False
            node, load = self.controller.load_back(match, resume)
            device_hit, matched = match.device_hit_length, match.matched_length
        live.node = self.runner.begin(live, node, load, matched)
        live.prefix_slots = self.tree.device_slots(live.node)
        need = len(request.tokens) + request.max_new_tokens - 1 - live.prefix_len
        live.own_slots = self.controller.alloc_device(need)
        if live.own_slots is None or not self.runner.reserve(live, need):
            if live.own_slots is not None:
                self.device_pool.allocator.free(live.own_slots)
                live.own_slots = None
            self.runner.release(live)
            if load is not None:
                load.wait_all()
                self.controller.loads_done(used=False)
                before = live.device_hit_before_load
                live.device_hit_before_load = device_hit if before is None else min(before, device_hit)
            self.tree.unlock(live.node)
            live.node = None
            return False
        self.admission.unpin(live)  # its prefix is locked as live.node now
        device_hit = min(device_hit, live.prefix_len)
        if live.device_hit_before_load is not None:  # what an earlier attempt loaded came from the host
            device_hit = min(device_hit, live.device_hit_before_load)
        loaded = live.prefix_len - device_hit
        result.cached_device = device_hit
        result.cached_storage = min(inserted, loaded)
        result.cached_host = loaded - result.cached_storage
        result.computed = len(request.tokens) - live.prefix_len
        stored_start, stored_end = live.stored_span
        result.stored_recomputed = max(0, min(stored_end, len(request.tokens)) - max(stored_start, live.prefix_len))
        self.metrics.add(
            prompt_tokens=len(request.tokens),
            device_hit_tokens=result.cached_device,
            host_hit_tokens=result.cached_host,
            storage_hit_tokens=result.cached_storage,
            computed_tokens=result.computed,
            storage_recomputed_tokens=result.stored_recomputed,
        )
        self.controller.cost.started(request.rid)
        new_tokens = request.tokens[live.prefix_len :]
        computing = time.perf_counter()
        self._forward(live, new_tokens, len(request.tokens), load, prefill=True)
        if self.runner.gpu is None:  # a real forward pass on this thread: its time is the compute rate
            self.controller.cost.record_compute(len(new_tokens), time.perf_counter() - computing)
        gpu = self.runner.gpu
        if gpu is None:
            result.ttft_s = time.perf_counter() - live.submitted
            self.controller.loads_done()
        else:
            # queued on the modeled GPU: the first token exists when the prefill ends, once its
            # loads have landed (``_finish`` reads it); the host pages they read are released then
            live.prefill = gpu.last_prefill
            self.controller.loads_done(wait=False)
        if self._caches_prompts:
            if gpu is None:
                self._cache_prompt(live)
            else:
                self._prompts_computing.append(live)
        return True

    def _resume_point(self, live: Live) -> tuple[MatchResult, TreeNode]:
        """The request's match now, and where it would resume (host copies count unless
        buffer-only, where only what its prefetch inserted does)."""
        count_host = not self.config.controller.buffer_only or live.storage_tokens > 0
        match = self.tree.match_prefix(self.admission.matchable(live), count_host=count_host)
        return match, self.tree.resume_point(match.host_node, on_device=False)

    def _fits(self, live: Live) -> bool:
        """Whether device memory could hold the request now, at its current match: the pages its
        load from host memory takes and those of its own tokens, from free pages and all that
        eviction could free (``unpin_behind`` releases waiting requests' pins by it).

        Unlike ``_may_fit`` it counts a request with nothing to copy too: answered "fits" at
        once, a head with no cached prefix, or all of it on the device, took one waiting
        request's pin per scheduler step even where every pin together could not make room for
        it, and the prefixes behind it left the device for nothing (traced in the long-history
        bench at the H200 point; its wall time did not move, 5.35 s both in eight runs each)."""
        return self._room_for(live, *self._resume_point(live))

    def _may_fit(self, live: Live, match: MatchResult, resume: TreeNode) -> bool:
        """Whether device memory could hold the request resuming at ``resume`` (``_room_for``).
        Checked before the load is issued: a start that fails after it waits for the copy to
        land (its slots must not be reused under it), and that wait holds up the scheduler,
        every running request's next decode step with it (30-75 ms a time at the long-history
        bench's 40,000 tok/s). With nothing to copy a failed start costs nothing to find out:
        True without counting. False only when the start cannot succeed."""
        if resume.end <= match.device_hit_length:
            return True
        return self._room_for(live, match, resume)

    def _room_for(self, live: Live, match: MatchResult, resume: TreeNode) -> bool:
        """Whether free pages, and all that eviction could free, hold what the request resuming
        at ``resume`` takes: its load from host memory and its own tokens."""
        loaded = max(0, resume.end - match.device_hit_length)
        ps = self.config.page_size
        own = len(live.request.tokens) + live.request.max_new_tokens - 1 - resume.end
        pages = -(-loaded // ps) + -(-own // ps)
        free = self.device_pool.allocator.free_pages
        return free >= pages or free + self.tree.device_evictable_tokens(resume) // ps >= pages

    def _started(self, live: Live) -> None:
        if len(live.result.output_ids) >= live.request.max_new_tokens:
            self._finish(live)
        else:
            self._prefilled.add(id(live))

    def _decode(self, live: Live) -> None:
        length = len(live.request.tokens) + len(live.result.output_ids)
        self._forward(live, live.result.output_ids[-1:], length, None, prefill=False)
        if len(live.result.output_ids) >= live.request.max_new_tokens:
            self._finish(live)

    def _forward(self, live: Live, tokens: Sequence[int], length: int, load: LayerLoad | None, *, prefill: bool) -> None:
        """Compute ``tokens`` (the last ones of a ``length``-token context) and append the next token."""
        token = self.runner.forward(live, tokens, length, load, prefill)
        live.result.output_ids.append(token)
        live.sequence.append(token)

    def _finish(self, live: Live) -> None:
        self._running.remove(live)
        self._prefilled.discard(id(live))
        if live in self._prompts_computing:  # (one output token: it ends before its prefill)
            self._prompts_computing.remove(live)
        request, result = live.request, live.result
        if live.prefill is not None:  # (recorded only under a modeled GPU)
            assert self.runner.gpu is not None
            result.ttft_s = self.runner.gpu.end_of(live.prefill) - live.submitted
        assert live.own_slots is not None and live.node is not None
        if self.config.tiers is CacheTiers.OFF:
            self.device_pool.allocator.free(live.own_slots)
            self.runner.release(live)
            self.tree.unlock(live.node)
        else:
            self._cache(live)
        self._keep_session_sequence(live)
        if live.logits:
            result.logits = torch.stack(live.logits)
        result.latency_s = time.perf_counter() - live.submitted
        self._done[request.rid] = result

    @property
    def _caches_prompts(self) -> bool:
        """Whether a prompt goes to the tree once prefilled (``_cache_prompt``): for FULL-only
        models, when an insert starts device -> host copies (every write policy but write-back),
        under ``AdmissionOrder.LPM`` only (in arrival order it was measured to lose: see
        ``_cache_prompt``).
        A hybrid model's component state at the prompt's end (a window, a recurrent state) is not
        kept apart from the one its decode steps advance, so its tree takes a request at its end."""
        return not self.tree.components and self.controller.copies_on_insert and self.config.admission_order is AdmissionOrder.LPM

    def _cache_computed_prompts(self) -> None:
        """Cache the prompts whose prefill the modeled GPU has computed, as many as every rank
        has (prefills end in the order they were queued)."""
        gpu = self.runner.gpu
        if gpu is None or not self._prompts_computing:
            return
        computed = 0
        for live in self._prompts_computing:
            assert live.prefill is not None
            if not gpu.computed(live.prefill):
                break
            computed += 1
        computed = self.tp.scheduler.all_min(computed)
        for live in self._prompts_computing[:computed]:
            self._cache_prompt(live)
        del self._prompts_computing[:computed]

    def _cache_prompt(self, live: Live) -> None:
        """Once its prefill has computed the prompt's KV, give the prompt's whole pages to the
        tree, as SGLang does after a prefill (``cache_unfinished_req``): the write policy's
        device -> host copy of them then runs while the request decodes, not after it, and other
        requests can match them at once. The request goes on from the inserted path (its lock
        moved there from its prefix); a page the tree already held on the device is read from the
        tree's copy and the request's own freed.

        Before, a finished request held its whole context on the device until its copy was
        acknowledged: in the long-history bench at the H200 point with S3 the copies of a round's
        first wave (85 and 186 ms on this machine's cores) held the memory of its second wave.
        With ``AdmissionOrder.LPM``, file at that point, three runs each: 4.94 -> 4.73 s. In
        arrival order it lost (S3 13.9 -> 14.6 s): the copies' locks had been keeping the
        histories L1 held from eviction (see :mod:`hicache_core.admission`)."""
        assert live.own_slots is not None and live.node is not None
        ps = self.config.page_size
        full = len(live.request.tokens) // ps * ps  # every prompt token's KV exists after the prefill
        prefix = live.prefix_len
        if full <= prefix:
            return
        own = live.own_slots
        inserted = self._insert_computed(live, full)
        self.tree.move_lock(live.node, inserted.last_node)
        live.node = inserted.last_node
        live.prefix_slots = self.tree.device_slots(inserted.last_node)
        live.own_slots = own[full - prefix :]
        live.cached_prompt = full
        self.controller.on_insert(inserted)

    def _insert_computed(self, live: Live, full: int) -> InsertResult:
        """Give the tree ``live``'s first ``full`` tokens (whole pages whose KV exists) and free
        the request's own copy of the pages the tree already held on the device. Its prompt's
        pages, when the tree took them after the prefill (``cached_prompt``), get no second hit."""
        assert live.own_slots is not None
        inserted = self.tree.insert(live.sequence.prefix(full), live.context(full), counted=live.cached_prompt)
        duplicate = max(inserted.duplicate_length - live.prefix_len, 0)
        if duplicate:
            self.device_pool.allocator.free(live.own_slots[:duplicate])
        return inserted

    def _cache(self, live: Live) -> None:
        """Insert the whole pages whose KV was computed; free the request's other slots."""
        assert live.own_slots is not None and live.node is not None
        ps = self.config.page_size
        full = (len(live.sequence) - 1) // ps * ps  # the last output token has no KV yet
        prefix = live.prefix_len
        own = live.own_slots
        keep_until = max(full - prefix, 0)
        # Insert even when no page is new: the insert counts the hit that write_through_selective
        # backs up on, so a prompt sent again and again still reaches the host and storage.
        inserted = self._insert_computed(live, full) if full > 0 else None
        if own.numel() > keep_until:
            self.device_pool.allocator.free(own[keep_until:])
        if inserted is not None:
            self.runner.cache(live, inserted.last_node, full)
        else:
            self.runner.release(live)
        if live.session is not None:
            self.sessions.reference(live.session, inserted.last_node if inserted is not None else live.node)
        self.tree.unlock(live.node)
        live.node = None
        if inserted is not None:
            self.controller.on_insert(inserted)


def serve_conversations(engine: Engine, conversations: Sequence[Sequence[Sequence[int]]], max_new_tokens: int = 8) -> list[list[RequestResult]]:
    """Multi-turn serving with a barrier per round: round r's prompt of conversation c is c's
    history (prompts and outputs so far) followed by its r-th turn. Returns results per round."""
    histories: list[list[int]] = [[] for _ in conversations]
    rounds = max(len(turns) for turns in conversations)
    out: list[list[RequestResult]] = []
    for r in range(rounds):
        requests = []
        for c, turns in enumerate(conversations):
            if r < len(turns):
                requests.append((c, Request(f"c{c}-r{r}", histories[c] + list(turns[r]), max_new_tokens)))
        results = engine.serve([req for _, req in requests])
        for (c, req), res in zip(requests, results):
            histories[c] = req.tokens + res.output_ids
        out.append(results)
    return out


def make_conversations(clients: int, rounds: int, turn_tokens: int, vocab_size: int, seed: int = 0) -> list[list[list[int]]]:
    """Random turns: ``clients`` conversations of ``rounds`` turns of ``turn_tokens`` tokens each."""
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(0, vocab_size, (turn_tokens,), generator=gen).tolist() for _ in range(rounds)]
        for _ in range(clients)
    ]


__all__ = [
    "AdmissionOrder",
    "CacheMetrics",
    "CacheTiers",
    "Engine",
    "EngineCapacityError",
    "EngineConfig",
    "HybridPools",
    "Request",
    "RequestResult",
    "make_conversations",
    "serve_conversations",
]
