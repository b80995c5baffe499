"""The reference decoder: a tiny random-weight transformer over paged KV, bit-exact by construction.

Why it exists: the differential test compares a run with HiCache off against runs whose KV came
back from the host or from storage. That comparison means something only if the model's output
for a token depends on the token's context and never on how the work was batched (a prefill of
the whole prompt vs. a prefill of the uncached tail vs. one decode step). Library matmuls and
reductions do not promise that (their summation order changes with the shapes), so this model
uses only elementwise IEEE operations (each correctly rounded, whatever the vector width) and
reductions written as a fixed pairwise fold over a zero-padded power-of-two axis. Zero padding
leaves a fold's result unchanged, so a query sees the same additions in the same order whether
its batch holds 1 or 500 tokens, or its context 40 or 4000. ``exp`` is replaced by
``(1 + x/256)**256`` (eight squarings) for the same reason. The result is deterministic on the
CPU and on CUDA alike.

Shapes: multi-head attention with grouped-query KV heads (``q_heads`` a multiple of
``kv_heads``), RMSNorm, RoPE (table computed once), a ReLU MLP, tied-free output head. With
``mla=True`` the cache holds one latent per token (``latent_dim``), expanded to K and V per
forward, as in multi-head latent attention.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from hicache_core.pools import KVGeometry

if TYPE_CHECKING:
    from hicache_core.transfer import LayerLoad

#: Attention works on query chunks of at most this many (query x key x head x dim) elements.
ATTENTION_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    hidden: int = 64
    layers: int = 3
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    mla: bool = False
    latent_dim: int = 32
    max_positions: int = 1 << 16
    seed: int = 0
    dtype: torch.dtype = field(default=torch.float32)

    def __post_init__(self) -> None:
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def geometry(self) -> KVGeometry:
        if self.mla:
            return KVGeometry(self.layers, 1, self.latent_dim, self.dtype, is_mla=True)
        return KVGeometry(self.layers, self.kv_heads, self.head_dim, self.dtype)

    @property
    def name(self) -> str:
        """Identity of the weights: changes with any field (storage namespaces use it)."""
        fields = {k: str(v) for k, v in asdict(self).items()}
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
        return f"tiny-decoder-{digest}"


def fold_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` as a pairwise fold over a zero-padded power-of-two length (order fixed)."""
    length = x.shape[dim]
    padded = 1 << max(length - 1, 0).bit_length()
    if padded != length:
        pad_shape = list(x.shape)
        pad_shape[dim] = padded - length
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    while x.shape[dim] > 1:
        half = x.shape[dim] // 2
        x = x.narrow(dim, 0, half) + x.narrow(dim, half, half)
    return x.squeeze(dim)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight`` for x ``(M, K)``, weight ``(K, N)``, row-independent (see the module docstring)."""
    rows = max(1, ATTENTION_CHUNK_ELEMENTS // (weight.shape[0] * weight.shape[1]))
    parts = [fold_sum(chunk.unsqueeze(2) * weight.unsqueeze(0), 1) for chunk in x.split(rows)]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def soft_exp(x: torch.Tensor) -> torch.Tensor:
    """``(1 + x/256)**256`` for ``x <= 0``: a positive, increasing stand-in for exp with exact-rule arithmetic."""
    y = 1.0 + x.clamp(min=-256.0) / 256.0
    for _ in range(8):
        y = y * y
    return y


def rms_norm(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    mean_square = fold_sum(x * x, -1) / x.shape[-1]
    return x / torch.sqrt(mean_square + 1e-5).unsqueeze(-1) * gain


def weight_maker(gen: torch.Generator, dtype: torch.dtype, device: torch.device) -> Callable[..., torch.Tensor]:
    """``make(*shape)``: the next seeded random matrix from ``gen`` (drawn in float64 so every
    dtype gets the same weights), scaled by the input dimension's square root."""

    def make(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) / shape[-2] ** 0.5).to(dtype).to(device)

    return make


