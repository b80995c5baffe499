"""The model side of the engine: what a model adds to the FULL KV pool, and its forward pass.

The engine schedules requests, matches prefixes and moves KV through the tiers the same way for
every model; a :class:`ModelRunner` says what else a model keeps and how it computes:

* ``geometry``: the FULL pool's token geometry (a sidecar such as a draft model's KV is more
  layers of it, so it moves with the FULL pages);
* ``components``: the tree components holding the model's other state (none for a FULL-only
  model; see :mod:`hicache_core.hybrid.components`);
* per request: ``begin`` (bring the resume point's component state to the device), ``reserve``
  (component slots for the new tokens), ``forward``, ``cache`` (components' state of the pages
  the tree just took), ``release``.

:class:`DenseRunner` serves a :class:`~hicache_core.model.TinyDecoder`, or sleeps for a
:class:`~hicache_core.model.ModeledCompute`'s cost; :class:`hicache_core.hybrid.runner.HybridRunner`
serves a :class:`~hicache_core.hybrid.model.HybridDecoder` and its draft model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from hicache_core.model import ModelConfig, ModeledCompute, ModeledGPU, TinyDecoder
from hicache_core.op_thread import Wakeup
from hicache_core.pools import DevicePool, HostPool, KVGeometry
from hicache_core.radix_tree import Component, RadixTree, TreeNode
from hicache_core.requests import EngineConfig, Live, Request
from hicache_core.transfer import LayerLoad


class ModelRunner(Protocol):
    geometry: KVGeometry
    #: The FULL pool's L3 key part.
    kv_part: str
    #: Whether the FULL KV is the same on every TP rank (MLA): only one rank writes it to L3.
    replicated: bool
    #: With modeled compute, the accelerator its cost is taken on (the engine runs decode steps
    #: on it and reads when a prefill's first token exists); None for a real forward pass.
    gpu: ModeledGPU | None

    def build(self, device: DevicePool, host: HostPool | None, wakeup: Wakeup | None = None) -> tuple[Component, ...]:
        """Create the model and its components (their memory beside the engine's pools, their
        copies notifying ``wakeup`` as they end); once."""

    def attach(self, tree: RadixTree) -> None:
        """Serve on ``tree``, which was made with the components ``build`` returned."""

    def check_fits(self, request: Request) -> None:
        """Raise :class:`EngineCapacityError` for a request no component pool can ever hold."""

    def begin(self, live: Live, node: TreeNode, load: LayerLoad | None, matched: int) -> TreeNode:
        """Prepare the request to resume at ``node`` (locked, its FULL KV on the device or
        loading); returns the node it resumes at, locked (``node``, or an ancestor when a
        component's device memory is short). ``matched``: the FULL prefix the tree holds."""

    def reserve(self, live: Live, tokens: int) -> bool:
        """Component slots for the request's ``tokens`` new positions; False if memory is short."""

    def forward(self, live: Live, tokens: Sequence[int], length: int, load: LayerLoad | None, prefill: bool) -> int:
        """Compute ``tokens`` (the last of a ``length``-token context); the next token."""

    def cache(self, live: Live, last: TreeNode, cached: int) -> None:
        """The tree took the request's first ``cached`` positions (path to ``last``, locked):
        give components their state of them, and free the request's other component slots."""

    def release(self, live: Live) -> None:
        """Free the request's component slots (nothing of it is cached)."""

    def close(self) -> None: ...


class DenseRunner:
    """A FULL-only model: no components; the reference decoder, or a modeled cost."""

    def __init__(self, config: EngineConfig) -> None:
        model = config.model
        assert isinstance(model, ModelConfig)
        self.config = config
        self.model_config = model
        self.geometry = model.geometry
        self.kv_part = "kv"
        self.replicated = model.mla
        self.compute: ModeledCompute | None = config.compute
        self.gpu: ModeledGPU | None = config.compute.gpu() if config.compute is not None else None
        self.model: TinyDecoder | None = None
        self.kv: torch.Tensor | None = None

    def build(self, device: DevicePool, host: HostPool | None, wakeup: Wakeup | None = None) -> tuple[Component, ...]:
        self.kv = device.kv
        if self.compute is None:
            self.model = TinyDecoder(self.model_config, device.device)
        return ()

    def attach(self, tree: RadixTree) -> None:
        return None

    def check_fits(self, request: Request) -> None:
        return None

    def begin(self, live: Live, node: TreeNode, load: LayerLoad | None, matched: int) -> TreeNode:
        return node

    def reserve(self, live: Live, tokens: int) -> bool:
        return True

    def forward(self, live: Live, tokens: Sequence[int], length: int, load: LayerLoad | None, prefill: bool) -> int:
        if self.model is not None:
            assert self.kv is not None
            context = live.context(length).to(self.kv.device)
            ids = torch.tensor(list(tokens), dtype=torch.int64)
            logits = self.model.forward(ids, self.kv, context[length - len(tokens) :], context, load.wait if load is not None else None)
            last = logits[-1].cpu()
            live.logits.append(last)
            return int(last.argmax())
        assert self.gpu is not None
        if prefill:  # a decode step's cost is charged once per step, for the whole batch (see Engine.step)
            self.gpu.prefill(len(tokens), self.model_config.layers, load)
        return (sum(tokens[-4:]) * 31 + length) % self.model_config.vocab_size

    def cache(self, live: Live, last: TreeNode, cached: int) -> None:
        return None

    def release(self, live: Live) -> None:
        return None

    def close(self) -> None:
        return None


def make_runner(config: EngineConfig) -> ModelRunner:
    """The runner for ``config.model``: dense for a ModelConfig, hybrid for a HybridModelConfig
    (its cost instead of its forward pass when ``config.compute`` is set)."""
    if isinstance(config.model, ModelConfig):
        return DenseRunner(config)
    if config.compute is not None:
        from hicache_core.hybrid.modeled import ModeledHybridRunner

        return ModeledHybridRunner(config)
    from hicache_core.hybrid.runner import HybridRunner

    return HybridRunner(config)


__all__ = ["DenseRunner", "ModelRunner", "make_runner"]
