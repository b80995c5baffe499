"""The HiCache core: host KV pool, three-tier radix tree, cache controller, reference engine.

Modules, by role:

Memory, movement and agreement
  :mod:`~hicache_core.pools`: the device (L1) and host (L2) KV pools, and the page allocator of both.
  :mod:`~hicache_core.transfer`: device <-> host through the kernels: layer-wise loads, backup copies.
  :mod:`~hicache_core.tp`: agreement between tensor-parallel ranks, so every rank decides the same.
  :mod:`~hicache_core.metrics`: the core's counters (:class:`CacheMetrics`), thread-safe.

The tree
  :mod:`~hicache_core.token_sequence`: an append-only token sequence that hashes each page once.
  :mod:`~hicache_core.tree_node`: the tree's records: nodes, match and insert results, the component protocol.
  :mod:`~hicache_core.tree_eviction`: the tree's evictor: LRU, sessions' prefixes last, never a locked node.
  :mod:`~hicache_core.radix_tree`: the radix tree over pages of tokens, where each page lives, its invariants.
  :mod:`~hicache_core.sessions`: session references: prefixes a live conversation will probably ask for again.

The cache controller and its threads
  :mod:`~hicache_core.controller`: write policies, storage attachment and health, load back, buffer-only mode.
  :mod:`~hicache_core.host_writes`: the controller's host writer: device -> host copies, acknowledged in order.
  :mod:`~hicache_core.backup`: host -> storage backup ops and the backup thread.
  :mod:`~hicache_core.prefetch`: storage -> host prefetch: plan, rate limit, stop policies, the prefetch thread.
  :mod:`~hicache_core.side_pools`: hybrid components' pools in a backup or prefetch (one op moves every pool).
  :mod:`~hicache_core.storage_calls`: how the threads call storage: never raising, breaker, giving a store up.
  :mod:`~hicache_core.pin_cap`: the cap on host pages pinned by abandoned storage calls, and buffers at it.
  :mod:`~hicache_core.page_sets`: page hashes remembered about the store: reported but unreadable (rewritten by backups), and known stored.
  :mod:`~hicache_core.op_thread`: one daemon thread serving a queue of operations in order.

The engine
  :mod:`~hicache_core.model`: the bit-exact reference decoder (:class:`TinyDecoder`) and the modeled compute cost.
  :mod:`~hicache_core.requests`: what the engine is asked and answers: tiers, configuration, requests, results.
  :mod:`~hicache_core.runner`: the model side of the engine (:class:`~hicache_core.runner.ModelRunner`), dense models.
  :mod:`~hicache_core.admission`: waiting requests, their prefix match and prefetch, and when each may start.
  :mod:`~hicache_core.engine`: the scheduler that serves requests through the tiers (:class:`Engine`).
  :mod:`~hicache_core.soak`: a long multi-turn run through the engine with injected storage faults.

Subpackages
  :mod:`~hicache_core.hybrid`: hybrid models (full attention, sliding window, recurrent state) on the same tree.

The multi-turn benchmark that runs this engine (``hicache-storage bench``) is
``hicache_storage.benchmarks.multiturn``: it imports the core, never the reverse.
"""

from hicache_core.controller import ControllerConfig, WritePolicy
from hicache_core.engine import (
    AdmissionOrder,
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
    "AdmissionOrder",
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
