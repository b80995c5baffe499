"""Hybrid models on the HiCache core: full-attention, sliding-window and recurrent-state layers.

One radix tree keyed by tokens holds every component's state; see :mod:`.components` for the
rules each component brings, :mod:`.model` for the reference model and :mod:`.runner` for how
:class:`hicache_core.engine.Engine` serves it through L1, L2 and L3.
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
