"""Radix-tree cost per conversation round: our tree next to SGLang's Python ``RadixCache``.

The trace (issue 9): ``--conversations`` conversations x ``--rounds`` rounds, interleaved round by
round. Each conversation starts with 64 random tokens; each round appends 100 random input tokens,
matches the whole conversation, appends 100 output tokens and inserts the whole conversation (its
whole pages). Run with page size 1 and 64. One "call" below is one match + one insert; only
those two calls are timed (appending tokens to a conversation is not).

Trees measured, in the same process and on the same tokens:

* ``ours``: :class:`hicache_core.radix_tree.RadixTree` fed a
  :class:`hicache_core.token_sequence.TokenSequence` per conversation (its page hashes are
  computed once per page, inside the timed calls);
* ``ours_list``: the same tree fed plain Python lists (the path without cached page hashes);
* ``sglang``: ``sglang.srt.mem_cache.radix_cache.RadixCache`` (a simulated cache: no memory
  pools), fed a ``RadixKey`` over an ``array('q')`` per conversation, when sglang is installed.

SGLang's ``radix_cache`` module imports its model-config package, which imports vision,
quantization and kernel packages (torchvision, tvm_ffi, ...) that the tree never calls. Where one
of those is not installed, an empty import-time stand-in is used for it, in this process only,
and the report lists which (``sglang_stand_ins``).

Usage: ``python benchmarks/tree.py --out results/tree`` (or ``python -m hicache_storage.benchmarks.tree``;
the full trace, about a minute), or ``--quick`` (a small trace, run by the tests so the script cannot rot; its timings mean nothing).
Writes ``tree.json`` and ``tree.md`` into ``--out``. :func:`bench_tree` and
:func:`render_markdown` are the programmatic entry points.

``--engine`` measures the reference engine's own tree calls instead (:func:`bench_engine`):
multi-turn conversations served by :class:`hicache_core.engine.Engine` with modeled compute
(no sleeps to speak of), timing only ``match_prefix``/``insert``/``insert_host`` and the
prefetch ``plan``, in three engines run round by round side by side on the same conversations:

* ``lists``: each tree call and plan gets the request's tokens as a plain list (converted
  outside the timed region): what the engine passed before it carried a TokenSequence;
* ``per_request``: the engine's own path with one TokenSequence per request
  (``session_sequences=0``), whose pages are hashed once per request (timed, with its build);
* ``sessions``: the engine's own path, each request continuing its session's last sequence
  (the default), so a conversation's pages are hashed once (timed, with its build).

Writes ``tree_engine.json`` and ``tree_engine.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import platform
import random
import sys
import time
import types
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from hicache_core.controller import ControllerConfig
from hicache_core.engine import CacheTiers, Engine, EngineConfig, Request
from hicache_core.model import ModelConfig, ModeledCompute
from hicache_core.radix_tree import RadixTree
from hicache_core.token_sequence import TokenSequence

FIRST_TOKENS = 64
INPUT_TOKENS = 100
OUTPUT_TOKENS = 100
VOCAB = 32000

#: Packages SGLang's config package imports at module level but the radix tree never uses.
SGLANG_STAND_IN_PACKAGES = ("torchvision", "tvm_ffi", "sentencepiece", "compressed_tensors", "gguf")


# --- trees under test ---------------------------------------------------------------------------


class _Driver:
    """One tree and its conversations; ``step`` returns the seconds spent in match + insert."""

    name = ""

    def add_conversation(self, tokens: list[int]) -> None:
        raise NotImplementedError

    def step(self, conversation: int, input_tokens: list[int], output_tokens: list[int]) -> float:
        raise NotImplementedError


def _slot_tensor(conversation: int, length: int) -> torch.Tensor:
    # Distinct fake device slots per conversation; the trees only store and slice them.
    return torch.arange(conversation * length, (conversation + 1) * length, dtype=torch.int64)


class OurTreeDriver(_Driver):
    def __init__(self, page_size: int, max_tokens: int, *, token_sequences: bool = True) -> None:
        self.name = "ours" if token_sequences else "ours_list"
        self.page_size = page_size
        self.max_tokens = max_tokens
        self.tree = RadixTree(page_size, lambda _slots: None)
        self.token_sequences = token_sequences
        self.conversations: list[Any] = []
        self.slots: list[torch.Tensor] = []

    def add_conversation(self, tokens: list[int]) -> None:
        tokens = list(tokens)
        self.conversations.append(TokenSequence(self.page_size, tokens) if self.token_sequences else tokens)
        self.slots.append(_slot_tensor(len(self.slots), self.max_tokens))

    def step(self, conversation: int, input_tokens: list[int], output_tokens: list[int]) -> float:
        tokens = self.conversations[conversation]
        tokens.extend(input_tokens)
        started = time.perf_counter()
        self.tree.match_prefix(tokens)
        elapsed = time.perf_counter() - started
        tokens.extend(output_tokens)
        aligned = len(tokens) - len(tokens) % self.page_size
        whole_pages = tokens.prefix(aligned) if self.token_sequences else tokens[:aligned]
        slots = self.slots[conversation][:aligned]
        started = time.perf_counter()
        self.tree.insert(whole_pages, slots)
        return elapsed + time.perf_counter() - started


class SGLangTreeDriver(_Driver):
    name = "sglang"

    def __init__(self, page_size: int, max_tokens: int, sglang: types.SimpleNamespace) -> None:
        self.sglang = sglang
        self.max_tokens = max_tokens
        self.cache = sglang.RadixCache.create_simulated(page_size=page_size)
        self.conversations: list[array] = []
        self.slots: list[torch.Tensor] = []

    def add_conversation(self, tokens: list[int]) -> None:
        self.conversations.append(array("q", tokens))
        self.slots.append(_slot_tensor(len(self.slots), self.max_tokens))

    def step(self, conversation: int, input_tokens: list[int], output_tokens: list[int]) -> float:
        # A RadixKey keeps the array it wraps (a new node's key may be that very array), so each
        # call gets its own copy, as SGLang's scheduler builds one per request; copies not timed.
        sg = self.sglang
        tokens = self.conversations[conversation]
        tokens.extend(input_tokens)
        key = sg.RadixKey(array("q", tokens))
        started = time.perf_counter()
        self.cache.match_prefix(sg.MatchPrefixParams(key=key))
        elapsed = time.perf_counter() - started
        tokens.extend(output_tokens)
        key = sg.RadixKey(array("q", tokens))
        slots = self.slots[conversation][: len(tokens)]
        started = time.perf_counter()
        self.cache.insert(sg.InsertParams(key=key, value=slots))
        return elapsed + time.perf_counter() - started


# --- loading SGLang -----------------------------------------------------------------------------


class _PlaceholderMeta(type):
    """Any attribute, call, subscript or union of a placeholder is the placeholder again, so
    module-level uses such as ``X.Y.Z``, ``X(...)`` or ``Optional[X]`` in SGLang's modules pass."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return _Placeholder

    def __getitem__(cls, item: Any) -> Any:
        return _Placeholder

    def __or__(cls, other: Any) -> Any:
        return _Placeholder

    __ror__ = __or__


