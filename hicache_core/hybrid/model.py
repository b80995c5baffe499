"""The hybrid reference decoder: full-attention, sliding-window and recurrent layers, bit-exact by construction.

It is :class:`hicache_core.model.TinyDecoder`'s counterpart for hybrid models, built on the same
rule (read that module's docstring): only elementwise IEEE operations and fixed-order folds over
zero-padded power-of-two axes, so a token's logits depend on its context and never on how the
work was chunked (one prefill, random chunks, or token by token). Each layer kind brings its own
state, and the model reads exactly that state and nothing else:

- ``"full"``: attention over every earlier position and itself; K and V live in the FULL pool.
- ``"swa"``: attention over the last ``window`` positions (itself included); K and V live in the
  SWA pool. A query at ``p`` reads only the slots of positions ``[p - window + 1, p]``, so the
  slots of older positions may be tombstones holding anything. Each query gathers its own window
  in a layout fixed by ``p`` alone (most recent first, positions before 0 masked at the tail), so
  what it folds, and in which order, does not depend on where its chunk starts, and a chunk of
  ``Q`` tokens costs ``Q * window`` scores, not ``Q * (Q + window)``.
- ``"recurrent"``: a gated linear recurrence ``s = a * s + (1 - a) * z`` per token, with
  ``z = x @ wz`` and gate ``a = g*g / (1 + g*g)``, ``g = x @ wg + 2`` (only ``+ - * /``: libm's
  ``exp``/``tanh`` may round differently in vector and scalar paths). The state after a prefix is
  a ``(recurrent_layers, state_dim)`` tensor: a checkpoint valid only at that exact position. The
  tokens of a chunk are folded in one at a time, so a chunk boundary changes nothing.

Every layer then adds a ReLU MLP, as in TinyDecoder; RoPE, RMSNorm and the folds are TinyDecoder's.
:meth:`HybridModelConfig.draft_config` describes a one-layer :class:`~hicache_core.model.TinyDecoder`
draft model whose KV is a sidecar pool indexed by the FULL pool's slots.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field

import torch

from hicache_core.model import ATTENTION_CHUNK_ELEMENTS, ModelConfig, Rotary, fold_sum, linear, rms_norm, soft_exp, weight_maker
from hicache_core.pools import KVGeometry

FULL = "full"
SWA = "swa"
RECURRENT = "recurrent"
LAYER_KINDS = (FULL, SWA, RECURRENT)

#: Added to the gate pre-activation so that a typical gate keeps ~80% of the state per token:
#: the recurrent state then carries information over many tokens (tests depend on it mattering).
GATE_BIAS = 2.0


@dataclass(frozen=True)
class HybridModelConfig:
    """Shapes of the hybrid reference model; ``name`` identifies its weights (storage namespaces use it)."""

    vocab_size: int = 256
    hidden: int = 64
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    #: One entry per layer: ``"full"`` attends to every earlier token (and itself); ``"swa"`` to the
    #: last ``window`` tokens (itself included); ``"recurrent"`` is a gated linear recurrence.
    layer_kinds: tuple[str, ...] = (FULL, SWA, RECURRENT, SWA, RECURRENT, FULL)
    window: int = 24
    state_dim: int = 32
    max_positions: int = 1 << 16
    seed: int = 0
    dtype: torch.dtype = field(default=torch.float32)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "q_heads", "kv_heads", "head_dim", "ffn", "window", "state_dim", "max_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"HybridModelConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"HybridModelConfig.seed must be an int, got {self.seed!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"HybridModelConfig.q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"HybridModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"HybridModelConfig.dtype must be a floating-point torch.dtype, got {self.dtype!r}")
        if isinstance(self.layer_kinds, str) or not isinstance(self.layer_kinds, (tuple, list)):
            raise ValueError(f"HybridModelConfig.layer_kinds must be a tuple of layer kinds {LAYER_KINDS}, got {self.layer_kinds!r}")
        # A list would make the frozen config unhashable; the tuple is the canonical form.
        object.__setattr__(self, "layer_kinds", tuple(self.layer_kinds))
        unknown = [kind for kind in self.layer_kinds if kind not in LAYER_KINDS]
        if unknown:
            raise ValueError(f"HybridModelConfig.layer_kinds has unknown kind(s) {unknown!r}: each must be one of {LAYER_KINDS}")
        missing = [kind for kind in (FULL, SWA) if kind not in self.layer_kinds]
        if missing:
            raise ValueError(
                f"HybridModelConfig.layer_kinds must hold at least one {FULL!r} and one {SWA!r} layer (recurrent layers "
                f"are optional), missing {missing!r} (a model of full-attention layers only is hicache_core.model.ModelConfig)"
            )

    @property
    def layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def full_layers(self) -> int:
        return self.layer_kinds.count(FULL)

    @property
    def swa_layers(self) -> int:
        return self.layer_kinds.count(SWA)

    @property
    def recurrent_layers(self) -> int:
        return self.layer_kinds.count(RECURRENT)

    @property
    def full_geometry(self) -> KVGeometry:
        """Geometry of the FULL pool: the full-attention layers' K and V, every position."""
        return KVGeometry(self.full_layers, self.kv_heads, self.head_dim, self.dtype)

    @property
    def swa_geometry(self) -> KVGeometry:
        """Geometry of the SWA pool: the sliding-window layers' K and V, needed for the last ``window`` positions only."""
        return KVGeometry(self.swa_layers, self.kv_heads, self.head_dim, self.dtype)

    @property
    def state_shape(self) -> tuple[int, int]:
        """Shape of one recurrent checkpoint: every recurrent layer's state after some prefix."""
        return (self.recurrent_layers, self.state_dim)

    def pool_layer(self, layer: int) -> int:
        """Index of layer ``layer`` (among all layers) within its kind's pool or state rows."""
        kind = self.layer_kinds[layer]
        return self.layer_kinds[:layer].count(kind)

    @property
    def name(self) -> str:
        """Identity of the weights: changes with any field."""
        fields = {k: str(v) for k, v in asdict(self).items()}
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
        return f"tiny-hybrid-{digest}"

    def swa_first(self, start: int) -> int:
        """First position an SWA query at ``start`` reads: a chunk from ``start`` needs SWA slots from here on."""
        return max(0, start - self.window + 1)

    def draft_config(self) -> ModelConfig:
        """A one-layer draft model over the same vocabulary and positions, with its own weights.

        Its KV (geometry ``draft_config().geometry``) is a sidecar pool: the same number of slots
        as the FULL pool, indexed by the FULL pool's slots (run it with ``context_slots =
        full_slots``), so it is saved and restored with the FULL pages it follows.
        """
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden=self.hidden,
            layers=1,
            q_heads=self.q_heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            ffn=self.ffn,
            max_positions=self.max_positions,
            seed=self.seed + 1,
            dtype=self.dtype,
        )


