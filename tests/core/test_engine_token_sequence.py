"""The engine carries one TokenSequence per request through every tree call and prefetch plan.

What is proven here: the tree and the planner get ``TokenSequence`` objects with the engine's
page size (never lists), prefetch keys are exactly SGLang's page-hash chain of the prompt
(``hicache_storage.keys.page_hashes``), a session's next turn reuses the previous turn's
hashes (pages are hashed once per conversation), and none of it changes a generated token.
The reference model is bit-exact whatever the cache does, so outputs and logits are compared
with an engine running with the cache off.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

import hicache_core.token_sequence as token_sequence_module
from hicache_core import CacheTiers, Engine, EngineConfig, Request
from hicache_core.controller import ControllerConfig
from hicache_core.prefetch import Prefetcher, PrefetchConfig, StopPolicy
from hicache_core.radix_tree import RadixTree
from hicache_core.token_sequence import TokenSequence
from hicache_storage.errors import InvalidKeyError
from hicache_storage.keys import page_hashes

from pinned_cost import LOAD_AND_STORE_EVERY_PAGE

ROOT = Path(__file__).resolve().parents[2]
PAGE = 4


def config(tiers: CacheTiers = CacheTiers.L1_L2_L3, **overrides: object) -> EngineConfig:
    settings: dict[str, object] = dict(
        tiers=tiers,
        page_size=PAGE,
        device_pages=96,
        host_pages=128,
        host_ratio=None,
        controller=ControllerConfig(prefetch=PrefetchConfig(threshold_tokens=8, stop_policy=StopPolicy.WAIT_COMPLETE)),
    )
    if tiers.storage:
        settings.update(storage_backend="memory", storage_config={})
    settings.update(overrides)
    return EngineConfig(**settings)  # type: ignore[arg-type]


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


class TreeSpy:
    """Records what the tree is asked to locate and what the planner returns."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.located: list[object] = []
        self.ops: list[object] = []
        locate, plan = RadixTree._locate, Prefetcher.plan

        def spy_locate(tree: RadixTree, tokens: object) -> object:
            self.located.append(tokens)
            return locate(tree, tokens)  # type: ignore[arg-type]

        def spy_plan(prefetcher: Prefetcher, request_id: str, tokens: object, match: object) -> object:
            op = plan(prefetcher, request_id, tokens, match)  # type: ignore[arg-type]
            self.ops.append((tokens, op))
            return op

        monkeypatch.setattr(RadixTree, "_locate", spy_locate)
        monkeypatch.setattr(Prefetcher, "plan", spy_plan)


