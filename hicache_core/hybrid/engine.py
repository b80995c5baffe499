"""The hybrid reference engine: a hybrid model served through L1, L2 and L3, every pool kept consistent.

A hybrid model's cache is several pools: the full-attention KV (FULL, every token), the
sliding-window KV (SWA, only the window before a position is read), recurrent-state checkpoints
(MAMBA, valid at one exact boundary) and the draft model's KV (a sidecar following the FULL
pool's slots, never voting on a hit). One radix tree holds them all (:mod:`.components`). A
request resumes at the deepest boundary every component accepts, after bringing what that
boundary needs to the device:

* FULL KV of the whole prefix, with the draft KV of the same slots;
* SWA KV of the window before the boundary (nodes outside it may be tombstones);
* the checkpoint at the boundary, copied to the request's private state before it runs on.

The request then snapshots the recurrent state where checkpoints will be useful: at the end of
what the tree held already (a new branch point: the next request diverging there resumes from
it), at the last whole page of its prompt (the same prompt sent again) and at the end of its
own whole pages. Backups copy every pool: the write policy decides when a node's FULL KV goes
to the host, and its components go with it; **backfill** backs up a component's state that
appears later on a node already backed up (a branch checkpoint), alone. L3 holds one key per
page per pool (:class:`~hicache_storage.multipool.MultiPoolStore`): "kv" ("kv_draft" when the
draft KV rides in the same value), "swa" (trailing window pages) and "mamba" (the checkpoint at
a cut, keyed by its last page).

Compared with :class:`hicache_core.engine.Engine` this engine is deliberately plain: requests
run one after another, and tier copies and storage I/O run on the calling thread, synchronously.
It exists to prove the hybrid cache exact (outputs bit-identical with and without each tier),
not to measure throughput. Single-threaded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_storage.backend import StorageBackend
from hicache_storage.keys import KeyScope, Namespace, page_hashes
from hicache_storage.multipool import HitPolicy, MultiPoolStore, PoolSpec
from hicache_storage.registry import create_backend
from hicache_storage.wrappers.timeout import TimeoutWrapper

from hicache_core.controller import WritePolicy
from hicache_core.engine import CacheTiers, EngineCapacityError, Request, RequestResult
from hicache_core.hybrid.components import PooledComponent, RecurrentState, SlidingWindow, attach
from hicache_core.hybrid.model import HybridDecoder, HybridModelConfig
from hicache_core.metrics import CacheMetrics
from hicache_core.model import TinyDecoder
from hicache_core.pools import DevicePool, HostPool, KVGeometry, PageAllocator
from hicache_core.radix_tree import RadixTree, TreeNode
from hicache_core.sessions import SessionTable, SessionTicket
from hicache_core.storage_calls import guarded_call
from hicache_core.transfer import Transfers


@dataclass
class HybridEngineConfig:
    model: HybridModelConfig = field(default_factory=HybridModelConfig)
    tiers: CacheTiers = CacheTiers.L1_L2
    page_size: int = 8
    #: FULL KV pages (the draft model's KV has as many: it follows the FULL slots).
    device_pages: int = 256
    host_pages: int = 512
    #: SWA KV pages; default: as many as the FULL pool (a smaller pool tombstones more).
    swa_device_pages: int | None = None
    swa_host_pages: int | None = None
    #: Recurrent-state checkpoint slots.
    device_checkpoints: int = 64
    host_checkpoints: int = 128
    layout: str = "page_first"
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    selective_hits: int = 2
    #: Back up a component's state that appears on a node already backed up (see the module docstring).
    backfill: bool = True
    #: Run the draft model beside the target (its KV is a sidecar of the FULL pool).
    draft: bool = True
    storage_backend: str | None = None
    storage_config: dict[str, Any] | None = None
    #: Longest wait for one storage call (a failing or hanging store means a miss, never a crash).
    storage_timeout_s: float | None = 5.0
    tenant: str | None = None
    revision: str | None = None
    device: str | None = None


@dataclass
class HybridResult(RequestResult):
    #: The draft model's greedy proposal at each generated position (it depends on the draft
    #: KV of the whole context, so a wrongly restored sidecar shows here).
    draft_ids: list[int] = field(default_factory=list)


def _check_sizes(config: HybridEngineConfig) -> None:
    """Every pool the tiers use needs room: a zero-sized one is a configuration mistake, named here."""
    sizes = {"device_pages": config.device_pages, "device_checkpoints": config.device_checkpoints}
    if config.swa_device_pages is not None:
        sizes["swa_device_pages"] = config.swa_device_pages
    if config.tiers.host:
        sizes |= {"host_pages": config.host_pages, "host_checkpoints": config.host_checkpoints}
        if config.swa_host_pages is not None:
            sizes["swa_host_pages"] = config.swa_host_pages
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"HybridEngineConfig.{name} must be a positive int for tiers {config.tiers.value}, got {value!r}")


class _KVTiers:
    """One KV-shaped pool on the device and (optionally) the host, with the copies between them."""

    def __init__(self, geometry: KVGeometry, config: HybridEngineConfig, device_pages: int, host_pages: int | None) -> None:
        self.device = DevicePool(geometry, device_pages, config.page_size, config.device)
        self.host = HostPool(geometry, config.page_size, config.layout, num_pages=host_pages) if host_pages else None
        self.transfers = Transfers(self.device, self.host) if self.host is not None else None

    def to_host(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        assert self.transfers is not None
        event = self.transfers.backup(device_slots, host_slots)
        if event is not None:
            event.synchronize()

    def to_device(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        assert self.transfers is not None
        self.transfers.load(device_slots, host_slots, lambda _: None).wait_all()

    def close(self) -> None:
        if self.transfers is not None:
            self.transfers.close()
        if self.host is not None:
            self.host.close()


class _StateTiers:
    """Recurrent-state checkpoints: one ``state_shape`` tensor per slot, on the device and the host."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, device_slots: int, host_slots: int | None, device: torch.device) -> None:
        self.device = torch.zeros((device_slots, *shape), dtype=dtype, device=device)
        self.host = torch.zeros((host_slots or 0, *shape), dtype=dtype)
        self.device_allocator = PageAllocator(device_slots, 1)
        self.host_allocator = PageAllocator(host_slots, 1) if host_slots else None