class HybridDecoder:
    """Seeded random weights; ``forward`` computes new tokens' logits, writes their KV and advances the state."""

    def __init__(self, config: HybridModelConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        c = config
        gen = torch.Generator().manual_seed(c.seed)
        weight = weight_maker(gen, c.dtype, self.device)

        def ones(size: int) -> torch.Tensor:
            return torch.ones(size, dtype=c.dtype, device=self.device)

        qd, kd = c.q_heads * c.head_dim, c.kv_heads * c.head_dim
        self.embed = torch.randn(c.vocab_size, c.hidden, generator=gen, dtype=torch.float64).to(c.dtype).to(self.device)
        self.layers: list[dict[str, torch.Tensor]] = []
        for kind in c.layer_kinds:
            layer = {"norm1": ones(c.hidden), "norm2": ones(c.hidden), "w1": weight(c.hidden, c.ffn), "w2": weight(c.ffn, c.hidden)}
            if kind == RECURRENT:
                layer |= {"wz": weight(c.hidden, c.state_dim), "wg": weight(c.hidden, c.state_dim), "wy": weight(c.state_dim, c.hidden)}
            else:
                layer |= {"wq": weight(c.hidden, qd), "wk": weight(c.hidden, kd), "wv": weight(c.hidden, kd), "wo": weight(qd, c.hidden)}
            self.layers.append(layer)
        self.final_norm = ones(c.hidden)
        self.head = weight(c.hidden, c.vocab_size)
        self.rope = Rotary(c.head_dim, c.max_positions, c.dtype, self.device)

    def new_state(self) -> torch.Tensor:
        """The recurrent state before the first token: zeros of ``config.state_shape``."""
        return torch.zeros(self.config.state_shape, dtype=self.config.dtype, device=self.device)

    def forward(
        self,
        token_ids: torch.Tensor,
        start: int,
        full_kv: torch.Tensor,
        full_slots: torch.Tensor,
        swa_kv: torch.Tensor,
        swa_slots: torch.Tensor,
        state: torch.Tensor,
        snapshot_at: Collection[int] = (),
        wait_layer: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Logits ``(Q, vocab)`` of the ``Q`` tokens at positions ``[start, start + Q)``, and state snapshots.

        - ``full_kv``: a FULL pool's ``kv``; ``full_slots[p]`` is position ``p``'s slot for every
          ``p`` in ``[0, start + Q)``. Positions before ``start`` must hold their KV; the new
          tokens' KV is written to the last ``Q`` slots.
        - ``swa_kv``: an SWA pool's ``kv``; ``swa_slots`` lists the slots of positions
          ``[config.swa_first(start), start + Q)`` in order. Only those are read (each query only
          its own window); the new tokens' KV is written to the last ``Q`` of them.
        - ``state``: the recurrent state after positions ``[0, start)`` (``new_state()`` when
          ``start == 0``); updated in place to the state after ``[0, start + Q)``.
        - ``snapshot_at``: positions ``p`` with ``start < p <= start + Q``; the result maps each to
          a fresh copy of the state after tokens ``[0, p)``.
        - ``wait_layer(i)``: called with each layer's index among all layers, in order, before that
          layer reads cached KV or state (layer-wise loading waits there).

        Raises ``ValueError`` naming the argument whose length or shape does not fit.
        """
        c = self.config
        count = token_ids.numel()
        end = start + count
        self._check(token_ids, start, full_kv, full_slots, swa_kv, swa_slots, state, snapshot_at)
        full_slots = full_slots.to(self.device, torch.int64)
        swa_slots = swa_slots.to(self.device, torch.int64)
        positions = torch.arange(start, end, device=self.device)
        snapshot_positions = sorted(set(snapshot_at))
        snapshot_rows = torch.tensor([p - 1 - start for p in snapshot_positions], dtype=torch.int64, device=self.device)
        layer_snapshots: list[torch.Tensor] = []  # per recurrent layer: (snapshots, state_dim)
        h = self.embed[token_ids.to(self.device)]
        for index, (kind, layer) in enumerate(zip(c.layer_kinds, self.layers)):
            if wait_layer is not None:
                wait_layer(index)
            pool_layer = c.pool_layer(index)
            x = rms_norm(h, layer["norm1"])
            if kind == RECURRENT:
                states = self._recurrence(x, layer, state[pool_layer])
                layer_snapshots.append(states[snapshot_rows])
                mixed = linear(states, layer["wy"])
            else:
                q = self.rope(linear(x, layer["wq"]).view(count, c.q_heads, c.head_dim), positions)
                k_new = self.rope(linear(x, layer["wk"]).view(count, c.kv_heads, c.head_dim), positions)
                v_new = linear(x, layer["wv"]).view(count, c.kv_heads, c.head_dim)
                if kind == FULL:
                    keys, values = self._write_and_read(full_kv, pool_layer, full_slots, k_new, v_new)
                    attended = self._causal_attention(q, positions, keys, values)
                else:
                    keys, values = self._write_and_read(swa_kv, pool_layer, swa_slots, k_new, v_new)
                    attended = self._window_attention(q, positions, keys, values, c.swa_first(start))
                mixed = linear(attended.reshape(count, -1), layer["wo"])
            h = h + mixed
            x = rms_norm(h, layer["norm2"])
            h = h + linear(torch.relu(linear(x, layer["w1"])), layer["w2"])
        logits = linear(rms_norm(h, self.final_norm), self.head)
        snapshots = {
            p: torch.stack([rows[i] for rows in layer_snapshots]) if layer_snapshots else state.clone()
            for i, p in enumerate(snapshot_positions)
        }
        return logits, snapshots

    def _check(
        self,
        token_ids: torch.Tensor,
        start: int,
        full_kv: torch.Tensor,
        full_slots: torch.Tensor,
        swa_kv: torch.Tensor,
        swa_slots: torch.Tensor,
        state: torch.Tensor,
        snapshot_at: Collection[int],
    ) -> None:
        c = self.config
        count = token_ids.numel()
        if token_ids.dim() != 1 or count == 0:
            raise ValueError(f"token_ids must be a non-empty 1-D tensor, got shape {tuple(token_ids.shape)}")
        if start < 0 or start + count > c.max_positions:
            raise ValueError(f"positions [{start}, {start + count}) must lie in [0, max_positions={c.max_positions})")
        end = start + count
        if full_slots.shape != (end,):
            raise ValueError(f"full_slots must list the slots of positions [0, {end}): expected shape ({end},), got {tuple(full_slots.shape)}")
        swa_count = end - c.swa_first(start)
        if swa_slots.shape != (swa_count,):
            raise ValueError(
                f"swa_slots must list the slots of positions [swa_first({start})={c.swa_first(start)}, {end}): "
                f"expected shape ({swa_count},), got {tuple(swa_slots.shape)}"
            )
        for arg, kv, geometry in (("full_kv", full_kv, c.full_geometry), ("swa_kv", swa_kv, c.swa_geometry)):
            expected = (2, geometry.layers, geometry.kv_heads, geometry.head_dim)
            if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != expected:
                raise ValueError(f"{arg} must be a pool of shape (2, {geometry.layers}, slots, {c.kv_heads}, {c.head_dim}), got {tuple(kv.shape)}")
        if state.shape != c.state_shape:
            raise ValueError(f"state must have shape {c.state_shape} (recurrent_layers, state_dim), got {tuple(state.shape)}")
        bad = [p for p in snapshot_at if not start < p <= end]
        if bad:
            raise ValueError(f"snapshot_at positions must lie in ({start}, {end}], got {sorted(bad)}")

    @staticmethod
    def _write_and_read(
        kv: torch.Tensor, pool_layer: int, slots: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' K and V in the last ``Q`` of ``slots``; return K and V of all ``slots``, GQA-expanded later."""
        new_slots = slots[slots.numel() - k_new.shape[0] :]
        kv[0, pool_layer].index_copy_(0, new_slots, k_new)
        kv[1, pool_layer].index_copy_(0, new_slots, v_new)
        return kv[0, pool_layer, slots], kv[1, pool_layer, slots]

    def _recurrence(self, x: torch.Tensor, layer: dict[str, torch.Tensor], state: torch.Tensor) -> torch.Tensor:
        """States after each of the chunk's tokens ``(Q, state_dim)``; ``state`` (one layer's row) ends as the last."""
        z = linear(x, layer["wz"])
        g = linear(x, layer["wg"]) + GATE_BIAS
        keep = g * g / (1.0 + g * g)
        update = (1.0 - keep) * z
        states = torch.empty_like(z)
        current = state.clone()
        for t in range(x.shape[0]):  # sequential on purpose: a parallel scan would reassociate
            current = keep[t] * current + update[t]
            states[t] = current
        state.copy_(current)
        return states

    def _expand_groups(self, kv: torch.Tensor, dim: int) -> torch.Tensor:
        return kv.repeat_interleave(self.config.q_heads // self.config.kv_heads, dim=dim)

    def _causal_attention(self, q: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Queries at ``positions`` over keys at ``[0, T)``: later keys are masked, i.e. trailing zeros in every fold."""
        count, heads, dim = q.shape
        keys, values = self._expand_groups(keys, 1), self._expand_groups(values, 1)
        key_positions = torch.arange(keys.shape[0], device=self.device)
        chunk = max(1, ATTENTION_CHUNK_ELEMENTS // (keys.shape[0] * heads * dim))
        outputs = []
        for first in range(0, count, chunk):
            qc, pc = q[first : first + chunk], positions[first : first + chunk]
            scores = fold_sum(qc.unsqueeze(1) * keys.unsqueeze(0), -1) * dim**-0.5  # (c, T, H)
            masked = (key_positions.unsqueeze(0) > pc.unsqueeze(1)).unsqueeze(-1)
            outputs.append(self._softmax_mix(scores.masked_fill(masked, float("-inf")), values.unsqueeze(0)))
        return torch.cat(outputs)

    def _window_attention(
        self, q: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_position: int
    ) -> torch.Tensor:
        """Queries at ``positions`` over keys at ``[first_position, ...)``, each query its own window.

        Window entry ``j`` of the query at ``p`` is position ``p - j``: the layout depends on ``p``
        alone, and positions before 0 are masked entries at the tail (they gather position 0's
        slot, which is valid, and are zeroed anyway).
        """
        count, heads, dim = q.shape
        window = self.config.window
        back = torch.arange(window, device=self.device)
        chunk = max(1, ATTENTION_CHUNK_ELEMENTS // (window * heads * dim))
        outputs = []
        for first in range(0, count, chunk):
            qc, pc = q[first : first + chunk], positions[first : first + chunk]
            key_positions = pc.unsqueeze(1) - back.unsqueeze(0)  # (c, W)
            before_start = key_positions < 0
            rows = (key_positions - first_position).clamp(min=0)
            window_keys = self._expand_groups(keys[rows], 2)  # (c, W, H, D)
            window_values = self._expand_groups(values[rows], 2).masked_fill(before_start[..., None, None], 0.0)
            scores = fold_sum(qc.unsqueeze(1) * window_keys, -1) * dim**-0.5  # (c, W, H)
            outputs.append(self._softmax_mix(scores.masked_fill(before_start.unsqueeze(-1), float("-inf")), window_values))
        return torch.cat(outputs)

    @staticmethod
    def _softmax_mix(scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``softmax(scores) @ values`` over axis 1 with ``soft_exp``: scores ``(c, K, H)``, values ``(c or 1, K, H, D)``."""
        weights = soft_exp(scores - scores.amax(dim=1, keepdim=True))  # masked keys weigh exactly 0
        return fold_sum(weights.unsqueeze(-1) * values, 1) / fold_sum(weights, 1).unsqueeze(-1)
