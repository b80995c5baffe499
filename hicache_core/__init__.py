"""The HiCache core: host KV pool, three-tier radix tree, cache controller, reference engine.

Modules, bottom up: :mod:`~hicache_core.pools` (device and host KV pools, page allocator),
:mod:`~hicache_core.transfer` (device <-> host through the kernels), :mod:`~hicache_core.radix_tree`,
:mod:`~hicache_core.controller` (write policies, backup thread, load back, buffer-only mode),
:mod:`~hicache_core.prefetch` (prefetch thread, rate limit, stop policies), :mod:`~hicache_core.tp` (tensor-parallel agreement), :mod:`~hicache_core.model`
(the bit-exact reference decoder and the modeled compute cost), :mod:`~hicache_core.sessions`
(session-aware eviction), :mod:`~hicache_core.engine` (the scheduler that serves requests) and
:mod:`~hicache_core.metrics`.
"""

from hicache_core.controller import ControllerConfig, WritePolicy
from hicache_core.engine import (
    CacheTiers,
    Engine,
    EngineCapacityError,
    EngineConfig,
    Request,
    RequestResult,
    make_conversations,
    serve_conversations,
)
from hicache_core.metrics import CacheMetrics
from hicache_core.model import ModelConfig, ModeledCompute, TinyDecoder
from hicache_core.pools import HostMemoryError, KVGeometry
from hicache_core.prefetch import PrefetchConfig, StopPolicy
from hicache_core.sessions import SessionTable, SessionTicket
from hicache_core.tp import TPContext

__all__ = [
    "CacheMetrics",
    "CacheTiers",
    "ControllerConfig",
    "Engine",
    "EngineCapacityError",
    "EngineConfig",
    "HostMemoryError",
    "KVGeometry",
    "ModelConfig",
    "ModeledCompute",
    "PrefetchConfig",
    "Request",
    "RequestResult",
    "SessionTable",
    "SessionTicket",
    "StopPolicy",
    "TPContext",
    "TinyDecoder",
    "WritePolicy",
    "make_conversations",
    "serve_conversations",
]
