"""Tables (Markdown), JSON and plots (PNG) of a ``hicache-storage bench`` run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hicache_storage.benchmarks.stats import human_bytes, markdown_table


def overall_table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    baseline = next((r["overall"]["input_tokens_per_s"] for r in runs if r["tiers"] == "L1"), None)
    rows = []
    for run in runs:
        o = run["overall"]
        speedup = f"{o['input_tokens_per_s'] / baseline:.2f}x" if baseline else "-"
        bound = run.get("bound")
        reachable = run.get("reachable")
        rows.append(
            (
                run["tiers"],
                f"{o['cache_hit_rate']:.1%}",
                o["ttft_mean_ms"],
                o["ttft_p50_ms"],
                o["ttft_p90_ms"],
                o["ttft_p99_ms"],
                o["input_tokens_per_s"],
                speedup,
                f"{bound['bound_vs_l1']:.2f}x" if bound and bound["bound_vs_l1"] is not None else "-",
                f"{bound['efficiency']:.2f} ({bound['limit']})" if bound else "-",
                f"{reachable['bound_vs_l1']:.2f}x" if reachable and reachable["bound_vs_l1"] is not None else "-",
                f"{reachable['efficiency']:.2f}" if reachable else "-",
                o["device_tokens"],
                o["host_tokens"],
                o["storage_tokens"],
                _mib(run["storage_bytes_written"]),
                _mib(run["storage_bytes_read"]),
            )
        )
    return markdown_table(
        [
            "tiers", "hit rate", "TTFT mean ms", "p50", "p90", "p99", "input tok/s", "vs L1", "bound vs L1", "efficiency (limit)",
            "reachable vs L1", "efficiency (reachable)", "from L1", "from L2", "from L3", "L3 written", "L3 read",
        ],
        rows,
    )


def bound_lines(result: dict[str, Any]) -> list[str]:
    """The measured legs and each configuration's leg times: where the bound comes from."""
    legs = result.get("legs")
    if legs is None or legs["prefill_tokens_per_s"] is None:
        return ["No bound: the reference model has no modeled compute to hold the run to."]
    store = (
        f"store write {legs['storage_write'] / 1e9:.2f} GB/s, read {legs['storage_read'] / 1e9:.2f} GB/s"
        if legs["storage_write"] is not None
        else "no store"
    )
    lines = [
        f"Legs measured in this run: {store}; device -> host backup {legs['backup'] / 1e9:.2f} GB/s, "
        f"host -> device load {legs['load'] / 1e9:.2f} GB/s; compute {legs['prefill_tokens_per_s']:,.0f} prefill tok/s "
        f"and {legs['decode_step_s'] * 1e3:.0f} ms per decode step (modeled). Bound = the busiest leg's time (legs "
        "overlapping perfectly); efficiency = bound / wall time; bound vs L1 = L1's wall time / bound.",
        "",
    ]
    rows = [
        (run["tiers"], run["bound"]["compute_s"], run["bound"]["storage_s"], run["bound"]["copies_s"], run["bound"]["bound_s"], run["bound"]["wall_s"], f"{run['bound']['efficiency']:.2f}")
        for run in result["runs"]
        if run.get("bound")
    ]
    lines.append(markdown_table(["tiers", "compute s", "storage s", "copies s", "bound s", "wall s", "efficiency"], rows))
    reachable = [
        (
            run["tiers"],
            run["reachable"]["bound_s"],
            run["reachable"]["wall_s"],
            f"{run['reachable']['efficiency']:.2f}",
            int(run["metrics"]["storage_hit_tokens"]),
            int(run["metrics"].get("storage_recomputed_tokens", 0)),
            run["reachable"]["best_loaded_tokens"],
            run["reachable"]["best_recomputed_tokens"],
        )
        for run in result["runs"]
        if run.get("reachable")
    ]
    if reachable:
        lines += [
            "",
            "Reachable bound: round by round, each request's compute after its own loads, the least decode steps, L1's "
            f"capacity, the store and the copies sharing the machine (measured overlap {legs.get('overlap', 1.0):.2f}: 1 is "
            "none, 2 perfect), and the best choice between loading and computing each stored token "
            "(benchmarks/multiturn/reachable.py). "
            "The run's choice (the cost model's) beside the best one:",
            "",
            markdown_table(
                ["tiers", "reachable s", "wall s", "efficiency", "loaded from L3", "stored, recomputed", "best: loaded", "best: recomputed"], reachable
            ),
        ]
    side = [(run["tiers"], run["side_pool_bytes"]) for run in result["runs"] if run.get("side_pool_bytes")]
    if side:
        lines += [
            "",
            "Storage and copies include the SWA and checkpoint pools, timed at the FULL pool's speeds: "
            + "; ".join(
                f"{tiers} loaded {_mib(b['load'])}, backed up {_mib(b['backup'])}, read from L3 {_mib(b['storage_read'])}"
                + (f" (their copies: {b['load_seconds'] + b['backup_seconds']:.2f} s of synchronous calls)" if "load_seconds" in b else "")
                for tiers, b in side
            )
            + ".",
        ]
    return lines


