"""The grid's command line (benchmarks/grid.py): names it does not know are refused before any
server starts, and its defaults name only stores and compute presets that exist. The grid's runs
themselves are the multi-turn bench's, tested in test_bench_multiturn.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hicache_storage.benchmarks import grid
from hicache_storage.benchmarks.multiturn.runner import COMPUTE_PRESETS


def run_grid_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hicache_storage.benchmarks.grid", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "named", "choices"),
    [
        (["--compute", "h200-7b,gpu-h100"], "unknown compute 'gpu-h100'", "choose from l4-7b, h200-7b"),
        (["--stores", "file,nfs"], "unknown store 'nfs'", "choose from file, redis, s3, mooncake, sglang-file"),
    ],
)
def test_unknown_names_are_refused_with_the_choices(args, named, choices, tmp_path):
    done = run_grid_cli(*args, "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr
    assert named in done.stderr and choices in done.stderr
    assert not (tmp_path / "out").exists(), "nothing may run before the names are checked"


def test_defaults_name_only_known_stores_and_presets(monkeypatch):
    seen = {}

    def fake_run_grid(stores, computes, preset, out):
        seen.update(stores=stores, computes=computes, preset=preset)
        return {"preset": preset, "points": []}

    monkeypatch.setattr(grid, "run_grid", fake_run_grid)
    monkeypatch.setattr(sys, "argv", ["grid"])
    assert grid.main() == 0
    assert seen == {"stores": list(grid.STORES), "computes": list(COMPUTE_PRESETS), "preset": "long-history"}
