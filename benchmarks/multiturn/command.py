"""The ``hicache-storage bench`` command, added to the SDK's CLI by entry point.

Registered in the ``hicache_storage.commands`` group (see :mod:`hicache_storage.commands`): the
SDK's CLI finds it there, so the SDK never imports this benchmark, nor the core it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hicache_storage.commands import UsageError, at_least, positive_rate

#: The CLI's --compute choices (hicache_storage.benchmarks.multiturn.runner.COMPUTE_PRESETS; kept
#: here too so that building the parser imports no torch).
COMPUTE_PRESET_NAMES = ("l4-7b", "h200-7b")

#: L1 (and L2) of a branch-backup run unless --device-tokens says otherwise: where its figures
#: in docs/benchmarks.md were first measured. The default preset's 12,288 gives the same restores
#: (a hybrid prefetch longer than the prefetch capacity runs alone instead of being capped).
BRANCH_BACKUP_DEVICE_TOKENS = 32768


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench",
        help="multi-turn serving benchmark: L1 vs L1+L2 vs L1+L2+L3 through the HiCache core",
        description="Run a multi-turn workload (shaped like SGLang's bench_multiturn) through the reference "
        "engine once per tier configuration, and report hit rate, TTFT and input throughput per round and "
        "overall. With no arguments: the file connector in a temporary directory, modeled compute.",
    )
    where = bench.add_argument_group("storage (L3)")
    where.add_argument("--backend", help="L3 backend name (default: file connector in a temporary directory)")
    where.add_argument("--config", help="L3 backend config: a JSON object or @path")
    work = bench.add_argument_group("workload")
    work.add_argument(
        "--preset",
        default="default",
        choices=["default", "long-history"],
        help="workload shape: 'default' (16 clients x 4 rounds, a few minutes) or 'long-history' (4 clients x 30 "
        "rounds, L1 32,768 tokens: history dominates, the case L3 exists for); the options below override it",
    )
    work.add_argument("--clients", type=int, help="conversations (default: 16; long-history: 4)")
    work.add_argument("--rounds", type=int, help="rounds per conversation (default: 4; long-history: 30)")
    work.add_argument("--request-length", type=int, help="new tokens per round (default: 512)")
    work.add_argument("--output-length", type=int, default=8, help="generated tokens per round (default: %(default)s)")
    work.add_argument("--max-running", type=int, default=4, help="most requests running at once (default: %(default)s)")
    work.add_argument(
        "--admission-order", default="fcfs", choices=["fcfs", "lpm"],
        help="which waiting request is tried first: the most prompt tokens cached on the device (lpm, as SGLang's "
        "--schedule-policy) or the first to arrive (default: %(default)s)",
    )
    work.add_argument("--no-round-barrier", action="store_true", help="let each client start its next round as soon as it can")
    work.add_argument("--seed", type=int, default=0)
    tiers = bench.add_argument_group("tiers and cache")
    tiers.add_argument("--tiers", help="comma-separated configurations to compare (default: L1,L1+L2,L1+L2+L3)")
    tiers.add_argument("--device-tokens", type=int, help="L1 capacity in tokens (default: 12288; long-history and branch-backup: 32768)")
    tiers.add_argument("--host-ratio", type=float, default=1.0, help="L2 capacity as a multiple of L1 (default: %(default)s)")
    tiers.add_argument("--page-size", type=int, default=64, help="tokens per page (default: %(default)s)")
    tiers.add_argument("--layout", default="page_first", choices=["page_first", "layer_first", "page_first_direct"])
    tiers.add_argument("--write-policy", default="write_through", choices=["write_through", "write_through_selective", "write_back"])
    tiers.add_argument(
        "--stop-policy",
        default="timeout",
        choices=["best_effort", "wait_complete", "timeout"],
        help="when a request stops waiting for its prefetch (default: %(default)s, the engine's; docs/benchmarks.md compares them)",
    )
    tiers.add_argument("--prefetch-threshold", type=at_least(0), default=256, help="least L3 hit, in tokens, worth a prefetch (default: %(default)s)")
    compute = bench.add_argument_group("compute")
    compute.add_argument(
        "--model",
        default="modeled",
        choices=["modeled", "reference", "hybrid-swa", "hybrid-swa-recurrent"],
        help="modeled cost (Qwen2.5-7B's KV), the real tiny model, or a modeled hybrid: FULL + SWA (DeepSeek-V4-Flash) or "
        "FULL + SWA + recurrent (Inkling-Small's compute on Hymba-1.5B's cache shape); docs/hybrid.md (default: %(default)s)",
    )
    compute.add_argument(
        "--compute",
        choices=sorted(COMPUTE_PRESET_NAMES),
        default=None,
        help="a named accelerator for --model modeled: l4-7b (Qwen2.5-7B on an NVIDIA L4: 4,000 prefill tok/s, 50 ms/decode step; "
        "the default) or h200-7b (the same model on an NVIDIA H200: 40,000 tok/s, 5 ms); docs/benchmarks.md derives them",
    )
    compute.add_argument("--prefill-tokens-per-s", type=float, default=None, help="modeled prefill rate (default: the model's or --compute's)")
    compute.add_argument("--decode-step-ms", type=float, default=None, help="modeled decode step of the whole batch (default: the model's or --compute's)")
    compute.add_argument(
        "--load-policy",
        default="cost",
        choices=["cost", "all"],
        help="which stored pages a prefetch loads: cost (those that arrive before computing them would be done, from speeds "
        "measured live; the default) or all (every stored page past the threshold, SGLang's behaviour); docs/benchmarks.md",
    )
    compute.add_argument("--layers", type=at_least(1), default=None, help="modeled KV layers (default: 28, Qwen2.5-7B)")
    compute.add_argument("--kv-heads", type=at_least(1), default=None, help="modeled KV heads (default: 4)")
    compute.add_argument("--head-dim", type=at_least(1), default=None, help="modeled head dim (default: 128)")
    compute.add_argument("--dtype", default="float8_e4m3fn", choices=["float8_e4m3fn", "bfloat16", "float16", "float32"], help="KV dtype (default: %(default)s)")
    bench.add_argument("--compare-stop-policies", action="store_true", help="instead: L1+L2+L3 under each stop policy, expensive and cheap recompute")
    experiment = bench.add_argument_group("experiments (the HiCache blog's)")
    experiment.add_argument(
        "--experiment",
        default="multi-turn",
        choices=["multi-turn", "branch-backup", "prefilled-l3"],
        help="multi-turn: the tier table (default); branch-backup: a shared prefix re-requested from L3 after its branches, "
        "checkpoint backfill on and off (hybrid --model only); prefilled-l3: L1+L2+L3 on an empty store and on one already "
        "holding the workload's KV",
    )
    experiment.add_argument("--shared-tokens", type=at_least(1), default=6400, help="branch-backup: shared prefix (default: %(default)s)")
    experiment.add_argument("--branch-tokens", type=at_least(1), default=3600, help="branch-backup: new tokens per branch (default: %(default)s)")
    experiment.add_argument("--branches", type=at_least(1), default=10, help="branch-backup: requests for the prefix from L3 (default: %(default)s)")
    bench.add_argument("--cheap-prefill-tokens-per-s", type=positive_rate, default=200_000.0, help="the cheap recompute of --compare-stop-policies (default: %(default)s)")
    bench.add_argument("--out", default="results", help="directory for bench.{json,md,png} (default: %(default)s)")
    bench.add_argument(
        "--engine",
        default="core",
        choices=["core", "vllm"],
        help="core: the reference engine (default); vllm: a real vLLM CPU engine, L3 off vs on, run in vLLM's "
        "environment (hicache_storage.benchmarks.multiturn.vllm_engine, docs/vllm.md)",
    )
    bench.set_defaults(run=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from hicache_storage.benchmarks.multiturn.vllm_engine import run_vllm_bench

        return run_vllm_bench(args)
    # Imported here, not at the top: the CLI loads this module to build its parser for every
    # command, and the runner pulls in torch.
    from hicache_core.controller import StopPolicy, WritePolicy
    from hicache_core.requests import AdmissionOrder
    from hicache_storage.benchmarks.multiturn.experiments import branch_backup, prefilled_l3
    from hicache_storage.benchmarks.multiturn.report import render, write_outputs
    from hicache_storage.benchmarks.multiturn.runner import PRESETS, TIER_CHOICES, BenchConfig, run_bench, stop_policy_comparison
    from hicache_storage.benchmarks.multiturn.workload import Workload
    from hicache_storage.config import load_config_source
    from hicache_storage.cost import LoadPolicy
    from hicache_storage.conformance.preflight import check_options

    shape = dict(PRESETS[args.preset])
    if args.experiment == "branch-backup":
        # The L1 and L2 the published figures were measured at (see BRANCH_BACKUP_DEVICE_TOKENS).
        shape["device_tokens"] = max(shape["device_tokens"], BRANCH_BACKUP_DEVICE_TOKENS)
    shape.update({name: getattr(args, name) for name in shape if getattr(args, name) is not None})
    try:
        tiers = tuple(TIER_CHOICES[t.strip()] for t in shape["tiers"].split(","))
    except KeyError as exc:
        raise UsageError(f"bench --tiers: unknown tier configuration {exc.args[0]!r}; choose from {', '.join(TIER_CHOICES)}") from None
    if args.config is not None and args.backend is None:
        raise UsageError("bench: --config configures the --backend named with it; add --backend (e.g. --backend file) or drop --config")
    try:
        workload = Workload(shape["clients"], shape["rounds"], shape["request_length"], args.output_length, args.max_running, not args.no_round_barrier, args.seed)
    except ValueError as exc:
        raise UsageError(f"bench: {exc}") from None
    if args.compute is not None and args.model != "modeled":
        raise UsageError(f"bench: --compute models Qwen2.5-7B's compute; it needs --model modeled, not {args.model}")
    if args.model.startswith("hybrid-") and any(getattr(args, n) is not None for n in ("layers", "kv_heads", "head_dim")):
        raise UsageError("bench: --layers, --kv-heads and --head-dim shape the FULL-only modeled model; a hybrid --model has its own shape (docs/hybrid.md)")
    if args.experiment == "branch-backup" and not args.model.startswith("hybrid-"):
        raise UsageError("bench: --experiment branch-backup needs a hybrid --model (hybrid-swa or hybrid-swa-recurrent)")
    if args.experiment != "multi-turn" and args.compare_stop_policies:
        raise UsageError("bench: --compare-stop-policies is a multi-turn mode; drop it or --experiment")
    modeled = {
        "prefill_tokens_per_s": args.prefill_tokens_per_s,
        "decode_step_s": args.decode_step_ms / 1e3 if args.decode_step_ms is not None else None,
        "layers": args.layers,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
    }
    try:
        config = BenchConfig(
            workload=workload,
            tiers=tiers,
            model=args.model,
            dtype=args.dtype,
            page_size=args.page_size,
            device_tokens=shape["device_tokens"],
            host_ratio=args.host_ratio,
            layout=args.layout,
            write_policy=WritePolicy(args.write_policy),
            stop_policy=StopPolicy(args.stop_policy),
            admission_order=AdmissionOrder(args.admission_order),
            prefetch_threshold=args.prefetch_threshold,
            load_policy=LoadPolicy(args.load_policy),
            compute=args.compute,
            backend=args.backend,
            backend_config=load_config_source(args.config) if args.config else None,
            **{name: value for name, value in modeled.items() if value is not None},
        )
    except ValueError as exc:
        raise UsageError(f"bench: {exc}") from None
    if args.backend is not None:
        # Opened once and closed before any run: an unknown backend, a bad config or a server that
        # does not answer is one line now, not an error midway through the first run.
        check_options(args.backend, args.config, None)
    from tqdm import tqdm

    if args.experiment == "branch-backup":
        try:
            result = branch_backup(config, args.shared_tokens, args.branch_tokens, args.branches)
        except ValueError as exc:
            raise UsageError(f"bench: {exc}") from None
        stem = "bench-branch-backup"
    else:
        runs = 2 * len(StopPolicy) if args.compare_stop_policies else 2 if args.experiment == "prefilled-l3" else len(tiers)
        with tqdm(total=runs * workload.rounds, unit="round", desc="bench") as bar:

            def progress(label: str, round_: int) -> None:
                bar.set_postfix_str(label)
                bar.update(1)

            if args.compare_stop_policies:
                result, stem = stop_policy_comparison(config, args.cheap_prefill_tokens_per_s, progress), "bench-stop-policies"
            elif args.experiment == "prefilled-l3":
                result, stem = prefilled_l3(config, progress), "bench-prefilled-l3"
            else:
                result, stem = run_bench(config, progress), "bench"
    written = write_outputs(result, Path(args.out), stem)
    print(render(result))
    print("written: " + ", ".join(str(p) for p in written))
    return 0