class _Placeholder(metaclass=_PlaceholderMeta):
    pass


class _StandInModule(types.ModuleType):
    """Answers any attribute with the placeholder, so ``from X import Y`` succeeds."""

    __version__: str  # set on creation, for import-time version checks of the package stood in for

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, packages: Sequence[str]) -> None:
        self.packages = set(packages)
        self.used: set[str] = set()

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        top = name.partition(".")[0]
        if top not in self.packages:
            return None
        self.used.add(top)
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+stand-in"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def load_sglang() -> tuple[types.SimpleNamespace | None, list[str], str | None]:
    """SGLang's tree classes, the packages stood in for, and why it could not load (or None)."""
    names = ("RadixCache", "RadixKey", "MatchPrefixParams", "InsertParams")

    def attempt() -> types.SimpleNamespace:
        radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
        base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
        return types.SimpleNamespace(**{n: getattr(radix, n, None) or getattr(base, n) for n in names})

    try:
        return attempt(), [], None
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] not in SGLANG_STAND_IN_PACKAGES:
            return None, [], f"sglang not importable: {exc}"
    except Exception as exc:  # noqa: BLE001 - any failure means "no SGLang column", reported
        return None, [], f"sglang not importable: {exc!r}"
    finder = _StandInFinder([p for p in SGLANG_STAND_IN_PACKAGES if importlib.util.find_spec(p) is None])
    sys.meta_path.append(finder)
    try:
        return attempt(), sorted(finder.used), None
    except Exception as exc:  # noqa: BLE001
        return None, sorted(finder.used), f"sglang not importable even with stand-ins: {exc!r}"
    finally:
        sys.meta_path.remove(finder)