def rounds_table(run: dict[str, Any]) -> str:
    rows = [
        (r["round"], f"{r['cache_hit_rate']:.1%}", r["ttft_mean_ms"], r["ttft_p50_ms"], r["ttft_p90_ms"], r["ttft_p99_ms"], r["input_tokens_per_s"], r["device_tokens"], r["host_tokens"], r["storage_tokens"], r["computed_tokens"])
        for r in run["rounds"]
    ]
    return markdown_table(["round", "hit rate", "TTFT mean ms", "p50", "p90", "p99", "input tok/s", "from L1", "from L2", "from L3", "computed"], rows)


def render_markdown(result: dict[str, Any]) -> str:
    config = result["config"]
    workload = config["workload"]
    lines = [
        "## hicache-storage bench",
        "",
        f"Workload: {workload['clients']} clients x {workload['rounds']} rounds, {workload['request_length']} new tokens "
        f"+ {workload['output_length']} output tokens per round, max {workload['max_running']} running, "
        f"round barrier {'on' if workload['round_barrier'] else 'off'}, seed {workload['seed']}.",
        _compute_line(config),
        f"L1 {config['device_tokens']:,} tokens, L2 {config['host_ratio']}x L1; L3: {config['backend']}; "
        f"write policy {config['write_policy']}, prefetch stop policy {config['stop_policy']}, "
        f"admission order {config.get('admission_order', 'fcfs')}.",
        "",
        overall_table(result),
        "",
        *bound_lines(result),
    ]
    for run in result["runs"]:
        lines += ["", f"### {run['tiers']} per round", "", rounds_table(run)]
    return "\n".join(lines) + "\n"


def _compute_line(config: dict[str, Any]) -> str:
    modeled = config["model"] != "reference"
    line = f"Compute: {config['model']}" + (
        f" ({config['prefill_tokens_per_s']:,.0f} prefill tok/s, {config['decode_step_s'] * 1e3:.1f} ms/decode step)" if modeled else ""
    )
    hybrid = config.get("hybrid")
    if hybrid:
        line += (
            f", modeled {hybrid['model']}; FULL KV {human_bytes(hybrid['full_per_token'])}/token, SWA KV "
            f"{human_bytes(hybrid['swa_per_token'])}/token (window {hybrid['window']})"
            + (f", recurrent checkpoint {hybrid['checkpoint'] / 1e6:.1f} MB" if hybrid["checkpoint"] else "")
        )
    else:
        line += f"; KV {human_bytes(config['kv_bytes_per_token'])}/token"
    return line + f", page {config['page_size']} tokens, layout {config['layout']}."


def render(result: dict[str, Any]) -> str:
    """The Markdown of any bench result: tiers, stop policies, or an experiment."""
    if "runs" in result:
        return render_markdown(result)
    if "stop_policies" in result:
        return render_stop_policies(result)
    if "branch_backup" in result:
        return render_branch_backup(result)
    return render_prefilled_l3(result)


def render_branch_backup(result: dict[str, Any]) -> str:
    shape = result["shape"]
    rows = [
        (
            "on" if r["backfill"] else "off",
            f"{r['full_restores']}/{r['requests']}",
            f"{r['token_hit_rate']:.2%}",
            r["ttft_mean_ms"],
            ", ".join(str(t) for t in r["cached_from_l3"]),
        )
        for r in result["branch_backup"]
    ]
    return (
        "## Branch backup (L1+L2+L3, L1 and L2 emptied before each request)\n\n"
        + _compute_line(result["config"])
        + f"\n\nShared prefix {shape['shared']:,} tokens + {shape['new']:,} new tokens per request, {shape['branches']} requests; "
        f"a full restore brings back all {shape['restorable']:,} whole-page prefix tokens from L3.\n\n"
        + markdown_table(["checkpoint backfill", "full restores", "token hit rate", "TTFT mean ms", "tokens from L3 per request"], rows)
        + "\n"
    )


