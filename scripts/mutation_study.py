"""Measure the conformance suite's power: run it against every seeded bug in tests/helpers/broken_backends.py.

    python scripts/mutation_study.py [--out docs/reports/conformance/mutation-study.md] [--only NAME ...]
                                     [--concurrency-runs 20] [--concurrency-only]

For each mutant, runs ``hicache-storage conformance`` in full and with ``--quick`` (every clause,
no ``-x``), and records the clauses that fail. Then times the suite on the memory connector, full
and ``--quick``. Writes the table (bug -> clauses that catch it) and the timings as Markdown.

Then the concurrency mutants' detection rate: each runs the concurrency clauses
``--concurrency-runs`` times while a CPU burner keeps every core busy (one spinning process per
core), the condition under which fixed-round race tests lose their power. ``--concurrency-only``
runs just that part and rewrites only its section of ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELPERS = ROOT / "tests" / "helpers"  # broken_backends, the seeded bugs
sys.path.insert(0, str(HELPERS))

from broken_backends import MUTANTS  # noqa: E402


def run_suite(target: str, *extra: str) -> tuple[dict[str, str], float]:
    """Outcome per clause, and the run's wall time."""
    env = {**os.environ, "PYTHONPATH": f"{HELPERS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with tempfile.TemporaryDirectory(prefix="mutation-study-") as scratch:
        started = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "hicache_storage.cli", "conformance", target, "--report-dir", scratch, "--report-name", "run", *extra],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
        seconds = time.monotonic() - started
        report = Path(scratch) / "run.json"
        if not report.exists():
            return {"(no report)": "error"}, seconds
        data = json.loads(report.read_text())
    return {r["clause"]: r["outcome"] for r in data["results"]}, seconds


#: The clauses of conformance/clauses_concurrency.py, as a ``-k`` expression.
CONCURRENCY_CLAUSES = "concurrent or publication"
SECTION_BEGIN = "<!-- concurrency-study -->"
SECTION_END = "<!-- /concurrency-study -->"


@contextlib.contextmanager
def cpu_burner(processes: int | None = None) -> Iterator[int]:
    """Keep every core busy (one spinning process per core) while the block runs."""
    count = processes or os.cpu_count() or 1
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield count
    finally:
        for burner in burners:
            burner.kill()
        for burner in burners:
            burner.wait()


def concurrency_section(runs: int) -> list[str]:
    """Run every concurrency mutant's concurrency clauses ``runs`` times under a CPU burner."""
    names = [name for name, mutant in MUTANTS.items() if mutant.category == "concurrency"]
    rows = []
    with cpu_burner() as burners:
        for name in names:
            caught, clauses, seconds = 0, set(), 0.0
            for _ in range(runs):
                outcomes, took = run_suite(f"broken_backends:{name}", "-k", CONCURRENCY_CLAUSES)
                failing = caught_by(outcomes)
                caught += bool(failing)
                clauses.update(failing)
                seconds += took
            rows.append((name, caught, sorted(clauses), seconds / runs))
            print(f"{name}: caught in {caught} of {runs} runs under load", flush=True)
    lines = [
        SECTION_BEGIN,
        "## Concurrency mutants with every core busy",
        "",
        f"Each concurrency mutant ran the concurrency clauses (`-k \"{CONCURRENCY_CLAUSES}\"`) {runs} times while "
        f"{burners} spinning processes kept all {os.cpu_count()} cores busy (`scripts/mutation_study.py "
        "--concurrency-runs`). The clauses run until they have observed a stated number of calls overlapping "
        "the calls they race with (2 MiB pages, 100 overlaps, 120 s budget: "
        "`conformance/clauses_concurrency.py`), so their power is measured, not left to the machine's load. "
        "A `--concurrency-only` run rewrites this section alone: the tables above may come from an earlier full run.",
        "",
        "| bug | caught | detection rate | clauses that failed in any run | mean run (s) |",
        "|---|---|---|---|---|",
    ]
    for name, caught, clauses, mean_s in rows:
        lines.append(f"| `{name}` | {caught} of {runs} | {100 * caught / runs:.0f}% | {summarize(clauses)} | {mean_s:.1f} |")
    lines += ["", SECTION_END, ""]
    return lines


