"""Hybrid models with their forward pass replaced by its cost: the bench's FULL + SWA and FULL + SWA + recurrent shapes.

:class:`ModeledHybridRunner` is :class:`~hicache_core.hybrid.runner.HybridRunner` with the model
taken out: every pool is allocated at the modeled model's sizes and every byte of it moves as
the reference model's does (the request's own SWA pages taken chunk by chunk and given back as
they fall out of the window, the windows kept at boundaries, checkpoints copied in at the resume
point and snapshotted at each boundary, all of it backed up, evicted, prefetched and restored by
the controller), while a prefill chunk sleeps for its modeled cost, waiting for each FULL layer's
load as the model would. What the pools hold is not computed, so outputs are meaningless; the
reference runner's differential tests prove the state handling exact.

It also counts what its components move (device <-> host copies, L3 reads), which the engine's
counters leave out (they count the FULL pool), so the bench's bound covers every pool.

:data:`HYBRID_SHAPES` are the two shapes ``hicache-storage bench --model`` offers; docs/hybrid.md
lists each figure's source.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from hicache_core.hybrid.components import RecurrentState, SlidingWindow
from hicache_core.hybrid.model import FULL, RECURRENT, SWA, HybridModelConfig
from hicache_core.hybrid.runner import HybridRunner
from hicache_core.model import ModeledCompute
from hicache_core.op_thread import Wakeup
from hicache_core.pools import DevicePool, HostPool
from hicache_core.requests import EngineConfig, Live
from hicache_core.transfer import LayerLoad

#: Modeled GPU for both shapes: one NVIDIA H200 (989 TFLOP/s dense BF16, 4.8 TB/s HBM3e). Prefill
#: at ~50% of peak; a decode step reads the active weights (FP8, one byte a parameter) once.
H200_BF16_FLOPS = 989e12
H200_BYTES_PER_S = 4.8e12


def prefill_rate(active_params: float, mfu: float = 0.5) -> float:
    """Prefill tokens/s at ``mfu`` of an H200's peak: 2 FLOP per active parameter per token."""
    return H200_BF16_FLOPS * mfu / (2 * active_params)


def decode_step(active_params: float) -> float:
    """One decode step's time: the active weights (one byte each) read once from HBM."""
    return active_params / H200_BYTES_PER_S


@dataclass(frozen=True)
class HybridShape:
    """A hybrid model the bench serves with modeled compute, and where its numbers come from."""

    name: str
    model: str
    source: str
    config: HybridModelConfig
    compute: ModeledCompute

    def pool_bytes(self) -> dict[str, int]:
        """Bytes per token of the FULL and SWA pools, and of one recurrent checkpoint (0 without)."""
        c = self.config
        itemsize = torch.empty((), dtype=c.dtype).element_size()
        checkpoint = c.recurrent_layers * c.state_dim * itemsize
        return {"full_per_token": c.full_geometry.token_bytes, "swa_per_token": c.swa_geometry.token_bytes, "checkpoint": checkpoint}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model, "source": self.source, "window": self.config.window, **self.pool_bytes()}


def _kinds(full: int, swa: int, recurrent: int = 0) -> tuple[str, ...]:
    return (FULL,) * full + (SWA,) * swa + (RECURRENT,) * recurrent


#: DeepSeek-V4-Flash (FULL + SWA), from its public config: 43 layers, 1 KV head of 512 dims, FP8
#: KV, sliding window 128. Every layer keeps the raw window: 43 x 512 B = 22,016 B/token of SWA
#: KV (here 43 layers x K and V of 256 dims). The compressed attention that reaches every
#: earlier token is the FULL pool: 21 layers at ratio 4 (a 512-dim row and a 128-dim indexer
#: row per 4 tokens) and 20 at ratio 128, 3,440 B/token, here 7 layers x K and V of 256 dims =
#: 3,584 B (+4%). Compute: 13B active parameters.
DEEPSEEK_V4_FLASH = HybridShape(
    name="hybrid-swa",
    model="DeepSeek-V4-Flash",
    source="huggingface.co/deepseek-ai/DeepSeek-V4-Flash (config.json, model card)",
    config=HybridModelConfig(
        q_heads=1, kv_heads=1, head_dim=256, layer_kinds=_kinds(full=7, swa=43), window=128, dtype=torch.float8_e4m3fn
    ),
    compute=ModeledCompute(prefill_rate(13e9), decode_step(13e9)),
)

#: Inkling-Small (FULL + SWA + MAMBA) has no public config; its public stand-in of the same family
#: is NVIDIA Hymba-1.5B (attention and Mamba heads in every layer): 3 full-attention layers, SWA
#: (window 1024) in the other 29 sharing KV in 14 groups, 5 KV heads of 64 dims, BF16: FULL 3 x
#: 1,280 B = 3,840 B/token, SWA 14 x 1,280 B = 17,920 B/token. Its Mamba state per layer:
#: d_inner 3,200 x (16 SSM states + a 4-wide conv) = 64,000 values, x 32 layers in BF16 = 4.1 MB
#: a checkpoint. Compute: Inkling-Small's 12B active parameters.
INKLING_SMALL_STAND_IN = HybridShape(
    name="hybrid-swa-recurrent",
    model="Inkling-Small (stand-in: NVIDIA Hymba-1.5B's cache shape, Inkling-Small's 12B active parameters)",
    source="huggingface.co/nvidia/Hymba-1.5B-Base (config.json, model card); Inkling-Small: 276B total / 12B active (public release notes)",
    config=HybridModelConfig(
        q_heads=25, kv_heads=5, head_dim=64, layer_kinds=_kinds(full=3, swa=14, recurrent=32), window=1024,
        state_dim=64_000, dtype=torch.bfloat16,
    ),
    compute=ModeledCompute(prefill_rate(12e9), decode_step(12e9)),
)

