"""The hybrid reference model: bit-exact whatever the chunking, blind to everything outside its context.

Pools start filled with NaN and requests get scattered slots, so a read of any slot the model was
not given (another request's, or a tombstoned SWA slot) would poison the logits; the counter-tests
put garbage where the model must read and see it change the output, so none of this passes
vacuously.
"""

from __future__ import annotations

import random
import re

import pytest
import torch

from hicache_core.hybrid.model import HybridDecoder, HybridModelConfig
from hicache_core.model import TinyDecoder

CONFIG = HybridModelConfig(
    vocab_size=64, hidden=16, q_heads=4, kv_heads=2, head_dim=4, ffn=32,
    layer_kinds=("full", "swa", "recurrent", "swa", "recurrent", "full"), window=5, state_dim=8, max_positions=256, seed=3,
)
LENGTH = 40
SLOTS = 96


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (so -0.0 vs 0.0 or two NaN payloads count as different)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float64: torch.int64}[a.dtype]
    return torch.equal(a.view(as_int), b.view(as_int))


class Run:
    """One request's pools and slots: FULL and SWA slots are separate random permutations."""

    def __init__(self, model: HybridDecoder, seed: int = 0, garbage: float = float("nan")) -> None:
        self.model = model
        c = model.config
        gen = torch.Generator().manual_seed(seed)
        self.garbage = garbage
        self.full_kv = torch.full((2, c.full_layers, SLOTS, c.kv_heads, c.head_dim), garbage, dtype=c.dtype)
        self.swa_kv = torch.full((2, c.swa_layers, SLOTS, c.kv_heads, c.head_dim), garbage, dtype=c.dtype)
        self.full_slots = torch.randperm(SLOTS, generator=gen)[:LENGTH]
        self.swa_slots = torch.randperm(SLOTS, generator=gen)[:LENGTH]
        self.state = model.new_state()

    def forward(self, tokens: torch.Tensor, start: int, end: int, snapshot_at: tuple[int, ...] = (), tombstone: bool = True,
                wait_layer=None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        first = self.model.config.swa_first(start)
        if tombstone:  # what an engine may do: slots before the window hold anything
            self.swa_kv[:, :, self.swa_slots[:first]] = self.garbage
        return self.model.forward(
            tokens[start:end], start, self.full_kv, self.full_slots[:end], self.swa_kv, self.swa_slots[first:end], self.state,
            snapshot_at=[p for p in snapshot_at if start < p <= end], wait_layer=wait_layer,
        )

    def prefill(self, tokens: torch.Tensor, bounds: list[int], snapshot_at: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Forward ``tokens`` in the chunks ``bounds`` delimits; all logits and snapshots."""
        logits, snapshots = [], {}
        for start, end in zip(bounds, bounds[1:]):
            out, snaps = self.forward(tokens, start, end, snapshot_at)
            logits.append(out)
            snapshots |= snaps
        return torch.cat(logits), snapshots


@pytest.fixture(scope="module")
def model() -> HybridDecoder:
    return HybridDecoder(CONFIG)


def tokens_for(seed: int, length: int = LENGTH, vocab: int = CONFIG.vocab_size) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def random_bounds(seed: int, length: int = LENGTH) -> list[int]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, length), rng.randint(1, 8)))
    return [0, *cuts, length]


@pytest.fixture(scope="module")
def one_shot(model: HybridDecoder) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    run = Run(model)
    logits, snapshots = run.prefill(tokens_for(1), [0, LENGTH], snapshot_at=tuple(range(1, LENGTH + 1)))
    return logits, run.state, snapshots


@pytest.mark.parametrize("split_seed", range(6))
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), 1e30])
def test_random_chunking_is_bit_identical_to_one_shot(model, one_shot, split_seed, garbage) -> None:
    want_logits, want_state, _ = one_shot
    run = Run(model, seed=split_seed + 10, garbage=garbage)
    logits, _ = run.prefill(tokens_for(1), random_bounds(split_seed))
    assert same_bits(logits, want_logits)
    assert same_bits(run.state, want_state)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "overrides",
    [
        {"window": 1},  # a query sees only itself
        {"window": 64},  # the window never slides within LENGTH
        {"kv_heads": 4, "layer_kinds": ("recurrent", "swa", "full")},  # recurrence first, no head grouping
        {"layer_kinds": ("swa", "swa", "recurrent", "full", "recurrent"), "window": 8, "state_dim": 3},
    ],
)
def test_chunking_invariance_holds_for_other_shapes(overrides) -> None:
    model = HybridDecoder(HybridModelConfig(**{**CONFIG.__dict__, **overrides}))
    tokens = tokens_for(7)
    results = []
    for seed, bounds in ((0, [0, LENGTH]), (1, list(range(LENGTH + 1))), (2, random_bounds(5))):
        run = Run(model, seed=seed)
        logits, _ = run.prefill(tokens, bounds)
        results.append((logits, run.state))
    assert torch.isfinite(results[0][0]).all()
    for logits, state in results[1:]:
        assert same_bits(logits, results[0][0])
        assert same_bits(state, results[0][1])


def test_forward_writes_only_the_new_tokens_slots(model) -> None:
    """Other requests' slots keep their bits, and this request's cached slots are not rewritten."""
    run = Run(model, seed=6)
    tokens = tokens_for(1)
    run.prefill(tokens, [0, 20])
    full_before, swa_before = run.full_kv.clone(), run.swa_kv.clone()
    run.forward(tokens, 20, 27, tombstone=False)
    full_new, swa_new = run.full_slots[20:27], run.swa_slots[20:27]
    full_rest = torch.ones(SLOTS, dtype=torch.bool)
    full_rest[full_new] = False
    swa_rest = torch.ones(SLOTS, dtype=torch.bool)
    swa_rest[swa_new] = False
    assert same_bits(run.full_kv[:, :, full_rest], full_before[:, :, full_rest])
    assert same_bits(run.swa_kv[:, :, swa_rest], swa_before[:, :, swa_rest])
    assert torch.isfinite(run.full_kv[:, :, full_new]).all() and torch.isfinite(run.swa_kv[:, :, swa_new]).all()


def test_token_by_token_is_bit_identical_and_snapshots_match_the_state_at_each_position(model, one_shot) -> None:
    want_logits, want_state, snapshots = one_shot
    assert sorted(snapshots) == list(range(1, LENGTH + 1))
    run = Run(model, seed=99)
    tokens = tokens_for(1)
    for position in range(LENGTH):
        out, snaps = run.forward(tokens, position, position + 1, snapshot_at=(position + 1,))
        assert same_bits(out, want_logits[position : position + 1]), position
        assert same_bits(run.state, snapshots[position + 1]), position
        assert same_bits(snaps[position + 1], run.state)
        assert snaps[position + 1].data_ptr() != run.state.data_ptr()  # a copy, not a view of the live state
    assert same_bits(run.state, want_state)


@pytest.mark.parametrize("p", [1, 4, 5, 6, 17, LENGTH - 1])
def test_snapshot_equals_prefilling_exactly_to_p(model, one_shot, p) -> None:
    run = Run(model, seed=p)
    run.prefill(tokens_for(1), [0, p])
    assert same_bits(run.state, one_shot[2][p])


def test_snapshots_inside_a_chunk(model, one_shot) -> None:
    run = Run(model, seed=5)
    run.prefill(tokens_for(1), [0, 8])
    _, snaps = run.forward(tokens_for(1), 8, 30, snapshot_at=(9, 20, 30))
    assert sorted(snaps) == [9, 20, 30]
    for p, snap in snaps.items():
        assert same_bits(snap, one_shot[2][p])


def test_garbage_outside_the_window_and_in_other_slots_changes_nothing(model) -> None:
    tokens, split = tokens_for(2), 23
    clean = Run(model, seed=3, garbage=0.0)
    clean.prefill(tokens, [0, split])
    dirty = Run(model, seed=3, garbage=0.0)
    dirty.prefill(tokens, [0, split])
    first = CONFIG.swa_first(split)
    outside = dirty.swa_slots[:first]
    assert (dirty.swa_kv[:, :, outside] != 0).any()  # the overwrite below destroys real data
    dirty.swa_kv[:, :, outside] = float("nan")
    foreign_full = torch.ones(SLOTS, dtype=torch.bool)
    foreign_full[dirty.full_slots] = False
    foreign_swa = torch.ones(SLOTS, dtype=torch.bool)
    foreign_swa[dirty.swa_slots] = False
    dirty.full_kv[:, :, foreign_full] = float("nan")
    dirty.swa_kv[:, :, foreign_swa] = -float("inf")
    want, _ = clean.forward(tokens, split, LENGTH, tombstone=False)
    got, _ = dirty.forward(tokens, split, LENGTH, tombstone=False)
    assert same_bits(got, want)
    assert same_bits(dirty.state, clean.state)


@pytest.mark.parametrize("pool, back", [("swa", 0), ("swa", CONFIG.window - 2), ("full", 0), ("full", 20)])
def test_garbage_in_a_slot_the_model_must_read_changes_the_output(model, pool, back) -> None:
    """The counter-test: the oldest and newest cached SWA slots in the window and any FULL slot are really read."""
    tokens, split = tokens_for(2), 23
    clean = Run(model, seed=3, garbage=0.0)
    clean.prefill(tokens, [0, split])
    dirty = Run(model, seed=3, garbage=0.0)
    dirty.prefill(tokens, [0, split])
    position = split - 1 - back
    if pool == "swa":
        dirty.swa_kv[:, :, dirty.swa_slots[position]] = 7.0
    else:
        dirty.full_kv[:, :, dirty.full_slots[position]] = 7.0
    want, _ = clean.forward(tokens, split, split + 1, tombstone=False)
    got, _ = dirty.forward(tokens, split, split + 1, tombstone=False)
    assert not torch.equal(got, want)


@pytest.mark.parametrize("changed", [LENGTH - 3, 0])
def test_a_token_inside_the_window_or_in_the_distant_past_changes_later_logits(model, one_shot, changed) -> None:
    tokens = tokens_for(1)
    tokens[changed] = (tokens[changed] + 1) % CONFIG.vocab_size
    run = Run(model, seed=4)
    logits, _ = run.prefill(tokens, [0, LENGTH])
    assert not torch.equal(logits[-1], one_shot[0][-1])
    assert not torch.equal(run.state, one_shot[1])


def test_distant_past_reaches_later_logits_through_full_layers_alone(model) -> None:
    """With the recurrent state restored to the original's, position 0 still matters: the full layers see it."""
    tokens = tokens_for(1)
    original = Run(model, seed=4)
    original.prefill(tokens, [0, LENGTH - 1])
    altered_tokens = tokens.clone()
    altered_tokens[0] = (altered_tokens[0] + 1) % CONFIG.vocab_size
    altered = Run(model, seed=4)
    altered.prefill(altered_tokens, [0, LENGTH - 1])
    altered.state.copy_(original.state)
    want, _ = original.forward(tokens, LENGTH - 1, LENGTH)
    got, _ = altered.forward(altered_tokens, LENGTH - 1, LENGTH)
    assert not torch.equal(got, want)


def test_continuing_from_a_restored_snapshot_equals_continuing_from_the_original(model, one_shot) -> None:
    want_logits, want_state, snapshots = one_shot
    p = 19
    tokens = tokens_for(1)
    restored = Run(model, seed=8)
    restored.prefill(tokens, [0, p])
    restored.state.copy_(torch.full_like(restored.state, float("nan")))  # whatever was there is gone ...
    restored.state.copy_(snapshots[p])  # ... and the checkpoint comes back
    logits, _ = restored.forward(tokens, p, LENGTH)
    assert same_bits(logits, want_logits[p:])
    assert same_bits(restored.state, want_state)
    fresh = Run(model, seed=8)
    fresh.prefill(tokens, [0, p])
    fresh.state.zero_()  # the state matters: a wrong one gives other logits
    wrong, _ = fresh.forward(tokens, p, LENGTH)
    assert not torch.equal(wrong, want_logits[p:])


def test_wait_layer_is_called_for_every_layer_in_order(model) -> None:
    calls: list[int] = []
    run = Run(model)
    run.forward(tokens_for(1), 0, 10, wait_layer=calls.append)
    run.forward(tokens_for(1), 10, 11, wait_layer=calls.append)
    assert calls == list(range(CONFIG.layers)) * 2


def test_pool_layer_indexes_each_kind_separately() -> None:
    assert [CONFIG.pool_layer(i) for i in range(CONFIG.layers)] == [0, 0, 0, 1, 1, 1]
    assert (CONFIG.full_layers, CONFIG.swa_layers, CONFIG.recurrent_layers) == (2, 2, 2)
    assert CONFIG.state_shape == (2, CONFIG.state_dim)
    assert CONFIG.full_geometry.layers == 2 and CONFIG.swa_geometry.layers == 2
    assert CONFIG.full_geometry.kv_heads == CONFIG.kv_heads and CONFIG.full_geometry.head_dim == CONFIG.head_dim


def test_swa_first() -> None:
    assert [CONFIG.swa_first(s) for s in (0, 3, 4, 5, 10)] == [0, 0, 0, 1, 6]


@pytest.mark.parametrize(
    "field, value",
    [
        ("layer_kinds", ("full", "swa", "mamba")),
        ("layer_kinds", ("full", "full", "recurrent")),
        ("layer_kinds", "full"),
        ("window", 0),
        ("q_heads", 3),
        ("head_dim", 5),
        ("state_dim", 0),
        ("hidden", -1),
        ("vocab_size", 1.5),
        ("dtype", torch.int32),
        ("seed", None),
    ],
)
def test_config_validation_names_the_field(field, value) -> None:
    with pytest.raises(ValueError, match=re.escape(f"HybridModelConfig.{field}")):
        HybridModelConfig(**{field: value})


def test_config_name_identifies_every_field() -> None:
    base = HybridModelConfig()
    assert re.fullmatch(r"tiny-hybrid-[0-9a-f]{16}", base.name)
    assert HybridModelConfig().name == base.name
    variants = [HybridModelConfig(seed=1), HybridModelConfig(window=23), HybridModelConfig(dtype=torch.bfloat16),
                HybridModelConfig(layer_kinds=("full", "recurrent", "swa")), HybridModelConfig(state_dim=16)]
    assert len({base.name, *(v.name for v in variants)}) == len(variants) + 1
    assert HybridModelConfig(layer_kinds=["full", "swa", "recurrent"]).layer_kinds == ("full", "swa", "recurrent")


def test_forward_rejects_misfitting_arguments(model) -> None:
    run = Run(model)
    tokens = tokens_for(1)
    with pytest.raises(ValueError, match="swa_slots"):
        model.forward(tokens[:10], 0, run.full_kv, run.full_slots[:10], run.swa_kv, run.swa_slots[:9], run.state)
    with pytest.raises(ValueError, match="full_slots"):
        model.forward(tokens[:10], 0, run.full_kv, run.full_slots[:11], run.swa_kv, run.swa_slots[:10], run.state)
    with pytest.raises(ValueError, match="snapshot_at"):
        model.forward(tokens[:10], 0, run.full_kv, run.full_slots[:10], run.swa_kv, run.swa_slots[:10], run.state, snapshot_at=(0,))
    with pytest.raises(ValueError, match="state"):
        model.forward(tokens[:10], 0, run.full_kv, run.full_slots[:10], run.swa_kv, run.swa_slots[:10], run.state[:1])
    with pytest.raises(ValueError, match="swa_kv"):
        model.forward(tokens[:10], 0, run.full_kv, run.full_slots[:10], run.full_kv[:, :1], run.swa_slots[:10], run.state)


def test_draft_config_is_a_working_tiny_decoder_on_full_slots(model) -> None:
    draft = CONFIG.draft_config()
    assert draft.vocab_size == CONFIG.vocab_size and draft.layers == 1 and draft.seed != CONFIG.seed
    assert draft.name != CONFIG.name and draft.max_positions == CONFIG.max_positions
    decoder = TinyDecoder(draft)
    geometry = draft.geometry
    tokens, run = tokens_for(1), Run(model)
    outputs = []
    for bounds in ([0, LENGTH], [0, 7, 8, 30, LENGTH]):
        kv = torch.full((geometry.halves, geometry.layers, SLOTS, geometry.kv_heads, geometry.head_dim), float("nan"), dtype=geometry.dtype)
        parts = [decoder.forward(tokens[s:e], kv, run.full_slots[s:e], run.full_slots[:e]) for s, e in zip(bounds, bounds[1:])]
        outputs.append(torch.cat(parts))
    assert outputs[0].shape == (LENGTH, CONFIG.vocab_size) and torch.isfinite(outputs[0]).all()
    assert same_bits(outputs[0], outputs[1])


def test_bfloat16_is_deterministic_per_chunking() -> None:
    config = HybridModelConfig(**{**CONFIG.__dict__, "dtype": torch.bfloat16})
    model = HybridDecoder(config)
    tokens = tokens_for(1)
    results = []
    for seed, bounds in ((0, [0, LENGTH]), (1, list(range(LENGTH + 1))), (2, random_bounds(3))):
        run = Run(model, seed=seed)
        logits, _ = run.prefill(tokens, bounds)
        results.append((logits, run.state))
    assert results[0][0].dtype == torch.bfloat16 and results[0][1].dtype == torch.bfloat16
    assert torch.isfinite(results[0][0]).all()
    for logits, state in results[1:]:
        assert same_bits(logits, results[0][0])
        assert same_bits(state, results[0][1])
