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
2. ``forward``: the prompt is prefilled in chunks of about a window, and the request holds SWA
   KV only for the pages its next chunk's window reads plus the windows the cache will keep
   (:mod:`.request_window`): its SWA memory is a few windows whatever its length, reserved when
   it starts. The model waits for each full-attention layer's load before computing it. It
   snapshots the recurrent state where a later request may resume (its *boundaries*): the end of
   what the tree held (a branch point), the last whole page of the prompt, and the end of the
   request's pages.
3. ``cache``: after the engine inserted the FULL KV, the window before each boundary becomes
   the SWA KV of the nodes holding it (other nodes of the request are tombstones), and each
   snapshot becomes the device checkpoint of the node ending there. The controller then backs
   every pool up by the write policy (and backfills checkpoints).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hicache_core.controller import WritePolicy
from hicache_core.hybrid.components import RecurrentState, SlidingWindow, attach
from hicache_core.hybrid.memory import KVMemory, StateMemory
from hicache_core.hybrid.model import FULL, HybridDecoder, HybridModelConfig
from hicache_core.hybrid.request_window import RequestWindow
from hicache_core.model import ModeledGPU, TinyDecoder
from hicache_core.op_thread import Wakeup
from hicache_core.pools import DevicePool, HostPool, KVGeometry
from hicache_core.radix_tree import RadixTree, TreeNode
from hicache_core.requests import EngineCapacityError, EngineConfig, Live, Request
from hicache_core.transfer import LayerLoad


