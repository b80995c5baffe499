"""``hicache-storage bench --engine vllm``: the multi-turn workload on a real vLLM engine, L3 off vs on.

Runs in vLLM's environment (``bash scripts/vllm_env.sh`` prints its python). A random-weight
Llama is made at run time (no downloads); vLLM serves it on its CPU backend twice, one engine
after the other in this process, each with an empty cache:

* ``L1``: vLLM's own prefix cache only;
* ``L1+L3``: the same, with :class:`~hicache_storage.vllm.connector.HiCacheStorageConnector` on
  ``--backend`` (default: the file connector in a temporary directory).

The workload is the core bench's shape: ``--clients`` conversations of ``--rounds`` rounds; round
r's prompt is the conversation so far plus ``--request-length`` new tokens, answered with
``--output-length`` tokens; every client's round r is submitted at once (a round barrier), at
most ``--max-running`` requests run together, and vLLM's KV cache holds ``--device-tokens``
tokens, so longer histories fall out of L1 and come back from L3 or are recomputed; the model
runs in ``--dtype`` (bfloat16 unless float32 is asked for). Reported per
run: the hit rate (prompt tokens vLLM did not compute: its own prefix cache and L3), the part
from L3, TTFT (vLLM's time from arrival to first token) and input throughput (prompt tokens per
second of the run's wall time), and whether its greedy outputs equal the L1 run's. The other
bench options are the core engine's and are refused.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache_storage.commands import UsageError

#: The model the bench serves: 8 layers, 8 heads of 64 (4 KV heads), vocabulary 4,096.
BENCH_MODEL = {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1536, "vocab": 4096}
#: vLLM's CPU backend takes blocks in multiples of 32 tokens.
DEFAULT_BLOCK_SIZE = 32
#: Options of the core bench this runner does not take, with their defaults.
CORE_ONLY = {
    "tiers": None,
    "model": "modeled",
    "experiment": "multi-turn",
    "compare_stop_policies": False,
    "layout": "page_first",
    "write_policy": "write_through",
    "stop_policy": "timeout",
    "prefill_tokens_per_s": None,
    "decode_step_ms": None,
    "layers": None,
    "kv_heads": None,
    "head_dim": None,
    "no_round_barrier": False,
}
DEFAULTS = {"clients": 16, "rounds": 4, "request_length": 512, "device_tokens": 12288}
#: Model dtypes the vLLM run takes, with their bytes.
VLLM_DTYPES = {"bfloat16": 2, "float32": 4}


@dataclass
class RunResult:
    label: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    l3_tokens: int = 0
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    #: per round: (prompt tokens, cached tokens, mean TTFT)
    rounds: list[tuple[int, int, float]] = field(default_factory=list)
    #: every request's generated tokens, in order
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict[str, Any]:
        ttft = sorted(self.ttft_s)
        return {
            "run": self.label,
            "prompt_tokens": self.prompt_tokens,
            "hit_rate": round(self.hit_rate, 4),
            "l3_hit_rate": round(self.l3_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0,
            "ttft_mean_s": round(statistics.fmean(ttft), 4) if ttft else None,
            "ttft_p90_s": round(ttft[int(0.9 * (len(ttft) - 1))], 4) if ttft else None,
            "input_tokens_per_s": round(self.prompt_tokens / self.wall_s, 1) if self.wall_s else None,
            "wall_s": round(self.wall_s, 2),
        }


def _check_args(args: argparse.Namespace) -> dict[str, Any]:
    given = [f"--{name.replace('_', '-')}" for name, default in CORE_ONLY.items() if getattr(args, name, default) != default]
    if given:
        raise UsageError(
            f"bench --engine vllm: {', '.join(given)} {'is' if len(given) == 1 else 'are'} for the core engine; "
            "the vLLM run takes --backend, --config, --clients, --rounds, --request-length, --output-length, "
            "--max-running, --device-tokens, --page-size, --dtype (bfloat16 or float32), --seed and --out"
        )
    if args.config is not None and args.backend is None:
        raise UsageError("bench: --config configures the --backend named with it; add --backend (e.g. --backend file) or drop --config")
    if args.page_size % DEFAULT_BLOCK_SIZE:
        raise UsageError(f"bench --engine vllm: --page-size is vLLM's block size, a multiple of {DEFAULT_BLOCK_SIZE} on its CPU backend")
    shape = {name: getattr(args, name) if getattr(args, name) is not None else default for name, default in DEFAULTS.items()}
    # the core bench's default KV dtype (float8_e4m3fn) is a modeled one: vLLM's model runs in bfloat16 unless told
    shape["dtype"] = "bfloat16" if args.dtype == "float8_e4m3fn" else args.dtype
    if shape["dtype"] not in VLLM_DTYPES:
        raise UsageError(f"bench --engine vllm: --dtype is the model's dtype on vLLM's CPU backend: {' or '.join(VLLM_DTYPES)}")
    for name in ("clients", "rounds", "request_length", "device_tokens"):
        if shape[name] < 1:
            raise UsageError(f"bench: --{name.replace('_', '-')} must be at least 1, got {shape[name]}")
    return shape


def run_vllm_bench(args: argparse.Namespace) -> int:
    """The ``bench --engine vllm`` command (see the module docstring)."""
    shape = _check_args(args)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise UsageError(
            "bench --engine vllm needs vLLM: run it in vLLM's environment, e.g. "
            '"$(bash scripts/vllm_env.sh)" -m hicache_storage.cli bench --engine vllm'
        ) from None
    from hicache_storage.config import load_config_source
    from hicache_storage.vllm.tiny_model import TinyLlama, make_tiny_llama

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hicache-vllm-bench-") as scratch:
        model = make_tiny_llama(Path(scratch) / "model", TinyLlama(**BENCH_MODEL, seed=args.seed))
        if args.backend is None:
            store = {"connector": "file", "connector_config": {"root": str(Path(scratch) / "l3")}}
        else:
            store = {"connector": args.backend, "connector_config": load_config_source(args.config) if args.config else {}}
        questions = _questions(shape["clients"], shape["rounds"], shape["request_length"], args.seed)
        results = [
            _run(label, model, kv, shape, args, questions)
            for label, kv in (("L1", None), ("L1+L3", store))
        ]
    report = {
        "engine": "vllm",
        "model": BENCH_MODEL,
        "workload": {**shape, "output_length": args.output_length, "max_running": args.max_running, "block_size": args.page_size},
        "l3": {"connector": store["connector"]},
        "runs": [{**r.summary(), "outputs_equal_l1": r.outputs == results[0].outputs} for r in results],
        "rounds": {r.label: r.rounds for r in results},
    }
    (out / "bench-vllm.json").write_text(json.dumps(report, indent=2))
    table = render(report)
    (out / "bench-vllm.md").write_text(table + "\n")
    print(table)
    print(f"written: {out / 'bench-vllm.json'}, {out / 'bench-vllm.md'}")
    return 0


def _questions(clients: int, rounds: int, length: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    vocab = BENCH_MODEL["vocab"]
    return [[[rng.randrange(2, vocab) for _ in range(length)] for _ in range(rounds)] for _ in range(clients)]


def _kv_bytes_per_token(dtype: str) -> int:
    head_dim = BENCH_MODEL["hidden"] // BENCH_MODEL["heads"]
    return BENCH_MODEL["layers"] * 2 * BENCH_MODEL["kv_heads"] * head_dim * VLLM_DTYPES[dtype]  # K and V


def _run(
    label: str, model: Path, kv: dict[str, Any] | None, shape: dict[str, Any], args: argparse.Namespace, questions: list[list[list[int]]]
) -> RunResult:
    import gc

    from vllm import LLM, SamplingParams

    longest = shape["rounds"] * (shape["request_length"] + args.output_length) + DEFAULT_BLOCK_SIZE
    engine: dict[str, Any] = {
        "model": str(model),
        "dtype": shape["dtype"],
        "skip_tokenizer_init": True,
        "enable_prefix_caching": True,
        "enforce_eager": True,
        "block_size": args.page_size,
        "max_model_len": longest,
        "max_num_seqs": args.max_running,
        "kv_cache_memory_bytes": shape["device_tokens"] * _kv_bytes_per_token(shape["dtype"]),
        "disable_log_stats": False,
        "seed": args.seed,
    }
    if kv is not None:
        engine["kv_transfer_config"] = {
            "kv_connector": "HiCacheStorageConnector",
            "kv_connector_module_path": "hicache_storage.vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": kv,
        }
    llm = LLM(**engine)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_length, ignore_eos=True, detokenize=False)
    result = RunResult(label)
    histories: list[list[int]] = [[] for _ in questions]
    try:
        start = time.perf_counter()
        for r in range(shape["rounds"]):
            prompts = [histories[c] + questions[c][r] for c in range(len(questions))]
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            round_prompt = round_cached = 0
            round_ttft: list[float] = []
            for c, (prompt, output) in enumerate(zip(prompts, outputs)):
                histories[c] = prompt + list(output.outputs[0].token_ids)
                result.outputs.append(list(output.outputs[0].token_ids))
                round_prompt += len(prompt)
                round_cached += output.num_cached_tokens or 0
                report = (output.kv_transfer_params or {}).get("hicache_storage") or {}
                result.l3_tokens += report.get("loaded_tokens", 0)
                if output.metrics is not None and output.metrics.first_token_latency:
                    round_ttft.append(output.metrics.first_token_latency)
            result.prompt_tokens += round_prompt
            result.cached_tokens += round_cached
            result.ttft_s += round_ttft
            result.rounds.append((round_prompt, round_cached, round(statistics.fmean(round_ttft), 4) if round_ttft else 0.0))
        result.wall_s = time.perf_counter() - start
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return result


def render(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [
        f"vLLM {_vllm_version()} CPU engine, {report['model']['layers']}-layer random Llama in {w['dtype']}; {w['clients']} clients x "
        f"{w['rounds']} rounds x {w['request_length']} new tokens, {w['output_length']} generated, L1 {w['device_tokens']} "
        f"tokens, block {w['block_size']}; L3: {report['l3']['connector']}",
        "",
        "| run | hit rate | from L3 | TTFT mean (s) | TTFT p90 (s) | input tok/s | wall (s) | outputs = L1's |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        lines.append(
            f"| {run['run']} | {run['hit_rate']:.1%} | {run['l3_hit_rate']:.1%} | {run['ttft_mean_s']} | "
            f"{run['ttft_p90_s']} | {run['input_tokens_per_s']:,} | {run['wall_s']} | {'yes' if run['outputs_equal_l1'] else 'NO'} |"
        )
    base, l3 = report["runs"][0], report["runs"][-1]
    if base["input_tokens_per_s"] and l3["input_tokens_per_s"] and base["ttft_mean_s"] and l3["ttft_mean_s"]:
        lines += [
            "",
            f"L1+L3 vs L1: input throughput x{l3['input_tokens_per_s'] / base['input_tokens_per_s']:.2f}, "
            f"mean TTFT x{l3['ttft_mean_s'] / base['ttft_mean_s']:.2f}",
        ]
    return "\n".join(lines)


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))