# --- the trace ----------------------------------------------------------------------------------


def make_trace(conversations: int, rounds: int, seed: int) -> tuple[list[list[int]], list[list[tuple[list[int], list[int]]]]]:
    """First tokens per conversation, and per round per conversation its input and output tokens."""
    rng = random.Random(seed)
    first = [[rng.randrange(VOCAB) for _ in range(FIRST_TOKENS)] for _ in range(conversations)]
    turns = [
        [([rng.randrange(VOCAB) for _ in range(INPUT_TOKENS)], [rng.randrange(VOCAB) for _ in range(OUTPUT_TOKENS)])
         for _ in range(conversations)]
        for _ in range(rounds)
    ]
    return first, turns


def run_trace(driver: _Driver, first: list[list[int]], turns: list[list[tuple[list[int], list[int]]]]) -> list[list[float]]:
    """Seconds per call, ``[round][conversation]``, conversations interleaved round by round.

    Trees run one after the other (not interleaved with each other), so one tree's objects never
    weigh on the other's garbage collections.
    """
    for tokens in first:
        driver.add_conversation(tokens)
    return [[driver.step(c, inputs, outputs) for c, (inputs, outputs) in enumerate(per_round)] for per_round in turns]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def bench_tree(
    rounds: int = 200,
    conversations: int = 16,
    page_sizes: Sequence[int] = (1, 64),
    *,
    bucket: int = 25,
    seed: int = 0,
    sglang: bool = True,
    lists: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the trace for each page size; returns the report (JSON-serializable).

    Per page size: for each bucket of ``bucket`` rounds the mean milliseconds per call (match +
    insert) of every tree and SGLang's / ours ratio, then our growth (last bucket / first, and
    last round / first round).
    """
    loaded, stand_ins, sglang_error = load_sglang() if sglang else (None, [], "not requested")
    max_tokens = FIRST_TOKENS + rounds * (INPUT_TOKENS + OUTPUT_TOKENS)
    report: dict[str, Any] = {
        "trace": {
            "conversations": conversations, "rounds": rounds, "first_tokens": FIRST_TOKENS,
            "input_tokens": INPUT_TOKENS, "output_tokens": OUTPUT_TOKENS, "seed": seed, "bucket_rounds": bucket,
        },
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__},
        "sglang": _sglang_version() if loaded else None,
        "sglang_error": sglang_error,
        "sglang_stand_ins": stand_ins,
        "page_sizes": {},
    }
    for page_size in page_sizes:
        first, turns = make_trace(conversations, rounds, seed)
        makers: list[Callable[[], _Driver]] = [lambda: OurTreeDriver(page_size, max_tokens)]
        if lists:
            makers.append(lambda: OurTreeDriver(page_size, max_tokens, token_sequences=False))
        if loaded is not None:
            makers.append(lambda: SGLangTreeDriver(page_size, max_tokens, loaded))
        costs: dict[str, list[list[float]]] = {}
        for make in makers:
            driver = make()
            if progress:
                progress(f"page size {page_size}: {driver.name}")
            costs[driver.name] = run_trace(driver, first, turns)
            del driver
            gc.collect()
        buckets = []
        for start in range(0, rounds, bucket):
            stop = min(start + bucket, rounds)
            row: dict[str, Any] = {"rounds": f"{start + 1}-{stop}"}
            for name, per_round in costs.items():
                row[f"{name}_ms"] = _mean([c for r in per_round[start:stop] for c in r]) * 1e3
            if "sglang_ms" in row:
                row["sglang_over_ours"] = row["sglang_ms"] / row["ours_ms"]
            buckets.append(row)
        ours = costs["ours"]
        report["page_sizes"][str(page_size)] = {
            "buckets": buckets,
            "ours_round_first_ms": _mean(ours[0]) * 1e3,
            "ours_round_last_ms": _mean(ours[-1]) * 1e3,
            "ours_growth_last_over_first_round": _mean(ours[-1]) / _mean(ours[0]),
            "ours_growth_last_over_first_bucket": buckets[-1]["ours_ms"] / buckets[0]["ours_ms"],
        }
    return report


def _sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - the version is informative only
        return "unknown"


def render_markdown(report: dict[str, Any]) -> str:
    trace = report["trace"]
    lines = [
        f"Trace: {trace['conversations']} conversations x {trace['rounds']} rounds; {trace['first_tokens']} first tokens, "
        f"+{trace['input_tokens']} input, match, +{trace['output_tokens']} output, insert. "
        "Mean milliseconds per call (one match + one insert).",
        "",
    ]
    if report["sglang"]:
        stand_ins = report["sglang_stand_ins"]
        lines.append(f"SGLang {report['sglang']} `RadixCache`" + (f" (import stand-ins: {', '.join(stand_ins)})." if stand_ins else "."))
    else:
        lines.append(f"SGLang not measured: {report['sglang_error']}.")
    for page_size, result in report["page_sizes"].items():
        columns = [k for k in result["buckets"][0] if k != "rounds"]
        lines += ["", f"Page size {page_size}:", "", "| rounds | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for row in result["buckets"]:
            lines.append(f"| {row['rounds']} | " + " | ".join(_fmt(c, row[c]) for c in columns) + " |")
        lines += [
            "",
            f"Ours: round 1 {result['ours_round_first_ms']:.3f} ms, round {trace['rounds']} {result['ours_round_last_ms']:.3f} ms "
            f"({result['ours_growth_last_over_first_round']:.2f}x); last bucket / first bucket "
            f"{result['ours_growth_last_over_first_bucket']:.2f}x.",
        ]
    return "\n".join(lines) + "\n"


def _fmt(column: str, value: float) -> str:
    return f"{value:.1f}x" if "_over_" in column else f"{value:.3f}"


# --- the engine's own path ----------------------------------------------------------------------

ENGINE_VARIANTS = ("lists", "per_request", "sessions")


class _TreeCallTimer:
    """Times an engine's tree calls and prefetch plans (and, optionally, its sequence builds).

    ``as_lists`` hands the tree and the planner plain lists instead of the engine's TokenSequence
    (converted before the clock starts), reproducing the engine before it carried sequences.
    """

    def __init__(self, engine: Engine, *, as_lists: bool) -> None:
        self.seconds = 0.0
        #: Seconds per call kind (``match_prefix``, ``insert``, ``insert_host``, ``plan``, ``build``).
        self.by_call: dict[str, float] = {}
        self.as_lists = as_lists
        tree = engine.tree
        for name in ("match_prefix", "insert", "insert_host"):
            setattr(tree, name, self._timed(getattr(tree, name)))
        prefetcher = engine.controller.prefetcher
        if prefetcher is not None:
            prefetcher.plan = self._timed(prefetcher.plan)  # type: ignore[method-assign]
        if not as_lists:  # building the sequence is part of the new path's cost
            engine._sequence_for = self._timed(engine._sequence_for, "build")  # type: ignore[method-assign]

    def reset(self) -> None:
        self.seconds = 0.0
        self.by_call = {}

    def _timed(self, call: Callable[..., Any], kind: str | None = None) -> Callable[..., Any]:
        kind = kind or call.__name__

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.as_lists:
                args = tuple(a.tolist() if isinstance(a, TokenSequence) else a for a in args)
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                self.seconds += elapsed
                self.by_call[kind] = self.by_call.get(kind, 0.0) + elapsed

        return timed


def _engine_for(variant: str, page_size: int, device_pages: int) -> Engine:
    config = EngineConfig(
        # A one-layer, one-KV-head model: KV copies stay small, the tree is what is measured.
        model=ModelConfig(layers=1, q_heads=1, kv_heads=1, head_dim=8, vocab_size=VOCAB),
        tiers=CacheTiers.L1_L2_L3,
        page_size=page_size,
        device_pages=device_pages,
        storage_backend="memory",
        storage_config={},
        controller=ControllerConfig(),
        max_running=16,
        compute=ModeledCompute(prefill_tokens_per_s=1e15, decode_step_s=0.0),
        session_sequences=0 if variant == "per_request" else 256,
    )
    return Engine(config)


def bench_engine(
    rounds: int = 100,
    conversations: int = 16,
    page_size: int = 16,
    *,
    input_tokens: int = INPUT_TOKENS,
    output_tokens: int = 8,
    bucket: int = 10,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Serve ``conversations`` x ``rounds`` turns through three engines (see the module docstring),
    round by round side by side; returns mean tree milliseconds per request per bucket of rounds.

    Every turn appends ``input_tokens`` to the conversation (prompts and outputs so far) and
    generates ``output_tokens``. Device and host pools hold every conversation whole, so every
    engine serves the same hits; outputs are checked equal across engines.
    """
    rng = random.Random(seed)
    first = [[rng.randrange(VOCAB) for _ in range(FIRST_TOKENS)] for _ in range(conversations)]
    turns = [[[rng.randrange(VOCAB) for _ in range(input_tokens)] for _ in range(conversations)] for _ in range(rounds)]
    longest = FIRST_TOKENS + rounds * (input_tokens + output_tokens)
    device_pages = conversations * (longest // page_size + 2) + 64
    engines = {variant: _engine_for(variant, page_size, device_pages) for variant in ENGINE_VARIANTS}
    timers = {variant: _TreeCallTimer(engine, as_lists=variant == "lists") for variant, engine in engines.items()}
    histories = {variant: [list(tokens) for tokens in first] for variant in ENGINE_VARIANTS}
    per_round: dict[str, list[float]] = {variant: [] for variant in ENGINE_VARIANTS}
    # Per call kind in the first and the last bucket: {bucket: {variant: {kind: ms per request}}}.
    edges = {0: f"1-{min(bucket, rounds)}", (rounds - 1) // bucket * bucket: f"{(rounds - 1) // bucket * bucket + 1}-{rounds}"}
    by_call: dict[str, dict[str, dict[str, float]]] = {label: {v: {} for v in ENGINE_VARIANTS} for label in edges.values()}
    try:
        for r in range(rounds):
            outputs: dict[str, list[list[int]]] = {}
            for variant, engine in engines.items():
                requests = [
                    Request(f"c{c}-r{r}", histories[variant][c] + turns[r][c], output_tokens, session_id=f"c{c}")
                    for c in range(conversations)
                ]
                timer = timers[variant]
                timer.reset()
                results = engine.serve(requests)
                per_round[variant].append(timer.seconds / conversations)
                start = r // bucket * bucket
                if start in edges:
                    calls, span = by_call[edges[start]][variant], min(start + bucket, rounds) - start
                    for kind, seconds in timer.by_call.items():
                        calls[kind] = calls.get(kind, 0.0) + seconds / conversations / span * 1e3
                outputs[variant] = [res.output_ids for res in results]
                histories[variant] = [req.tokens + res.output_ids for req, res in zip(requests, results)]
            if len({json.dumps(o) for o in outputs.values()}) != 1:
                raise AssertionError(f"round {r + 1}: the engines generated different tokens")
            if progress and (r + 1) % bucket == 0:
                progress(f"engine round {r + 1}/{rounds}")
    finally:
        for engine in engines.values():
            engine.close()
    buckets = []
    for start in range(0, rounds, bucket):
        stop = min(start + bucket, rounds)
        row: dict[str, Any] = {"rounds": f"{start + 1}-{stop}"}
        for variant in ENGINE_VARIANTS:
            row[f"{variant}_ms"] = _mean(per_round[variant][start:stop]) * 1e3
        row["lists_over_sessions"] = row["lists_ms"] / row["sessions_ms"]
        row["lists_over_per_request"] = row["lists_ms"] / row["per_request_ms"]
        buckets.append(row)
    return {
        "trace": {
            "conversations": conversations, "rounds": rounds, "first_tokens": FIRST_TOKENS, "input_tokens": input_tokens,
            "output_tokens": output_tokens, "page_size": page_size, "seed": seed, "bucket_rounds": bucket,
            "last_round_tokens": longest - output_tokens,
        },
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__},
        "buckets": buckets,
        "growth_last_over_first_bucket": {v: buckets[-1][f"{v}_ms"] / buckets[0][f"{v}_ms"] for v in ENGINE_VARIANTS},
        #: Mean milliseconds per request in the first and the last bucket, by call kind.
        "by_call_ms": by_call,
    }


def render_engine_markdown(report: dict[str, Any]) -> str:
    trace = report["trace"]
    columns = [k for k in report["buckets"][0] if k != "rounds"]
    lines = [
        f"Engine trace: {trace['conversations']} conversations x {trace['rounds']} rounds, page size {trace['page_size']}; "
        f"{trace['first_tokens']} first tokens, +{trace['input_tokens']} input and {trace['output_tokens']} generated per round "
        f"(prompt at the last round: {trace['last_round_tokens']} tokens). Mean milliseconds of tree calls and prefetch "
        "plans per request.",
        "",
        "| rounds | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for row in report["buckets"]:
        lines.append(f"| {row['rounds']} | " + " | ".join(_fmt(c, row[c]) for c in columns) + " |")
    growth = report["growth_last_over_first_bucket"]
    lines += ["", "Last bucket / first bucket: " + ", ".join(f"{v} {g:.2f}x" for v, g in growth.items()) + "."]
    for label, variants in report["by_call_ms"].items():
        lines += ["", f"Rounds {label}, milliseconds per request by call:", ""]
        for variant, calls in variants.items():
            lines.append(f"- {variant}: " + ", ".join(f"{kind} {ms:.3f}" for kind, ms in sorted(calls.items())))
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="default 200 (--engine: 100)")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=None, help="default 1 64 (--engine: 16)")
    parser.add_argument("--bucket", type=int, default=None, help="rounds per reported bucket: default 25 (--engine: 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-sglang", action="store_true", help="measure our tree only")
    parser.add_argument("--quick", action="store_true", help="a small trace (2 conversations x 8 rounds): proves the script runs")
    parser.add_argument("--out", type=Path, default=None, help="folder for tree.json and tree.md")
    parser.add_argument(
        "--engine", action="store_true",
        help="measure the engine's own tree calls (lists vs TokenSequence; default 16 x 100 rounds, page size 16)",
    )
    args = parser.parse_args(argv)
    if args.engine:
        return _main_engine(args)
    args.rounds, args.page_sizes, args.bucket = args.rounds or 200, args.page_sizes or [1, 64], args.bucket or 25
    if args.quick:
        args.rounds, args.conversations, args.bucket = 8, 2, 4
    report = bench_tree(
        args.rounds, args.conversations, args.page_sizes, bucket=args.bucket, seed=args.seed,
        sglang=not args.no_sglang, progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    _publish(report, render_markdown(report), args.out, "tree")
    return 0


def _main_engine(args: argparse.Namespace) -> int:
    rounds, bucket, conversations = args.rounds or 100, args.bucket or 10, args.conversations
    page_size = args.page_sizes[0] if args.page_sizes else 16
    if args.quick:
        rounds, conversations, bucket = 4, 2, 2
    report = bench_engine(
        rounds, conversations, page_size, bucket=bucket, seed=args.seed,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    _publish(report, render_engine_markdown(report), args.out, "tree_engine")
    return 0


def _publish(report: dict, markdown: str, out: Path | None, stem: str) -> None:
    """Print the Markdown; with ``--out``, write ``<stem>.json`` and ``<stem>.md`` there."""
    print(markdown)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / f"{stem}.md").write_text(markdown)


if __name__ == "__main__":
    sys.exit(main())
