"""What the engine is asked and what it answers: tiers, configuration, requests, results.

:class:`EngineConfig` selects the model (a :class:`~hicache_core.model.ModelConfig`, or a
:class:`~hicache_core.hybrid.model.HybridModelConfig` whose components' pools are sized by
``EngineConfig.hybrid``), the tiers and their sizes, the controller's policies and L3.
:class:`Live` is a request while the engine serves it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_core.controller import ControllerConfig
from hicache_core.hybrid.model import HybridModelConfig
from hicache_core.model import ModelConfig, ModeledCompute, QueuedPrefill
from hicache_core.prefetch import PrefetchOp
from hicache_core.radix_tree import TreeNode
from hicache_core.sessions import SessionTicket
from hicache_core.token_sequence import TokenSequence
from hicache_core.tp import TPContext


@dataclass(frozen=True)
class HybridPools:
    """Sizes of a hybrid model's component pools (the FULL pool is ``EngineConfig``'s).

    The draft model's KV (``draft``) is a sidecar of the FULL pool: more layers of it, so it
    takes no pool of its own and moves with the FULL pages.
    """

    #: SWA KV pages on the device / host; default: as many as the FULL pool's.
    swa_device_pages: int | None = None
    swa_host_pages: int | None = None
    #: Recurrent-state checkpoint slots on the device / host.
    device_checkpoints: int = 64
    host_checkpoints: int = 128
    #: Run the draft model beside the target (speculative decoding's proposals).
    draft: bool = True


class CacheTiers(str, enum.Enum):
    OFF = "off"  # no prefix reuse at all: every prompt is recomputed
    L1 = "L1"
    L1_L2 = "L1+L2"
    L1_L2_L3 = "L1+L2+L3"

    @property
    def host(self) -> bool:
        return self in (CacheTiers.L1_L2, CacheTiers.L1_L2_L3)

    @property
    def storage(self) -> bool:
        return self is CacheTiers.L1_L2_L3


class AdmissionOrder(str, enum.Enum):
    """Which waiting request is tried first (see :mod:`hicache_core.admission`)."""

    #: Longest prefix match: the most prompt tokens cached on the device first, then arrival
    #: (SGLang's ``--schedule-policy lpm``).
    LPM = "lpm"
    #: Arrival order: first come, first served.
    FCFS = "fcfs"


@dataclass
class EngineConfig:
    model: ModelConfig | HybridModelConfig = field(default_factory=ModelConfig)
    #: Component pools of a hybrid model (ignored for a FULL-only one).
    hybrid: HybridPools = field(default_factory=HybridPools)
    tiers: CacheTiers = CacheTiers.L1_L2
    page_size: int = 16
    device_pages: int = 256
    #: Host pool size: exactly one of these (``host_ratio`` is relative to the device pool).
    host_ratio: float | None = 2.0
    host_pages: int | None = None
    host_bytes: int | None = None
    layout: str = "page_first"
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    #: L3: a registry name, its config and its layers (innermost first, as in a
    #: ``hicache_storage.StoreSpec``), or pass a backend instance to ``Engine``.
    storage_backend: str | None = None
    storage_config: dict[str, Any] | None = None
    storage_layers: list[dict[str, Any]] | None = None
    tenant: str | None = None
    revision: str | None = None
    max_running: int = 8
    #: Which waiting request is tried first (see :mod:`hicache_core.admission`).
    admission_order: AdmissionOrder = AdmissionOrder.FCFS
    #: ``None`` runs the reference model; a ModeledCompute sleeps for the modeled cost instead.
    compute: ModeledCompute | None = None
    device: str | None = None
    tp: TPContext | None = None
    #: Sessions whose last token sequence (with its page hashes) is kept for their next request,
    #: least recently finished dropped first; 0 keeps none (every request hashes its whole prompt).
    session_sequences: int = 256


@dataclass
class Request:
    rid: str
    tokens: list[int]
    max_new_tokens: int = 8
    #: Requests of one conversation share an id: their cached prefixes are evicted last (see
    #: :mod:`hicache_core.sessions`) until ``Engine.close_session``.
    session_id: str | None = None

    def check(self) -> None:
        """Raise ``ValueError`` for a request no engine can serve."""
        if self.max_new_tokens < 1 or len(self.tokens) < 1:
            raise ValueError(f"request {self.rid!r} needs at least one prompt token and max_new_tokens >= 1")


@dataclass
class RequestResult:
    rid: str
    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    #: Logits of each generated token, ``(max_new_tokens, vocab)``; None under modeled compute.
    logits: torch.Tensor | None = None
    #: A hybrid model's draft proposal at each generated position (it reads the draft KV of the
    #: whole context, so a wrongly restored sidecar shows here); empty without a draft model.
    draft_ids: list[int] = field(default_factory=list)
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0
    computed: int = 0
    #: Of ``computed``, prompt tokens the store held (as its lookup for the request's prefetch
    #: found them): recomputed by the cost model's choice, a read stopped short, or a failed one.
    stored_recomputed: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0

    @property
    def cached_tokens(self) -> int:
        return self.cached_device + self.cached_host + self.cached_storage


class EngineCapacityError(RuntimeError):
    """One request needs more device memory than the whole device pool can give it."""


@dataclass(eq=False)
class Live:
    request: Request
    result: RequestResult
    submitted: float
    #: The prompt, then each output token as it is generated: every tree call and prefetch plan
    #: of the request reads this one sequence (or an O(1) prefix of it), so its page hashes are
    #: computed once per page.
    sequence: TokenSequence
    prefetch: PrefetchOp | None = None
    node: TreeNode | None = None
    prefix_slots: torch.Tensor | None = None
    own_slots: torch.Tensor | None = None
    storage_tokens: int = 0
    #: The tokens the store held for the request's last prefetch that found any: (start, end).
    stored_span: tuple[int, int] = (0, 0)
    planned_match: int = 0
    refetched: bool = False
    #: The memory epoch (``Admission._memory_epoch``) at which it was last checked for a lost prefix.
    lost_checked_at: tuple[int, ...] | None = None
    #: The device hit before a start attempt that loaded host pages and then found no memory: the
    #: pages it loaded stay on the device, and a later attempt must not count them as device hits.
    device_hit_before_load: int | None = None
    #: Locked while the request waits: the prefix its prefetch hangs from, then the pages it fetched.
    pinned: TreeNode | None = None
    session: SessionTicket | None = None
    logits: list[torch.Tensor] = field(default_factory=list)
    #: What the model runner keeps for the request (a hybrid model's window slots and state).
    model_state: Any = None
    #: Its prefill on the modeled GPU (its end is the first token: the TTFT, once known).
    prefill: QueuedPrefill | None = None
    #: Its place in arrival order, and how many requests that arrived after it started before it
    #: (see ``admission.OVERTAKEN_MAX``).
    arrival: int = 0
    overtaken: int = 0
    #: The prompt tokens the tree took after the prefill (``Engine._cache_prompt``); the insert
    #: at its end counts no second hit on them.
    cached_prompt: int = 0

    @property
    def prefix_len(self) -> int:
        return 0 if self.prefix_slots is None else int(self.prefix_slots.numel())

    def context(self, length: int) -> torch.Tensor:
        assert self.prefix_slots is not None and self.own_slots is not None
        return torch.cat([self.prefix_slots, self.own_slots[: length - self.prefix_len]])