def render_prefilled_l3(result: dict[str, Any]) -> str:
    rows = [
        (
            r["run"],
            f"{r['overall']['cache_hit_rate']:.1%}",
            r["overall"]["input_tokens_per_s"],
            r["overall"]["ttft_mean_ms"],
            r["overall"]["storage_tokens"],
            f"{r['fill_s']:.1f}" if r["fill_s"] is not None else "-",
        )
        for r in result["prefilled_l3"]
    ]
    workload = result["config"]["workload"]
    return (
        "## Pre-filled L3 (L1+L2+L3; fresh L1 and L2 in both runs)\n\n"
        + _compute_line(result["config"])
        + f"\n\nWorkload: {workload['clients']} clients x {workload['rounds']} rounds, {workload['request_length']} new tokens per round.\n\n"
        + markdown_table(["L3", "hit rate", "input tok/s", "TTFT mean ms", "from L3", "fill s (not timed)"], rows)
        + "\n"
    )


def plot_experiment(result: dict[str, Any], path: Path) -> Path:
    """Bars of an experiment: full restores and hit rate (branch backup), or throughput and TTFT (pre-filled L3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    if "branch_backup" in result:
        rows = result["branch_backup"]
        labels = [f"backfill {'on' if r['backfill'] else 'off'}" for r in rows]
        left.bar(labels, [r["full_restores"] for r in rows], color=["tab:green", "tab:gray"])
        left.set(title="Full restores of the shared prefix", ylabel=f"of {rows[0]['requests']} requests", ylim=(0, rows[0]["requests"]))
        right.bar(labels, [100 * r["token_hit_rate"] for r in rows], color=["tab:green", "tab:gray"])
        right.set(title="Token hit rate", ylabel="cached / prompt tokens (%)", ylim=(0, 100))
    else:
        rows = result["prefilled_l3"]
        labels = [r["run"] for r in rows]
        left.bar(labels, [r["overall"]["input_tokens_per_s"] for r in rows], color=["tab:gray", "tab:green"])
        left.set(title="Input throughput", ylabel="tokens/s")
        right.bar(labels, [r["overall"]["ttft_mean_ms"] for r in rows], color=["tab:gray", "tab:green"])
        right.set(title="Mean TTFT", ylabel="ms")
    for ax in (left, right):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def render_stop_policies(result: dict[str, Any]) -> str:
    rows = [
        (r["recompute"], r["prefill_tokens_per_s"], r["stop_policy"], f"{r['overall']['cache_hit_rate']:.1%}", r["overall"]["ttft_mean_ms"], r["overall"]["ttft_p99_ms"], r["overall"]["input_tokens_per_s"], r["overall"]["storage_tokens"], int(r["metrics"]["prefetch_terminated_early"]))
        for r in result["stop_policies"]
    ]
    table = markdown_table(["recompute", "prefill tok/s", "stop policy", "hit rate", "TTFT mean ms", "TTFT p99 ms", "input tok/s", "from L3", "prefetches cut short"], rows)
    return "## Prefetch stop policies (L1+L2+L3)\n\n" + table + "\n"


def plot(result: dict[str, Any], path: Path) -> Path:
    """Per-round mean TTFT and cache hit rate of each tier configuration, as in the HiCache blog."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft_ax, hit_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for run in result["runs"]:
        rounds = [r["round"] + 1 for r in run["rounds"]]
        ttft_ax.plot(rounds, [r["ttft_mean_ms"] for r in run["rounds"]], marker="o", label=run["tiers"])
        hit_ax.plot(rounds, [100 * r["cache_hit_rate"] for r in run["rounds"]], marker="o", label=run["tiers"])
    ttft_ax.set(title="Mean TTFT per round", xlabel="round", ylabel="TTFT (ms)")
    hit_ax.set(title="Cache hit rate per round", xlabel="round", ylabel="cached / prompt tokens (%)", ylim=(0, 100))
    for ax in (ttft_ax, hit_ax):
        ax.set_xticks(range(1, len(result["runs"][0]["rounds"]) + 1))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(result: dict[str, Any], out_dir: Path, stem: str = "bench") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    written[0].write_text(json.dumps(result, indent=2))
    written[1].write_text(render(result))
    if "runs" in result:
        written.append(plot(result, out_dir / f"{stem}.png"))
    elif "experiment" in result:
        written.append(plot_experiment(result, out_dir / f"{stem}.png"))
    return written


def _mib(volume: float) -> str:
    """A volume moved, in whole MiB (``human_bytes`` names exact sizes: 12.4 GB read came out in KiB)."""
    return f"{volume / 2**20:,.0f} MiB" if volume else "0"
