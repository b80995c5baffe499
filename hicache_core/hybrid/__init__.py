"""Hybrid models on the HiCache core: full-attention, sliding-window and recurrent-state layers.

One radix tree keyed by tokens holds every component's state, and
:class:`hicache_core.engine.Engine` serves them through L1, L2 and L3. Modules:

  :mod:`.components`: the components and the rules each brings to the tree (SWA windows, recurrent checkpoints).
  :mod:`.memory`: where a component's state lives (device and host slots) and the copies between them.
  :mod:`.model`: the bit-exact hybrid reference decoder.
  :mod:`.request_window`: a running request's own sliding-window KV, only what its window still reads.
  :mod:`.runner`: the hybrid model on the engine (:class:`~hicache_core.hybrid.runner.HybridRunner`).
  :mod:`.modeled`: the runner with its forward pass replaced by its cost (the bench's hybrid shapes).
"""

from hicache_core.hybrid.components import Copies, PooledComponent, RecurrentState, SlidingWindow
from hicache_core.hybrid.model import HybridDecoder, HybridModelConfig

__all__ = [
    "Copies",
    "HybridDecoder",
    "HybridModelConfig",
    "PooledComponent",
    "RecurrentState",
    "SlidingWindow",
]