def test_every_tree_call_and_plan_gets_a_token_sequence_and_prefetch_keys_are_sglang_chain(monkeypatch):
    spy = TreeSpy(monkeypatch)
    shared = prompt(40, seed=1)
    first = shared + prompt(9, seed=2)
    second = shared + prompt(30, seed=3)  # continues the cached 40 tokens: a prefetch with start > 0
    pinned = config()  # it counts the tokens L3 served: every page is written and read, whatever the speeds
    pinned.controller = dataclasses.replace(pinned.controller, cost=LOAD_AND_STORE_EVERY_PAGE)
    with Engine(pinned) as engine:
        engine.serve([Request("warm", first, max_new_tokens=3)])
        engine.flush_cache()  # L1 and L2 empty; L3 keeps the pages
        engine.serve([Request("again", first, max_new_tokens=3)])
        engine.drain()
        engine.flush_cache()
        engine.serve([Request("shared", shared + [7], max_new_tokens=2)])  # brings the shared prefix back
        served = engine.serve([Request("longer", second, max_new_tokens=3)])
        engine.drain()
        assert engine.metrics.snapshot()["storage_hit_tokens"] > 0

    # Matches, inserts, prefix-lost checks and host inserts of prefetched pages: all sequences.
    assert spy.located, "the engine made no tree call"
    assert all(isinstance(t, TokenSequence) and t.page_size == PAGE for t in spy.located), {type(t) for t in spy.located}
    planned = [(tokens, op) for tokens, op in spy.ops if op is not None]
    assert planned, "no prefetch was planned"
    assert all(isinstance(tokens, TokenSequence) and isinstance(op.tokens, TokenSequence) for tokens, op in planned)
    prompts = {len(first) - 1: first, len(shared): shared + [7], len(second) - 1: second}
    for tokens, op in planned:
        full = prompts[len(tokens)]
        end = op.start + op.pages * PAGE
        # Exactly the keys a list-fed planner (and SGLang) would use for the same prompt.
        assert op.hashes == page_hashes(full[:end], PAGE)[op.start // PAGE :]
        assert op.tokens.tolist() == full[:end]
    assert any(op.start > 0 for _, op in planned), "no prefetch continued a cached prefix"
    assert served[0].output_ids


def test_plan_gives_the_same_op_for_a_list_and_a_token_sequence():
    """Side by side on one matched prefix (start > 0): same keys, same tokens, same start."""
    tokens = prompt(64, seed=4)
    with Engine(config()) as engine:
        engine.serve([Request("prefix", tokens[:20] + [1], max_new_tokens=1)])
        engine.drain()
        prefetcher = engine.controller.prefetcher
        assert prefetcher is not None
        match = engine.tree.match_prefix(tokens)
        assert match.matched_length == 20
        from_list = prefetcher.plan("l", list(tokens), match)
        from_sequence = prefetcher.plan("s", TokenSequence(PAGE, tokens), match)
    assert from_list is not None and from_sequence is not None
    assert from_sequence.hashes == from_list.hashes == page_hashes(tokens[:64], PAGE)[5:]
    assert (from_sequence.start, from_sequence.pages) == (from_list.start, from_list.pages) == (20, 11)
    assert from_sequence.tokens.tolist() == from_list.tokens == tokens[:64]


class PageCounter:
    """Counts pages hashed by TokenSequence (its one chain function)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pages = 0
        chain = token_sequence_module._chain

        def counting(tokens, first, pages, page_size, prior, digests, hexes):  # type: ignore[no-untyped-def]
            self.pages += pages
            chain(tokens, first, pages, page_size, prior, digests, hexes)

        monkeypatch.setattr(token_sequence_module, "_chain", counting)


def run_conversation(engine: Engine, turns: list[list[int]], session_id: str | None, new_tokens: int = 3) -> list:
    history: list[int] = []
    results = []
    for r, turn in enumerate(turns):
        request = Request(f"{session_id}-{r}", history + turn, max_new_tokens=new_tokens, session_id=session_id)
        (result,) = engine.serve([request])
        history = request.tokens + result.output_ids
        results.append(result)
    return results


@pytest.mark.parametrize("tiers", [CacheTiers.L1, CacheTiers.L1_L2_L3])
def test_a_session_hashes_each_page_once_and_per_request_sequences_hash_every_prompt(monkeypatch, tiers):
    turns = [prompt(10, seed=10 + r) for r in range(6)]
    counter = PageCounter(monkeypatch)
    with Engine(config(tiers)) as engine:
        continued = run_conversation(engine, turns, "chat")
    continued_pages = counter.pages
    counter.pages = 0
    with Engine(config(tiers, session_sequences=0)) as engine:
        rebuilt = run_conversation(engine, turns, "chat")
    rebuilt_pages = counter.pages
    final_length = len(turns) * 10 + 5 * 3 + 2  # prompts, the outputs of earlier turns, two of the last
    # A session hashes each page of the conversation once (the last output has no KV, no page).
    assert continued_pages == final_length // PAGE
    # Without kept sequences each turn hashes its whole prompt again.
    assert rebuilt_pages > 2 * continued_pages
    assert [r.output_ids for r in continued] == [r.output_ids for r in rebuilt]
    assert [r.cached_tokens for r in continued] == [r.cached_tokens for r in rebuilt]


def test_session_sequences_give_bit_identical_tokens_and_logits_to_no_cache():
    rng = random.Random(5)
    conversations = [[prompt(rng.randint(3, 14), seed=100 * c + r) for r in range(4)] for c in range(3)]
    outputs = {}
    for name, cfg in {
        "off": config(CacheTiers.OFF),
        "sessions": config(),
        "per_request": config(session_sequences=0),
        "one_kept": config(session_sequences=1),  # sessions evict each other's kept sequences
    }.items():
        with Engine(cfg) as engine:
            runs = [(c, turn) for turn in range(4) for c in range(len(conversations))]  # interleaved
            histories = {c: [] for c in range(len(conversations))}
            results = []
            for c, turn in runs:
                request = Request(f"{c}-{turn}", histories[c] + conversations[c][turn], 4, session_id=f"s{c}")
                (result,) = engine.serve([request])
                histories[c] = request.tokens + result.output_ids
                results.append(result)
        outputs[name] = results
    reference = outputs.pop("off")
    for name, results in outputs.items():
        for got, want in zip(results, reference):
            assert got.output_ids == want.output_ids, name
            assert torch.equal(got.logits, want.logits), name
    assert sum(r.cached_tokens for r in outputs["sessions"]) > 0


def test_a_session_turn_that_rewrites_history_gets_a_fresh_sequence(monkeypatch):
    spy = TreeSpy(monkeypatch)
    with Engine(config(CacheTiers.L1)) as engine, Engine(config(CacheTiers.OFF)) as off:
        first = prompt(21, seed=7)
        (a,) = engine.serve([Request("a", first, 3, session_id="s")])
        edited = first[:8] + [255, 254, 253] + prompt(12, seed=8)  # diverges from the kept sequence
        (b,) = engine.serve([Request("b", edited, 3, session_id="s")])
        (want,) = off.serve([Request("b", edited, 3)])
        assert b.output_ids == want.output_ids and torch.equal(b.logits, want.logits)
        assert b.cached_device == 8  # the shared first two pages only
        assert engine.close_session("s")
        assert "s" not in engine._session_sequences
    located = [t for t in spy.located if len(t) == len(edited) - 1]
    assert located and all(t.tolist() == edited[:-1] for t in located)


def test_continuation_shares_hashes_only_with_a_true_prefix():
    base = TokenSequence(2, range(10))
    base.page_hashes()
    continued = base.continuation(list(range(10)) + [40, 41, 42])
    assert continued is not None and continued.tolist() == list(range(10)) + [40, 41, 42]
    assert continued.page_hashes() == page_hashes(continued.tolist(), 2)
    assert base.tolist() == list(range(10)) and base.num_pages == 5  # the base view never changes
    assert base.continuation([0, 1, 2, 9]) is None  # diverges
    assert base.continuation(list(range(9))) is None  # shorter than the base
    # The base is no longer at the tip: a second continuation copies instead of overwriting.
    other = base.continuation(list(range(10)) + [7, 7])
    assert other is not None and other.tolist() == list(range(10)) + [7, 7]
    assert continued.tolist() == list(range(10)) + [40, 41, 42]
    assert other.page_hashes() == page_hashes(other.tolist(), 2)
    with pytest.raises(InvalidKeyError):
        base.continuation(list(range(10)) + [-1])


def test_engine_benchmark_quick_mode_runs_and_reports_every_variant(tmp_path):
    spec = importlib.util.spec_from_file_location("hicache_tree_benchmark_engine", ROOT / "benchmarks" / "tree.py")
    assert spec is not None and spec.loader is not None
    tree_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tree_bench)  # a script folder, not a package
    assert tree_bench.main(["--engine", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "tree_engine.json").read_text())
    assert [row["rounds"] for row in report["buckets"]] == ["1-2", "3-4"]
    for row in report["buckets"]:
        assert all(row[f"{v}_ms"] > 0 for v in ("lists", "per_request", "sessions"))
    assert "lists_over_sessions" in (tmp_path / "tree_engine.md").read_text()
