"""A hybrid model on the engine: full-attention, sliding-window and recurrent layers, and a draft model.

The FULL pool holds the full-attention layers' KV and, as more layers of the same pool, the
draft model's KV (a sidecar: same slots, saved and restored with the FULL pages by
construction). Two components keep the rest (:mod:`.components`): the sliding-window KV
(:class:`SlidingWindow`, its own pools) and recurrent-state checkpoints (:class:`RecurrentState`).

Per request:

1. ``begin``: the engine has matched the prompt, picked the deepest boundary every component
   accepts (``RadixTree.resume_point``) and is loading its FULL KV layer by layer. The window's
   SWA KV is brought to the device, and the checkpoint at the boundary is **copied** into the
   request's private state (the model mutates it). If SWA device memory is short, the request
   resumes at the deepest boundary already on the device instead.
2. ``forward``: the model waits for each full-attention layer's load before computing it. It
   snapshots the recurrent state where a later request may resume: the end of what the tree
   held (a branch point), the last whole page of the prompt, and the end of the request's pages.
3. ``cache``: after the engine inserted the FULL KV, each node of the request's pages gets its
   SWA slots, and each snapshot becomes the device checkpoint of the node ending there. The
   controller then backs every pool up by the write policy (and backfills checkpoints).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hicache_core.controller import WritePolicy
from hicache_core.hybrid.components import KVMemory, RecurrentState, SlidingWindow, StateMemory, attach
from hicache_core.hybrid.model import FULL, HybridDecoder, HybridModelConfig
from hicache_core.model import TinyDecoder
from hicache_core.pools import DevicePool, HostPool, KVGeometry
from hicache_core.radix_tree import RadixTree, TreeNode
from hicache_core.requests import EngineCapacityError, EngineConfig, Live, Request
from hicache_core.transfer import LayerLoad


@dataclass(eq=False)
class _RequestState:
    """A request's private hybrid state while it runs."""

    #: Device SWA slots of positions ``[swa_base, ...)``: the window before the resume point, then its own.
    swa_slots: torch.Tensor
    swa_base: int
    #: Own SWA slots (the tail of ``swa_slots``), positions from the resume point on.
    own_swa: torch.Tensor
    state: torch.Tensor
    wanted: set[int]
    snapshots: dict[int, torch.Tensor] = field(default_factory=dict)


