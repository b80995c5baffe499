"""Tables (Markdown), JSON and plots (PNG) of a ``hicache-storage bench`` run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hicache_storage.bench.stats import human_bytes, markdown_table


def overall_table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    baseline = next((r["overall"]["input_tokens_per_s"] for r in runs if r["tiers"] == "L1"), None)
    rows = []
    for run in runs:
        o = run["overall"]
        speedup = f"{o['input_tokens_per_s'] / baseline:.2f}x" if baseline else "-"
        bound = run.get("bound")
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
                o["device_tokens"],
                o["host_tokens"],
                o["storage_tokens"],
                _mib(run["storage_bytes_written"]),
                _mib(run["storage_bytes_read"]),
            )
        )
    return markdown_table(
        ["tiers", "hit rate", "TTFT mean ms", "p50", "p90", "p99", "input tok/s", "vs L1", "bound vs L1", "efficiency (limit)", "from L1", "from L2", "from L3", "L3 written", "L3 read"],
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
        f"Compute: {config['model']}"
        + (f" ({config['prefill_tokens_per_s']:,.0f} prefill tok/s, {config['decode_step_s'] * 1e3:.0f} ms/decode step)" if config["model"] == "modeled" else "")
        + f"; KV {human_bytes(config['kv_bytes_per_token'])}/token, page {config['page_size']} tokens, layout {config['layout']}.",
        f"L1 {config['device_tokens']:,} tokens, L2 {config['host_ratio']}x L1; L3: {config['backend']}; "
        f"write policy {config['write_policy']}, prefetch stop policy {config['stop_policy']}.",
        "",
        overall_table(result),
        "",
        *bound_lines(result),
    ]
    for run in result["runs"]:
        lines += ["", f"### {run['tiers']} per round", "", rounds_table(run)]
    return "\n".join(lines) + "\n"


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
    if "runs" in result:
        written[1].write_text(render_markdown(result))
        written.append(plot(result, out_dir / f"{stem}.png"))
    else:
        written[1].write_text(render_stop_policies(result))
    return written


def _mib(volume: int) -> str:
    """A volume moved, in whole MiB (``human_bytes`` names exact sizes: 12.4 GB read came out in KiB)."""
    return f"{volume / 2**20:,.0f} MiB" if volume else "0"