class HybridEngine:
    """Serves requests with a :class:`HybridDecoder` through the tiers ``config`` selects."""

    def __init__(self, config: HybridEngineConfig, storage: StorageBackend | None = None) -> None:
        _check_sizes(config)
        self.config = config
        m, ps = config.model, config.page_size
        host = config.tiers.host
        self.model = HybridDecoder(m, config.device or "cpu")
        self.full = _KVTiers(m.full_geometry, config, config.device_pages, config.host_pages if host else None)
        self.swa = _KVTiers(
            m.swa_geometry,
            config,
            config.device_pages if config.swa_device_pages is None else config.swa_device_pages,
            (config.host_pages if config.swa_host_pages is None else config.swa_host_pages) if host else None,
        )
        draft_config = m.draft_config()
        self.draft_model = TinyDecoder(draft_config, self.full.device.device) if config.draft else None
        self.draft = (
            _KVTiers(draft_config.geometry, config, config.device_pages, config.host_pages if host else None)
            if config.draft
            else None
        )
        self.states = _StateTiers(
            m.state_shape, m.dtype, config.device_checkpoints, config.host_checkpoints if host else None, self.full.device.device
        )
        #: Tokens before a resume point that sliding-window layers read.
        self.window_tokens = m.window - 1
        self.window = SlidingWindow(
            self.window_tokens, self.swa.device.allocator, self.swa.host.allocator if self.swa.host else None
        )
        self.checkpoints = RecurrentState(self.states.device_allocator, self.states.host_allocator)
        self.components: tuple[PooledComponent, ...] = (self.window, self.checkpoints)
        self.tree = RadixTree(
            ps,
            free_device=self.full.device.allocator.free,
            free_host=self.full.host.allocator.free if self.full.host else None,
            components=self.components,
        )
        attach(self.tree, self.components)
        self.sessions = SessionTable(self.tree)
        self.metrics = CacheMetrics()
        self.store: MultiPoolStore | None = None
        if config.tiers.storage:
            if storage is None:
                if config.storage_backend is None:
                    raise ValueError("tiers L1+L2+L3 need storage: pass a backend or set storage_backend")
                storage = create_backend(config.storage_backend, config.storage_config)
            if config.storage_timeout_s is not None:
                storage = TimeoutWrapper(storage, {"seconds": config.storage_timeout_s})
            self.store = MultiPoolStore(storage, self.key_scope, self.pool_specs)

    # --- public API ---------------------------------------------------------------------------

    @property
    def key_scope(self) -> KeyScope:
        c = self.config
        namespace = Namespace(c.model.name, c.model.full_geometry.dtype_name, c.page_size, c.layout, revision=c.revision, tenant=c.tenant)
        return KeyScope(namespace)

    @property
    def kv_pool(self) -> str:
        """The KV pool's name in L3: its values carry the draft KV when there is a draft model, so
        engines with and without one keep apart (their values differ in length)."""
        return "kv_draft" if self.draft is not None else "kv"

    @property
    def pool_specs(self) -> list[PoolSpec]:
        """The L3 pools: KV (all pages, with the draft KV as a sidecar), SWA window, checkpoint."""
        window_pages = max(1, -(-self.window_tokens // self.config.page_size))
        return [
            PoolSpec(self.kv_pool, HitPolicy.ALL_PAGES),
            PoolSpec("swa", HitPolicy.TRAILING_PAGES, window_pages),
            PoolSpec("mamba", HitPolicy.TRAILING_PAGES, 1),
        ]

    def serve(self, requests: Sequence[Request]) -> list[HybridResult]:
        """Run ``requests`` one after another; their results in order (none runs if one is invalid)."""
        for request in requests:
            request.check()
        tickets = [self.sessions.ticket(r.session_id) if r.session_id is not None else None for r in requests]
        return [self._run(request, ticket) for request, ticket in zip(requests, tickets)]

    def close_session(self, session_id: str) -> bool:
        """Drop the session's references (its cached data stays, evicted like any other); whether it was open."""
        return self.sessions.close(session_id)

    def flush_cache(self) -> None:
        """Empty L1 and L2 (write-back backs up first); L3 keeps its pages."""
        backup = self._backup_node if self._write_back else None
        while self.tree.evict_device(1 << 62, backup) + (self.tree.evict_host(1 << 62) if self.full.host else 0):
            pass

    def close(self) -> None:
        for tiers in (self.full, self.swa, self.draft):
            if tiers is not None:
                tiers.close()
        if self.store is not None:
            self.store.backend.close()

    def __enter__(self) -> HybridEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- one request --------------------------------------------------------------------------

    def _run(self, request: Request, ticket: SessionTicket | None) -> HybridResult:
        started = time.perf_counter()
        result = HybridResult(request.rid, len(request.tokens))
        node, branch = self._resume(request, result)
        try:
            cached = self._compute(request, result, node, branch, started)
        finally:
            self.tree.unlock(node)
        if ticket is not None and cached is not None:
            self.sessions.reference(ticket, cached)
        result.latency_s = time.perf_counter() - started
        self.metrics.add(
            prompt_tokens=result.prompt_tokens,
            device_hit_tokens=result.cached_device,
            host_hit_tokens=result.cached_host,
            storage_hit_tokens=result.cached_storage,
            computed_tokens=result.computed,
        )
        return result

    def _resume(self, request: Request, result: HybridResult) -> tuple[TreeNode, int]:
        """Find, fetch and bring to the device the deepest usable boundary; returns it locked,
        and the FULL prefix the tree holds (where a new branch checkpoint belongs)."""
        root = self.tree.root
        if self.config.tiers is CacheTiers.OFF:
            self.tree.lock(root)
            return root, 0
        matchable = request.tokens[:-1]
        match = self.tree.match_prefix(matchable)
        local = self.tree.resume_point(match.host_node, on_device=False)
        if self.store is not None:
            self.tree.lock(match.host_node)  # what the tree has must not be evicted to make room for the fetch
            try:
                self._fetch(matchable, match.host_node, local)
            finally:
                self.tree.unlock(match.host_node)
            match = self.tree.match_prefix(matchable)
        node = self.tree.resume_point(match.host_node, on_device=False)
        on_device = node
        while on_device.device_value is None:
            on_device = on_device.parent  # type: ignore[assignment]
        on_device = self.tree.resume_point(on_device, on_device=True)
        self.tree.lock(node)
        if not self._materialize(node):
            self.tree.unlock(node)
            node = on_device
            self.tree.lock(node)
        result.cached_device = on_device.end
        result.cached_storage = max(0, node.end - max(local.end, on_device.end))
        result.cached_host = node.end - result.cached_device - result.cached_storage
        return node, match.matched_length

    def _materialize(self, node: TreeNode) -> bool:
        """Bring what resuming at ``node`` needs onto the device; False if device memory is short."""
        missing = [n for n in self.tree.path(node) if n.device_value is None]  # a tail: device copies are prefix-closed
        if missing:
            tokens = sum(len(n.key) for n in missing)
            slots = self._alloc_full(tokens)
            if slots is None:
                return False
            offset = 0
            for n in missing:
                assert n.host_value is not None
                part = slots[offset : offset + len(n.key)]
                self.full.to_device(part, n.host_value)
                if self.draft is not None:
                    self.draft.to_device(part, n.host_value)
                n.device_value = part
                offset += len(n.key)
        for n in self.window.window(node):
            if not self.window.present(n, device=True):
                host_slots = self.window.slots(n, device=False)
                device_slots = self.window.alloc(len(n.key), device=True)
                if device_slots is None or host_slots is None:
                    return False
                self.swa.to_device(device_slots, host_slots)
                self.window.set(n, device_slots, device=True)
        return True

    def _compute(self, request: Request, result: HybridResult, node: TreeNode, branch: int, started: float) -> TreeNode | None:
        """Prefill from ``node.end``, decode, and cache what was computed (all pools); returns
        the deepest node of the request's path in the tree (None with caching off)."""
        m, ps = self.config.model, self.config.page_size
        start = node.end
        total = len(request.tokens) + request.max_new_tokens - 1  # positions that get KV
        result.computed = len(request.tokens) - start
        prefix = self.tree.device_slots(node)
        swa_prefix = self._window_slots(node)
        own = self._alloc_full(total - start)
        own_swa = self.window.alloc(total - start, device=True) if own is not None else None
        if own is None or own_swa is None:
            if own is not None:
                self.full.device.allocator.free(own)
            raise EngineCapacityError(
                f"request {request.rid!r} needs {total - start} new token slots in the FULL and SWA device pools; "
                "raise device_pages / swa_device_pages"
            )
        state = self._checkpoint(node)
        # Checkpoints where a later request may resume: the branch point, the last whole page of
        # the prompt's matchable part (the same prompt sent again), and the end of what is cached.
        prompt_end = (len(request.tokens) - 1) // ps * ps
        wanted = {p for p in (branch, prompt_end, total // ps * ps) if p > start}
        snapshots: dict[int, torch.Tensor] = {}
        full_slots = torch.cat([prefix, own])
        swa_slots = torch.cat([swa_prefix, own_swa])
        swa_base = m.swa_first(start)
        tokens = list(request.tokens)
        position, ids = start, tokens[start:]
        logits = []
        while True:
            end = position + len(ids)
            batch = torch.tensor(ids, dtype=torch.int64)
            out, taken = self.model.forward(
                batch, position, self.full.device.kv, full_slots[:end], self.swa.device.kv,
                swa_slots[m.swa_first(position) - swa_base : end - swa_base], state,
                [p for p in wanted if position < p <= end],
            )
            snapshots |= taken
            if self.draft_model is not None and self.draft is not None:
                draft = self.draft_model.forward(batch, self.draft.device.kv, full_slots[position:end], full_slots[:end])
                result.draft_ids.append(int(draft[-1].argmax()))
            logits.append(out[-1])
            result.output_ids.append(int(out[-1].argmax()))
            if len(result.output_ids) == 1:
                result.ttft_s = time.perf_counter() - started
            if len(result.output_ids) == request.max_new_tokens:
                break
            position, ids = end, [result.output_ids[-1]]
        result.logits = torch.stack(logits).cpu()
        return self._cache(tokens + result.output_ids[:-1], node, prefix, own, own_swa, snapshots)

    def _cache(
        self,
        with_kv: list[int],
        node: TreeNode,
        prefix: torch.Tensor,
        own: torch.Tensor,
        own_swa: torch.Tensor,
        snapshots: dict[int, torch.Tensor],
    ) -> TreeNode | None:
        """Insert the computed whole pages: FULL slots, SWA slots, checkpoints; then back them up."""
        ps, start = self.config.page_size, node.end
        full = len(with_kv) // ps * ps
        if self.config.tiers is CacheTiers.OFF or full <= start:
            self.full.device.allocator.free(own)
            self.swa.device.allocator.free(own_swa)
            return None if self.config.tiers is CacheTiers.OFF else node
        inserted = self.tree.insert(with_kv[:full], torch.cat([prefix, own[: full - start]]))
        duplicate = max(inserted.duplicate_length - start, 0)
        if duplicate:
            self.full.device.allocator.free(own[:duplicate])
        if own.numel() > full - start:
            self.full.device.allocator.free(own[full - start :])
        last = inserted.last_node
        self.tree.lock(last)  # nothing below may be evicted while the pools are filled in
        unused_swa = self.window.insert(self.tree.path(last), start, own_swa)
        if own_swa.numel() > full - start:
            unused_swa.append(own_swa[full - start :])
        if unused_swa:
            self.swa.device.allocator.free(torch.cat(unused_swa))
        self.checkpoints.insert(last, snapshots, self.states.device)
        self._write(self.tree.path(last))  # after the checkpoints' boundaries cut nodes
        self.tree.unlock(last)
        return last

    # --- backups: device -> host -> storage ---------------------------------------------------

    @property
    def _write_back(self) -> bool:
        return self.full.host is not None and self.config.write_policy is WritePolicy.WRITE_BACK

    def _write(self, path: list[TreeNode]) -> None:
        """Apply the write policy (and backfill) to the nodes of a request's path."""
        if self.full.host is None:
            return
        policy = self.config.write_policy
        for n in path:
            if n.host_value is None:
                if policy is WritePolicy.WRITE_THROUGH or (
                    policy is WritePolicy.WRITE_THROUGH_SELECTIVE and n.hit_count >= self.config.selective_hits
                ):
                    self._backup_node(n)
            elif self.config.backfill:
                self._backup_components(n)

    def _backup_node(self, node: TreeNode) -> bool:
        """Copy ``node``'s FULL (and draft) KV and its components' state to the host, then to L3."""
        assert node.device_value is not None
        host_slots = self._alloc_host_full(len(node.key))
        if host_slots is None:
            return False
        self.full.to_host(node.device_value, host_slots)
        if self.draft is not None:
            self.draft.to_host(node.device_value, host_slots)
        node.host_value = host_slots
        self._put(self.kv_pool, node.page_hashes, self._kv_segments(host_slots))
        self._backup_components(node)
        return True

    def _backup_components(self, node: TreeNode) -> None:
        """Copy each component's device state that the host lacks (the backfill), then to L3."""
        if self.window.present(node, device=True) and self.window.slots(node, device=False) is None:
            device_slots = self.window.slots(node, device=True)
            host_slots = self.window.alloc(len(node.key), device=False)
            if device_slots is not None and host_slots is not None:
                self.swa.to_host(device_slots, host_slots)
                self.window.set(node, host_slots, device=False)
                assert self.swa.host is not None
                self._put("swa", node.page_hashes, self.swa.host.segments_for(host_slots))
        device_slot = self.checkpoints.slots(node, device=True)
        if device_slot is not None and self.checkpoints.slots(node, device=False) is None:
            host_slot = self.checkpoints.alloc(1, device=False)
            if host_slot is not None:
                self.states.host[host_slot] = self.states.device[device_slot].cpu()
                self.checkpoints.set(node, host_slot, device=False)
                self._put("mamba", [node.page_hashes[-1]], [self.states.host[int(host_slot)]])

    def _put(self, pool: str, hashes: list[str], buffers: list[Any]) -> None:
        """Store pages of one pool; a failure is counted and logged, and the pages stay uncached in L3."""
        if self.store is None:
            return
        store = self.store
        stored = guarded_call(self.metrics, lambda: store.put(pool, hashes, buffers), [False] * len(hashes), "put")
        self.metrics.add(storage_backup_pages=sum(stored), storage_backup_failed_batches=int(not all(stored)))

    # --- reads: storage -> host ---------------------------------------------------------------

    def _fetch(self, tokens: list[int], matched: TreeNode, local: TreeNode) -> None:
        """Bring from L3 what resuming past ``local`` needs, if L3 can restore a longer prefix:
        the FULL pages the tree lacks, the SWA window and the checkpoint at the cut. A miss on
        any of them leaves the tree as it was for that pool (the request resumes earlier)."""
        assert self.store is not None and self.full.host is not None
        ps = self.config.page_size
        hashes = page_hashes(tokens[: len(tokens) // ps * ps], ps)
        store = self.store
        cut = guarded_call(self.metrics, lambda: store.usable_pages(hashes), 0, "exists")
        end = cut * ps
        if end <= local.end:
            return
        held = matched.end
        if end > held:
            slots = self._alloc_host_full(end - held)
            if slots is None:
                return
            if not self._get(self.kv_pool, hashes[held // ps : cut], self._kv_segments(slots)):
                self.full.host.allocator.free(slots)
                return
            placed = self.tree.insert_host(tokens[:end], held, slots)
            if placed is None:
                self.full.host.allocator.free(slots)
                return
            for unused in placed.unused:
                self.full.host.allocator.free(unused)
        match = self.tree.match_prefix(tokens[:end])
        node = self.tree.boundary(match.host_node, end)
        self.tree.lock(node)
        try:
            window_start = max(0, cut - self.store.pools["swa"].trailing_pages) * ps
            self.tree.boundary(node, window_start)
            for n in self.window.window(node):
                if n.end - len(n.key) < window_start or self.window.present(n, device=False):
                    continue
                if not self._fetch_into(self.window, n, "swa", n.page_hashes, len(n.key)):
                    return
            if not self.checkpoints.present(node, device=False):
                self._fetch_into(self.checkpoints, node, "mamba", [node.page_hashes[-1]], 1)
        finally:
            self.tree.unlock(node)

    def _fetch_into(self, component: PooledComponent, node: TreeNode, pool: str, keys: list[str], count: int) -> bool:
        assert self.store is not None
        slots = component.alloc(count, device=False)
        if slots is None:
            return False
        if component is self.window:
            assert self.swa.host is not None
            buffers: list[Any] = self.swa.host.segments_for(slots)
        else:
            buffers = [self.states.host[int(slots)]]
        if not self._get(pool, keys, buffers):
            assert component.host_allocator is not None
            component.host_allocator.free(slots)
            return False
        component.set(node, slots, device=False)
        return True

    def _get(self, pool: str, hashes: list[str], buffers: list[Any]) -> bool:
        """Read pages of one pool; True only if every page arrived (a failure is a miss, counted)."""
        assert self.store is not None
        store = self.store
        found = guarded_call(self.metrics, lambda: store.get_into(pool, hashes, buffers), [False] * len(hashes), "get")
        self.metrics.add(prefetch_pages=sum(found), prefetch_failed_batches=int(not all(found)))
        return all(found)

    # --- memory -------------------------------------------------------------------------------

    def _alloc_full(self, tokens: int) -> torch.Tensor | None:
        backup = self._backup_node if self._write_back else None
        return self.full.device.allocator.alloc_evicting(tokens, lambda n: self.tree.evict_device(n, backup))

    def _alloc_host_full(self, tokens: int) -> torch.Tensor | None:
        assert self.full.host is not None
        return self.full.host.allocator.alloc_evicting(tokens, self.tree.evict_host)

    def _kv_segments(self, host_slots: torch.Tensor) -> list[list[torch.Tensor]]:
        """Per page: the FULL KV's segments, then the draft KV's (the sidecar rides with its source)."""
        assert self.full.host is not None
        pages = self.full.host.segments_for(host_slots)
        if self.draft is None:
            return pages
        assert self.draft.host is not None
        return [kv + draft for kv, draft in zip(pages, self.draft.host.segments_for(host_slots))]

    def _window_slots(self, node: TreeNode) -> torch.Tensor:
        """Device SWA slots of positions ``[swa_first(node.end), node.end)``."""
        needed = node.end - self.config.model.swa_first(node.end)
        parts = [self.window.slots(n, device=True) for n in self.window.window(node)]
        assert all(p is not None for p in parts), "the window was not brought to the device"
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)  # type: ignore[arg-type]
        return slots[slots.numel() - needed :]

    def _checkpoint(self, node: TreeNode) -> torch.Tensor:
        """A private copy of the recurrent state at ``node.end`` (the tree's checkpoint stays intact)."""
        if node is self.tree.root:
            return self.model.new_state()
        device_slot = self.checkpoints.slots(node, device=True)
        if device_slot is not None:
            return self.states.device[int(device_slot)].clone()
        host_slot = self.checkpoints.slots(node, device=False)
        assert host_slot is not None, f"{node} was accepted without a checkpoint"
        # ``copy=True``: on the CPU ``to`` would return the checkpoint itself, and the model mutates it.
        return self.states.host[int(host_slot)].to(self.states.device.device, copy=True)


__all__ = ["HybridEngine", "HybridEngineConfig", "HybridResult"]