@dataclass(eq=False)
class _RequestState:
    """A request's private hybrid state while it runs."""

    #: Where it resumed: it reads the window before it (``SlidingWindow.unread`` when done).
    resume: TreeNode
    #: Device SWA slots of positions ``[window_base, resume.end)`` (the tree's).
    window: torch.Tensor
    window_base: int
    own: RequestWindow
    state: torch.Tensor
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
        self.gpu: ModeledGPU | None = None  # a real forward pass (ModeledHybridRunner models one)

    def build(self, device: DevicePool, host: HostPool | None, wakeup: Wakeup | None = None) -> tuple[SlidingWindow | RecurrentState, ...]:
        c, m, sizes = self.config, self.model_config, self.config.hybrid
        host_pages = (sizes.swa_host_pages or host.num_pages) if host is not None else None
        swa_pages = sizes.swa_device_pages or device.num_pages
        self.swa = KVMemory(m.swa_geometry, c.page_size, swa_pages, host_pages, c.layout, c.device, wakeup)
        self.window = SlidingWindow.on(self.swa, m.window - 1)
        self.components: tuple[SlidingWindow | RecurrentState, ...] = (self.window,)
        self.checkpoints: RecurrentState | None = None
        if m.recurrent_layers:
            self.states = StateMemory(
                m.state_shape, m.dtype, sizes.device_checkpoints, sizes.host_checkpoints if host is not None else None, device.device, wakeup
            )
            self.checkpoints = RecurrentState.on(self.states)
            self.components += (self.checkpoints,)
        for component in self.components:
            component.write_back = host is not None and c.controller.write_policy is WritePolicy.WRITE_BACK
        self.model, self.draft_model = self._models(device.device)
        self.full_kv = device.kv[:, : m.full_layers]
        self.draft_kv = device.kv[:, m.full_layers :]
        return self.components

    def _models(self, device: torch.device) -> tuple[HybridDecoder, TinyDecoder | None]:
        """The model and its draft model (a modeled runner replaces them by their cost)."""
        m = self.model_config
        return HybridDecoder(m, device), TinyDecoder(m.draft_config(), device) if self.draft else None

    def attach(self, tree: RadixTree) -> None:
        self.tree = tree
        attach(tree, self.components)

    def check_fits(self, request: Request) -> None:
        ps = self.config.page_size
        prompt, total = len(request.tokens), len(request.tokens) + request.max_new_tokens - 1
        own = self._request_window(0, prompt, total, (prompt - 1) // ps * ps).peak()
        window_pages = -(-self.window.context_tokens // ps) + 1  # the window before a resume point, a node cut
        pages = own + window_pages
        if pages > self.swa.device.num_pages:
            raise EngineCapacityError(
                f"request {request.rid!r} needs {pages} pages of SWA KV on the device at once ({own} of its own, "
                f"{window_pages} read before its resume point) but the SWA device pool has {self.swa.device.num_pages}; "
                "raise EngineConfig.hybrid.swa_device_pages"
            )

    def _request_window(self, start: int, prompt: int, total: int, *boundaries: int) -> RequestWindow:
        ps, context = self.config.page_size, self.window.context_tokens
        chunk = max(ps, context // ps * ps)
        return RequestWindow(ps, context, chunk, start, prompt, total, {*boundaries, total // ps * ps})

    def begin(self, live: Live, node: TreeNode, load: LayerLoad | None, matched: int) -> TreeNode:
        assert self.model is not None
        if not self.window.materialize(node):
            if load is not None:
                load.wait_all()  # its pages may be evicted once the node is unlocked
            fallback = self.tree.resume_point(node, on_device=True)
            self.tree.lock(fallback)
            self.tree.unlock(node)
            node = fallback
            assert self.window.materialize(node), "a boundary accepted on the device has its window there"
        m, ps = self.model_config, self.config.page_size
        request = live.request
        prompt, total = len(request.tokens), len(request.tokens) + request.max_new_tokens - 1
        base = m.swa_first(node.end)
        # Where a later request may resume: the branch point (the end of what the tree held), the
        # last whole page of the prompt (the same prompt sent again), the end of the request's pages.
        own = self._request_window(node.end, prompt, total, matched, (prompt - 1) // ps * ps)
        state = self.model.new_state()
        if self.checkpoints is not None:
            state = self.checkpoints.state_at(node, state)
        live.model_state = _RequestState(node, self.window.device_window(node, base), base, own, state)
        return node

    def reserve(self, live: Live, tokens: int) -> bool:
        request: _RequestState = live.model_state
        ps, own = self.config.page_size, request.own
        slots = self.window.alloc(own.peak() * ps, device=True)
        if slots is None and len(own.boundaries) > 2:
            # Short of SWA memory: keep no window at the branch point rather than wait.
            own = request.own = self._request_window(own.start, own.prompt, own.total, (own.prompt - 1) // ps * ps)
            slots = self.window.alloc(own.peak() * ps, device=True)
        if slots is None:
            return False
        own.give(slots)
        return True

    def forward(self, live: Live, tokens: Sequence[int], length: int, load: LayerLoad | None, prefill: bool) -> int:
        assert self.model is not None
        m, request = self.model_config, live.model_state
        own: RequestWindow = request.own
        full_slots = live.context(length)
        position = length - len(tokens)

        def wait_layer(layer: int) -> None:
            if load is not None and m.layer_kinds[layer] == FULL:
                load.wait(m.pool_layer(layer))

        logits: torch.Tensor | None = None
        draft: torch.Tensor | None = None
        for begin, end in own.passes(position, length):
            ids = torch.tensor(list(tokens[begin - position : end - position]), dtype=torch.int64)
            swa = own.slots(begin, end, request.window, request.window_base)
            logits, taken = self.model.forward(
                ids, begin, self.full_kv, full_slots[:end], self.swa.device.kv, swa, request.state,
                [p for p in request.own.boundaries if begin < p <= end] if self.checkpoints is not None else [], wait_layer,
            )
            request.snapshots |= taken
            if self.draft_model is not None:
                if load is not None:
                    load.wait(m.full_layers)  # the draft model's layer of the FULL pool
                draft = self.draft_model.forward(ids, self.draft_kv, full_slots[begin:end], full_slots[:end])
            own.advance(end)
        assert logits is not None, "forward ran no pass"  # the engine calls it with at least one token
        if draft is not None:  # the draft model ran each pass
            live.result.draft_ids.append(int(draft[-1].argmax()))
        last = logits[-1].cpu()
        live.logits.append(last)
        return int(last.argmax())

    def cache(self, live: Live, last: TreeNode, cached: int) -> None:
        request: _RequestState = live.model_state
        own, ps = request.own, self.config.page_size
        self.tree.lock(last)  # nothing on the path may be evicted while the pools are filled in
        for boundary in sorted(own.boundaries):
            if boundary <= cached:  # kept windows start and end nodes
                self.tree.boundary(last, boundary)
                window_start = max(own.start, boundary - own.context) // ps * ps
                if window_start > own.start:
                    self.tree.boundary(last, window_start)
        for node in self.tree.path(last):
            begin = node.end - len(node.key)
            if begin >= own.start and not self.window.present(node, device=True):
                slots = own.take(begin, node.end)
                if slots is not None:
                    self.window.set(node, slots, device=True)
        if self.checkpoints is not None:
            self.checkpoints.insert(last, request.snapshots, self.states.device)
        self.tree.unlock(last)
        self.release(live)

    def release(self, live: Live) -> None:
        request: _RequestState | None = live.model_state
        if request is not None:
            leftover = request.own.leftover()
            if leftover.numel():
                self.swa.device_allocator.free(leftover)
            self.window.unread(request.resume)
        live.model_state = None

    def close(self) -> None:
        if self.model is not None:
            self.swa.close()
            if self.checkpoints is not None:
                self.states.close()