HYBRID_SHAPES: dict[str, HybridShape] = {shape.name: shape for shape in (DEEPSEEK_V4_FLASH, INKLING_SMALL_STAND_IN)}


class _Moved:
    """Bytes a runner's components moved, by leg, and the seconds the copies took on the calling
    thread (thread-safe: the controller's threads copy too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = {"load": 0, "backup": 0, "storage_read": 0}
        self.copy_seconds = {"load": 0.0, "backup": 0.0}

    def add(self, leg: str, size: int, seconds: float = 0.0) -> None:
        with self._lock:
            self.bytes[leg] += size
            if leg in self.copy_seconds:
                self.copy_seconds[leg] += seconds

    def counted(self, leg: str, call: Callable[..., Any], slot_bytes: int) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            started = time.perf_counter()
            result = call(*args)
            self.add(leg, args[0].numel() * slot_bytes, time.perf_counter() - started)  # the slots (tokens or checkpoints) moved
            return result

        return wrapper


class _States:
    """Stands in for the model where the runner asks it for a fresh recurrent state.

    One zero state serves every request: nothing computes into it (a snapshot clones it), and a
    fresh 4 MB tensor per start attempt (admission retries a start while memory is short) cost
    the scheduler more than the modeled model's whole decode.
    """

    def __init__(self, config: HybridModelConfig, device: torch.device) -> None:
        self.initial = torch.zeros(config.state_shape, dtype=config.dtype, device=device)

    def new_state(self) -> torch.Tensor:
        return self.initial


class ModeledHybridRunner(HybridRunner):
    """A :class:`HybridRunner` whose prefill takes ``EngineConfig.compute``'s cost on a
    :class:`~hicache_core.model.ModeledGPU` (decode steps are charged by the engine, once per
    step); every pool is real."""

    def __init__(self, config: EngineConfig) -> None:
        assert config.compute is not None
        super().__init__(replace(config, compute=None))
        self.gpu = config.compute.gpu()
        self.moved = _Moved()

    def _models(self, device: torch.device) -> tuple[Any, None]:
        return _States(self.model_config, device), None

    def build(self, device: DevicePool, host: HostPool | None, wakeup: Wakeup | None = None) -> tuple[SlidingWindow | RecurrentState, ...]:
        components = super().build(device, host, wakeup)
        slot_bytes = {id(self.window): self.model_config.swa_geometry.token_bytes}
        memories: list[tuple[Any, int]] = [(self.swa, slot_bytes[id(self.window)])]
        if self.checkpoints is not None:
            state = self.states.device[0]
            slot_bytes[id(self.checkpoints)] = state.numel() * state.element_size()
            memories.append((self.states, slot_bytes[id(self.checkpoints)]))
        for memory, size in memories:
            memory.to_host = self.moved.counted("backup", memory.to_host, size)
            memory.to_device = self.moved.counted("load", memory.to_device, size)
        for component in components:
            component.fetch_buffers = self.moved.counted("storage_read", component.fetch_buffers, slot_bytes[id(component)])  # type: ignore[method-assign]  # this instance's reads, counted
        if self.checkpoints is not None:
            self.checkpoints.state_at = self._state_at_counted(self.checkpoints, slot_bytes[id(self.checkpoints)])  # type: ignore[method-assign,assignment]  # this instance's loads, counted
        return components

    def _state_at_counted(self, checkpoints: RecurrentState, size: int) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        """``state_at`` counting a checkpoint copied from the host straight into a request's state (a load)."""
        state_at = checkpoints.state_at

        def counted(node: Any, initial: torch.Tensor) -> torch.Tensor:
            if node is not self.tree.root and checkpoints.slots(node, device=True) is None:
                self.moved.add("load", size)
            return state_at(node, initial)

        return counted

    def forward(self, live: Live, tokens: Sequence[int], length: int, load: LayerLoad | None, prefill: bool) -> int:
        request = live.model_state
        own = request.own
        position = length - len(tokens)
        for begin, end in own.passes(position, length):
            own.hold(begin, end)  # the pages this chunk's window reads (no model reads their slots)
            if self.checkpoints is not None:
                for boundary in own.boundaries:
                    if begin < boundary <= end:
                        # Nothing computes into the state, so the snapshot is the state itself:
                        # a clone is the model's own device work (microseconds on a GPU's
                        # stream), which on this CPU stand-in took the scheduler 1.2 ms per 4 MB
                        # checkpoint, ~10 ms of every long-history round. The checkpoint pool
                        # still copies it in (``RecurrentState.insert``), as the engine does.
                        request.snapshots[boundary] = request.state
            own.advance(end)
        if prefill:  # the whole call's time at once, over the FULL pool's layers (not a wait per chunk)
            assert self.gpu is not None  # set in __init__
            self.gpu.prefill(len(tokens), self.geometry.layers, load)
        return (sum(tokens[-4:]) * 31 + length) % self.model_config.vocab_size


__all__ = ["HYBRID_SHAPES", "HybridShape", "ModeledHybridRunner"]