def write_section(path: Path, section: list[str]) -> None:
    """Replace the concurrency section of ``path`` (or append it)."""
    text = path.read_text() if path.exists() else ""
    block = "\n".join(section)
    pattern = re.compile(re.escape(SECTION_BEGIN) + ".*?" + re.escape(SECTION_END) + "\n?", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


def caught_by(outcomes: dict[str, str]) -> list[str]:
    return sorted(clause for clause, outcome in outcomes.items() if outcome in ("failed", "error"))


def summarize(clauses: list[str], limit: int = 6) -> str:
    """Clause names, parameterizations of one clause folded into ``name[a, b]``."""
    if not clauses:
        return "**not caught**"
    grouped: dict[str, list[str]] = {}
    for clause in clauses:
        name, _, param = clause.partition("[")
        grouped.setdefault(name, []).append(param.rstrip("]"))
    parts = []
    for name, params in grouped.items():
        params = [p for p in params if p]
        if not params:
            parts.append(f"`{name}`")
        elif len(params) <= 3:
            parts.append(f"`{name}[{', '.join(params)}]`")
        else:
            parts.append(f"`{name}` ({len(params)} params)")
    shown = parts[:limit]
    more = f" and {len(parts) - limit} more" if len(parts) > limit else ""
    return ", ".join(shown) + more


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "docs" / "reports" / "conformance" / "mutation-study.md"))
    parser.add_argument("--only", nargs="*", help="mutant names (default: all)")
    parser.add_argument("--concurrency-runs", type=int, default=20, help="runs per concurrency mutant under a CPU burner")
    parser.add_argument("--concurrency-only", action="store_true", help="only the concurrency detection rates")
    args = parser.parse_args()
    if args.concurrency_only:
        write_section(Path(args.out), concurrency_section(args.concurrency_runs))
        print(f"wrote {args.out}")
        return 0
    names = args.only or list(MUTANTS)
    rows = []
    for name in names:
        mutant = MUTANTS[name]
        full, full_s = run_suite(f"broken_backends:{name}")
        quick, quick_s = run_suite(f"broken_backends:{name}", "--quick")
        rows.append((mutant, caught_by(full), caught_by(quick)))
        print(f"{name}: full {len(caught_by(full))} clauses ({full_s:.0f} s), quick {len(caught_by(quick))} ({quick_s:.0f} s)", flush=True)
    full_memory, full_s = run_suite("memory")
    quick_memory, quick_s = run_suite("memory", "--quick")
    lines = [
        "# Mutation study: what the conformance suite catches",
        "",
        "Generated by `python scripts/mutation_study.py`; do not edit by hand.",
        "",
        "Each row is a seeded bug from `tests/helpers/broken_backends.py`: a small change to the memory connector",
        "that a vendor under deadline could ship. The suite ran in full and with `--quick` (no `-x`)",
        "against each; the columns list the clauses that failed. CI runs the same study with `-x`",
        "(`tests/conformance/test_conformance_detects_broken.py`): every mutant must fail the full suite, and those",
        "marked quick must fail `--quick` too. The bugs were written by the suite's authors, so this",
        "is a floor, not a blind measure: seeded bugs written by others are the better test.",
        "",
        f"**{sum(bool(r[1]) for r in rows)} of {len(rows)}** caught by the full suite; "
        f"**{sum(bool(r[2]) for r in rows if r[0].quick)} of {sum(r[0].quick for r in rows)}** quick-marked ones "
        f"caught by `--quick` ({sum(bool(r[2]) for r in rows)} of {len(rows)} in all).",
        "",
        "| bug | category | the bug | full suite: failing clauses | `--quick`: failing clauses |",
        "|---|---|---|---|---|",
    ]
    for mutant, full_clauses, quick_clauses in rows:
        quick_cell = summarize(quick_clauses) if (quick_clauses or mutant.quick) else "(not expected: needs a slow clause)"
        lines.append(
            f"| `{mutant.name}` | {mutant.category} | {mutant.summary} | {summarize(full_clauses)} ({len(full_clauses)}) | "
            f"{quick_cell}{f' ({len(quick_clauses)})' if quick_clauses else ''} |"
        )
    counts_full = {o: list(full_memory.values()).count(o) for o in ("passed", "failed", "unsupported", "skipped")}
    counts_quick = {o: list(quick_memory.values()).count(o) for o in ("passed", "failed", "unsupported", "skipped")}
    lines += [
        "",
        "## The suite's cost on a passing connector",
        "",
        f"Measured on this machine ({os.cpu_count()} cores) in the same run, `hicache-storage conformance memory`:",
        "",
        "| run | wall time | clauses |",
        "|---|---|---|",
        f"| full | {full_s:.1f} s | {', '.join(f'{n} {o}' for o, n in counts_full.items())} |",
        f"| `--quick` | {quick_s:.1f} s | {', '.join(f'{n} {o}' for o, n in counts_quick.items())} |",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    write_section(Path(args.out), concurrency_section(args.concurrency_runs))
    print(f"wrote {args.out}")
    missed = [r[0].name for r in rows if not r[1]] + [r[0].name for r in rows if r[0].quick and not r[2]]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