class HybridRunner:
    """Serves a :class:`HybridDecoder` (and its draft model) on the engine's pools and tree."""

    replicated = False

    def __init__(self, config: EngineConfig) -> None:
        model = config.model
        assert isinstance(model, HybridModelConfig)
        if config.compute is not None:
            raise ValueError("modeled compute is for FULL-only models (ModelConfig); a hybrid model runs its reference decoder")
        sizes = config.hybrid
        for name in ("swa_device_pages", "swa_host_pages", "device_checkpoints", "host_checkpoints"):
            value = getattr(sizes, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"HybridPools.{name} must be a positive int, got {value!r}")
        self.config = config
        self.model_config = model
        self.draft = sizes.draft
        full = model.full_geometry
        self.geometry = KVGeometry(full.layers + (1 if self.draft else 0), full.kv_heads, full.head_dim, full.dtype)
        #: Values carry the draft KV when there is a draft model: engines with and without keep apart.
        self.kv_part = "kv_draft" if self.draft else "kv"
        self.model: HybridDecoder | None = None

    def build(self, device: DevicePool, host: HostPool | None) -> tuple[SlidingWindow | RecurrentState, ...]:
        c, m, sizes = self.config, self.model_config, self.config.hybrid
        host_pages = (sizes.swa_host_pages or host.num_pages) if host is not None else None
        swa_pages = sizes.swa_device_pages or device.num_pages
        self.swa = KVMemory(m.swa_geometry, c.page_size, swa_pages, host_pages, c.layout, c.device)
        self.window = SlidingWindow.on(self.swa, m.window - 1)
        self.components: tuple[SlidingWindow | RecurrentState, ...] = (self.window,)
        self.checkpoints: RecurrentState | None = None
        if m.recurrent_layers:
            self.states = StateMemory(
                m.state_shape, m.dtype, sizes.device_checkpoints, sizes.host_checkpoints if host is not None else None, device.device
            )
            self.checkpoints = RecurrentState.on(self.states)
            self.components += (self.checkpoints,)
        for component in self.components:
            component.write_back = host is not None and c.controller.write_policy is WritePolicy.WRITE_BACK
        self.model = HybridDecoder(m, device.device)
        self.draft_model = TinyDecoder(m.draft_config(), device.device) if self.draft else None
        self.full_kv = device.kv[:, : m.full_layers]
        self.draft_kv = device.kv[:, m.full_layers :]
        return self.components

    def attach(self, tree: RadixTree) -> None:
        self.tree = tree
        attach(tree, self.components)

    def check_fits(self, request: Request) -> None:
        ps = self.config.page_size
        pages = -(-(len(request.tokens) + request.max_new_tokens - 1) // ps)
        if pages > self.swa.device.num_pages:
            raise EngineCapacityError(
                f"request {request.rid!r} needs {pages} pages of SWA KV on the device but the SWA device pool has "
                f"{self.swa.device.num_pages}; raise EngineConfig.hybrid.swa_device_pages or shorten the request"
            )

    def begin(self, live: Live, node: TreeNode, load: LayerLoad | None, matched: int) -> TreeNode:
        assert self.model is not None
        if not self.window.materialize(node):
            if load is not None:
                load.wait_all()  # its pages may be evicted once the node is unlocked
            fallback = self.tree.resume_point(node, on_device=True)
            self.tree.lock(fallback)
            self.tree.unlock(node)
            node = fallback
        m, ps = self.model_config, self.config.page_size
        request = live.request
        total = len(request.tokens) + request.max_new_tokens - 1  # positions that get KV
        prompt_end = (len(request.tokens) - 1) // ps * ps
        base = m.swa_first(node.end)
        window = self.window.device_window(node, base)
        state, wanted = self.model.new_state(), set()
        if self.checkpoints is not None:
            state = self.checkpoints.state_at(node, state)
            wanted = {p for p in (matched, prompt_end, total // ps * ps) if p > node.end}
        live.model_state = _RequestState(window, base, window[:0], state, wanted)
        return node

    def reserve(self, live: Live, tokens: int) -> bool:
        state: _RequestState = live.model_state
        own = self.window.alloc(tokens, device=True)
        if own is None:
            return False
        state.own_swa = own
        state.swa_slots = torch.cat([state.swa_slots, own])
        return True

    def forward(self, live: Live, tokens: Sequence[int], length: int, load: LayerLoad | None, prefill: bool) -> int:
        assert self.model is not None
        m, state = self.model_config, live.model_state
        position = length - len(tokens)
        full_slots = live.context(length)
        swa = state.swa_slots[m.swa_first(position) - state.swa_base : length - state.swa_base]
        ids = torch.tensor(list(tokens), dtype=torch.int64)

        def wait_layer(layer: int) -> None:
            if load is not None and m.layer_kinds[layer] == FULL:
                load.wait(m.pool_layer(layer))

        logits, taken = self.model.forward(
            ids, position, self.full_kv, full_slots, self.swa.device.kv, swa, state.state,
            [p for p in state.wanted if position < p <= length], wait_layer,
        )
        state.snapshots |= taken
        if self.draft_model is not None:
            if load is not None:
                load.wait(m.full_layers)  # the draft model's layer of the FULL pool
            draft = self.draft_model.forward(ids, self.draft_kv, full_slots[position:], full_slots)
            live.result.draft_ids.append(int(draft[-1].argmax()))
        last = logits[-1].cpu()
        live.logits.append(last)
        return int(last.argmax())

    def cache(self, live: Live, last: TreeNode, cached: int) -> None:
        state: _RequestState = live.model_state
        start = live.prefix_len
        self.tree.lock(last)  # nothing on the path may be evicted while the pools are filled in
        unused = self.window.insert(self.tree.path(last), start, state.own_swa)
        if state.own_swa.numel() > cached - start:
            unused.append(state.own_swa[max(cached - start, 0) :])
        if unused:
            self.swa.device_allocator.free(torch.cat(unused))
        if self.checkpoints is not None:
            self.checkpoints.insert(last, state.snapshots, self.states.device)
        self.tree.unlock(last)
        live.model_state = None

    def release(self, live: Live) -> None:
        state: _RequestState | None = live.model_state
        if state is not None and state.own_swa.numel():
            self.swa.device_allocator.free(state.own_swa)
        live.model_state = None

    def close(self) -> None:
        if self.model is not None:
            self.swa.close()