class Rotary:
    """Rotary position embedding, its cos/sin table computed once for ``max_positions``."""

    def __init__(self, head_dim: int, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.cos = angles.cos().to(dtype).to(device)
        self.sin = angles.sin().to(dtype).to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` of shape ``(tokens, heads, head_dim)`` rotated by each token's position."""
        half = x.shape[-1] // 2
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class TinyDecoder:
    """Seeded random weights; ``forward`` computes new tokens' logits and writes their KV into the pool."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        c = config
        gen = torch.Generator().manual_seed(c.seed)
        weight = weight_maker(gen, c.dtype, self.device)
        qd = c.q_heads * c.head_dim
        self.embed = (torch.randn(c.vocab_size, c.hidden, generator=gen, dtype=torch.float64)).to(c.dtype).to(self.device)
        self.layers = []
        for _ in range(c.layers):
            layer = {
                "norm1": torch.ones(c.hidden, dtype=c.dtype, device=self.device),
                "norm2": torch.ones(c.hidden, dtype=c.dtype, device=self.device),
                "wq": weight(c.hidden, qd),
                "wo": weight(qd, c.hidden),
                "w1": weight(c.hidden, c.ffn),
                "w2": weight(c.ffn, c.hidden),
            }
            if c.mla:
                layer |= {"wc": weight(c.hidden, c.latent_dim), "wuk": weight(c.latent_dim, qd), "wuv": weight(c.latent_dim, qd)}
            else:
                kd = c.kv_heads * c.head_dim
                layer |= {"wk": weight(c.hidden, kd), "wv": weight(c.hidden, kd)}
            self.layers.append(layer)
        self.final_norm = torch.ones(c.hidden, dtype=c.dtype, device=self.device)
        self.head = weight(c.hidden, c.vocab_size)
        self.rope = Rotary(c.head_dim, c.max_positions, c.dtype, self.device)

    def forward(
        self,
        token_ids: torch.Tensor,
        kv: torch.Tensor,
        new_slots: torch.Tensor,
        context_slots: torch.Tensor,
        wait_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits ``(Q, vocab)`` of the ``Q`` new tokens, the last ``Q`` of ``context_slots``.

        ``context_slots[p]`` holds position ``p``'s KV; the cached prefix must already be there,
        except for layers still loading: ``wait_layer(i)`` is called before layer ``i`` reads it.
        """
        c = self.config
        total, count = context_slots.numel(), token_ids.numel()
        positions = torch.arange(total - count, total, device=self.device)
        key_positions = torch.arange(total, device=self.device)
        h = self.embed[token_ids.to(self.device)]
        for index, layer in enumerate(self.layers):
            if wait_layer is not None:
                wait_layer(index)
            x = rms_norm(h, layer["norm1"])
            q = self.rope(linear(x, layer["wq"]).view(count, c.q_heads, c.head_dim), positions)
            if c.mla:
                latent = linear(x, layer["wc"]).view(count, 1, c.latent_dim)
                kv[0, index].index_copy_(0, new_slots, latent)
                context = kv[0, index, context_slots].view(total, c.latent_dim)
                keys = self.rope(linear(context, layer["wuk"]).view(total, c.q_heads, c.head_dim), key_positions)
                values = linear(context, layer["wuv"]).view(total, c.q_heads, c.head_dim)
            else:
                k_new = self.rope(linear(x, layer["wk"]).view(count, c.kv_heads, c.head_dim), positions)
                v_new = linear(x, layer["wv"]).view(count, c.kv_heads, c.head_dim)
                kv[0, index].index_copy_(0, new_slots, k_new)
                kv[1, index].index_copy_(0, new_slots, v_new)
                group = c.q_heads // c.kv_heads
                keys = kv[0, index, context_slots].repeat_interleave(group, dim=1)
                values = kv[1, index, context_slots].repeat_interleave(group, dim=1)
            attended = self._attention(q, positions, keys, values, key_positions)
            h = h + linear(attended.reshape(count, -1), layer["wo"])
            x = rms_norm(h, layer["norm2"])
            h = h + linear(torch.relu(linear(x, layer["w1"])), layer["w2"])
        return linear(rms_norm(h, self.final_norm), self.head)

    def _attention(
        self, q: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_positions: torch.Tensor
    ) -> torch.Tensor:
        count, heads, dim = q.shape
        total = keys.shape[0]
        scale = dim**-0.5
        chunk = max(1, ATTENTION_CHUNK_ELEMENTS // (total * heads * dim))
        outputs = []
        for start in range(0, count, chunk):
            qc, pc = q[start : start + chunk], positions[start : start + chunk]
            scores = fold_sum(qc.unsqueeze(1) * keys.unsqueeze(0), -1) * scale  # (c, T, H)
            masked = (key_positions.unsqueeze(0) > pc.unsqueeze(1)).unsqueeze(-1)
            scores = scores.masked_fill(masked, float("-inf"))
            weights = soft_exp(scores - scores.amax(dim=1, keepdim=True))  # masked keys weigh exactly 0
            numerator = fold_sum(weights.unsqueeze(-1) * values.unsqueeze(0), 1)  # (c, H, D)
            outputs.append(numerator / fold_sum(weights, 1).unsqueeze(-1))
        return torch.cat(outputs)


@dataclass(frozen=True)
class ModeledCompute:
    """A forward pass replaced by its cost, taken on a :class:`ModeledGPU` (KV moves stay real).

    Defaults are rough figures for a 8B-class model on one H100-class GPU: ~12k prefill tokens/s,
    ~12 ms per decode step. Pass measured figures for a named setup.
    """

    prefill_tokens_per_s: float = 12_000.0
    #: One decode step of the whole running batch (continuous batching), not of one request.
    decode_step_s: float = 0.012

    def prefill_seconds(self, new_tokens: int) -> float:
        return new_tokens / self.prefill_tokens_per_s

    def gpu(self) -> ModeledGPU:
        """A fresh modeled accelerator running this cost (one per engine)."""
        return ModeledGPU(self)


@dataclass(eq=False)
class QueuedPrefill:
    """A prefill queued on a :class:`ModeledGPU`; ``end`` (its first token) once known."""

    queued_at: float
    layer_s: float
    layers: int
    load: LayerLoad | None
    end: float | None = None


@dataclass(eq=False)
class _QueuedStep:
    started: float


class ModeledGPU:
    """One engine's modeled accelerator: the work the scheduler queued on it, and when it ends.

    As under SGLang's overlap scheduler, the scheduler (the CPU) does not wait for a computation
    it queued: it prepares the next request (match, allocation, loads issued) while the GPU
    computes the previous one. It waits only where it needs the GPU: before each decode step for
    the one before (its tokens are the inputs), and when the caller needs every result
    (``wait``). Sleeping through each prefill instead charged every request's preparation (3-6 ms
    at the hybrid long-history shape) on top of the compute: an early round of that bench took
    ~170 ms for 130 ms of compute, ~146 ms now.

    Nor does it wait for a prefill's loads: a layer computes once its load has landed, as a GPU's
    compute stream waits on the copy stream's event, while the scheduler goes on (it issues other
    requests' prefetches, starts them and decides when to stop waiting for reads meanwhile).
    When each layer landed is known once it has (the load records it), so the work queued after
    a prefill whose loads are still in flight has no end yet: it is worked out as they land
    (``free_at``, ``queued_for`` and ``step_pending`` estimate it meanwhile, as if the rest
    landed now). Waiting in the prefill for each layer, the scheduler of the long-history bench
    at the H200 point sat 35-56 ms a time in one request's copy while another's prefetch waited
    to be issued (traced); with Mooncake as L3 (a page loads in about the time it computes),
    three runs each alternated, the runs that stored their pages took 10.7-12.5 s then,
    9.9-10.1 s now.

    Thread-safe: the cost model reads ``queued_for`` from the prefetch thread.
    """

    def __init__(self, compute: ModeledCompute) -> None:
        self.compute = compute
        #: When the work whose end is known ends, and the last decode step among it (``time.perf_counter``).
        self._end = 0.0
        self._step_end = 0.0
        #: Work queued after (and including) the first prefill whose loads have not all landed.
        self._waiting: list[QueuedPrefill | _QueuedStep] = []
        self._lock = threading.Lock()
        #: The prefill queued last (the engine keeps its request's: its end is the first token).
        self.last_prefill: QueuedPrefill | None = None

    def prefill(self, new_tokens: int, layers: int, load: LayerLoad | None) -> QueuedPrefill:
        """Queue ``new_tokens``' prefill, ``layers`` equal layers after the work before it, layer
        ``i`` not before its load has landed (layer-wise overlap); returns it (its ``end``, the
        first token, once every layer before has landed: see :meth:`end_of`)."""
        prefill = QueuedPrefill(time.perf_counter(), self.compute.prefill_seconds(new_tokens) / layers, layers, load)
        with self._lock:
            self._waiting.append(prefill)
            self._settle(block=False)
        self.last_prefill = prefill
        return prefill

    def decode_step(self, started: float) -> None:
        """Queue one decode step of the whole batch: it starts once the queued work is done and the
        scheduler's work for it began (``started``), and lasts ``decode_step_s``. The scheduler
        does not wait for it here but before its next step (:meth:`step_pending`), whose inputs
        are this step's tokens: meanwhile it admits and prepares requests."""
        with self._lock:
            self._waiting.append(_QueuedStep(started))
            self._settle(block=False)

    def step_pending(self) -> float:
        """Seconds until the last decode step queued ends (0 once it has): its tokens are the
        next step's inputs, so the scheduler admits and prepares requests until then. A step
        queued after loads still in flight is pending (estimated as if they landed now). Raises
        if a load a queued prefill reads failed."""
        now = time.perf_counter()
        with self._lock:
            self._settle(block=False)
            if any(isinstance(work, _QueuedStep) for work in self._waiting):
                _, step_end = self._estimate(now)
                return max(step_end - now, 1e-6)
            return max(0.0, self._step_end - now)

    def queued_for(self) -> float:
        """Seconds until every piece of work queued so far ends (0 once it has; loads in flight
        counted as landing now)."""
        now = time.perf_counter()
        with self._lock:
            return max(0.0, self._estimate(now)[0] - now)

    @property
    def free_at(self) -> float:
        """When the work queued so far ends (loads in flight counted as landing now)."""
        with self._lock:
            return self._estimate(time.perf_counter())[0]

    def end_of(self, prefill: QueuedPrefill) -> float:
        """When ``prefill`` ends, waiting for the loads it and the work before it read."""
        with self._lock:
            while prefill.end is None:
                if not self._waiting:
                    raise ValueError("end_of: that prefill was not queued on this GPU")
                self._settle(block=True, until=prefill)
            return prefill.end

    def computed(self, prefill: QueuedPrefill) -> bool:
        """Whether ``prefill`` has ended (the KV it computes exists), without waiting."""
        now = time.perf_counter()
        with self._lock:
            if prefill.end is None:
                self._settle(block=False, until=prefill)
            return prefill.end is not None and prefill.end <= now

    def wait(self) -> None:
        """Until the work queued so far has ended."""
        with self._lock:
            self._settle(block=True)
            end = self._end
        _sleep_until(end)

    def _settle(self, *, block: bool, until: QueuedPrefill | None = None) -> None:
        """Work out the ends of the queued work in order, as far as its loads have landed (all
        of it, waiting for them, with ``block``; up to ``until`` only)."""
        while self._waiting:
            work = self._waiting[0]
            if isinstance(work, _QueuedStep):
                self._end = self._step_end = max(work.started, self._end) + self.compute.decode_step_s
            else:
                landed = _landed(work.load, block)
                if landed is None:
                    return
                work.end = self._end = _prefill_end(work, self._end, landed)
            self._waiting.pop(0)
            if work is until:
                return

    def _estimate(self, now: float) -> tuple[float, float]:
        """The end of every queued piece of work and of the last decode step, the loads still in
        flight counted as landing at ``now``."""
        end, step_end = self._end, self._step_end
        for work in self._waiting:
            if isinstance(work, _QueuedStep):
                end = step_end = max(work.started, end) + self.compute.decode_step_s
            else:
                landed = [_landed_at(work.load, layer, now) for layer in range(work.layers)] if work.load is not None else None
                end = _prefill_end(work, end, landed)
        return end, step_end


def _landed(load: LayerLoad | None, block: bool) -> list[float] | None:
    """When each layer of ``load`` landed (none for no load), or None while one has not landed
    yet and ``block`` is off; raises if the load failed."""
    if load is None:
        return []
    if not block and not load.landed():
        return None
    times = []
    for layer in range(load.layers):
        load.wait(layer)  # at once if it landed; raises if the load failed
        times.append(load.landed_at(layer))
    return times


def _landed_at(load: LayerLoad, layer: int, now: float) -> float:
    return load.landed_at(layer) if load.ready(layer) else now


def _prefill_end(prefill: QueuedPrefill, after: float, landed: list[float] | None) -> float:
    """Each layer computes after the one before and once its load landed."""
    end = max(prefill.queued_at, after)
    for layer in range(prefill.layers):
        if landed:
            end = max(end, landed[layer])
        end += prefill.layer_s
    return end


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)
