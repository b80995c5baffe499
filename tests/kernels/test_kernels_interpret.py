"""The Triton kernel, run by Triton's interpreter on the CPU, is bit-identical to the torch backend.

``TRITON_INTERPRET=1`` must be set before the kernel is defined and would change how every later
kernel in the process runs, so the cases run in a child pytest process that has it set from the
start. In the parent process (the normal suite) this module holds one test: run the child and
require every case to pass. With the variable already set (the child, or a developer running the
module by hand), the cases themselves are collected.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
RANDOM_CASES = 48
EDGE_CASES = 6 * 3  # six edge cases, each in three layouts
OTHER_TESTS = 2  # dispatch under the interpreter, the GPU benchmark's dry run with Triton

if not INTERPRETED:

    @pytest.mark.slow
    def test_every_interpreter_case_passes_in_a_child_process() -> None:
        pytest.importorskip("triton", reason="the Triton kernels need triton (pip install 'hicache-storage[kernels]')")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        env.pop("HICACHE_KERNEL_BACKEND", None)
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=280", __file__],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=Path(__file__).resolve().parents[2],
        )
        output = result.stdout + result.stderr
        assert result.returncode == 0, output
        summary = re.search(r"(\d+) passed", output)
        assert summary and int(summary.group(1)) == RANDOM_CASES + EDGE_CASES + OTHER_TESTS, output
        assert not re.search(r"\d+ (skipped|failed|error)", output), output

else:
    from hicache_storage.kernels import KVLayout, backup, host_shape, load, load_layer, select_backend

    DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn)

    def random_bits(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
        width = torch.empty(0, dtype=dtype).element_size()
        raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * width), dtype=torch.uint8, generator=generator)
        return raw.view(dtype)

    def indices(pattern: str, device_slots: int, host_slots: int, page_size: int, generator: torch.Generator):
        if pattern == "pages":
            pages = min(device_slots, host_slots) // page_size
            count = int(torch.randint(1, pages + 1, (), generator=generator))
            offsets = torch.arange(page_size)
            device_pages = torch.randperm(device_slots // page_size, generator=generator)[:count]
            host_pages = torch.randperm(host_slots // page_size, generator=generator)[:count]
            return (
                (device_pages[:, None] * page_size + offsets).reshape(-1),
                (host_pages[:, None] * page_size + offsets).reshape(-1),
            )
        if pattern == "all_reversed":
            count = min(device_slots, host_slots)
            return torch.arange(count), torch.arange(count).flip(0)
        count = int(torch.randint(1, min(device_slots, host_slots) + 1, (), generator=generator))
        if pattern == "unaligned_run":
            device_start = int(torch.randint(0, device_slots - count + 1, (), generator=generator))
            host_start = int(torch.randint(0, host_slots - count + 1, (), generator=generator))
            return torch.arange(device_start, device_start + count), torch.arange(host_start, host_start + count)
        device_idx = torch.randperm(device_slots, generator=generator)[:count]
        host_idx = torch.randperm(host_slots, generator=generator)[:count]
        return device_idx, host_idx

    def assert_triton_matches_torch(
        *,
        layout: KVLayout,
        dtype: torch.dtype,
        halves: int,
        layers: int,
        heads: int,
        head_dim: int,
        page_size: int,
        device_pages: int,
        host_pages: int,
        pattern: str,
        seed: int,
        misalign_host: bool = False,
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        device_slots, host_slots = device_pages * page_size, host_pages * page_size
        device_kv = random_bits((halves, layers, device_slots, heads, head_dim), dtype, generator)
        shape = host_shape(
            layout, halves=halves, layers=layers, slots=host_slots, heads=heads, head_dim=head_dim, page_size=page_size
        )
        host_kv = random_bits(shape, dtype, generator)
        if misalign_host:
            # Same values one element past an aligned address: the kernel must pick narrower words.
            moved = torch.empty(host_kv.numel() + 1, dtype=dtype)[1:].view(shape)
            moved.copy_(host_kv)
            host_kv = moved
        device_idx, host_idx = indices(pattern, device_slots, host_slots, page_size, generator)
        results = {}
        for backend in ("torch", "triton"):
            loaded = device_kv.clone()
            for layer in range(layers):
                used = load_layer(
                    loaded,
                    host_kv,
                    layer=layer,
                    device_indices=device_idx,
                    host_indices=host_idx,
                    layout=layout,
                    page_size=page_size,
                    backend=backend,
                )
                assert used == backend
            loaded_at_once = device_kv.clone()
            used = load(
                loaded_at_once, host_kv, device_indices=device_idx, host_indices=host_idx,
                layout=layout, page_size=page_size, backend=backend,
            )
            assert used == backend
            assert torch.equal(loaded_at_once.view(torch.uint8), loaded.view(torch.uint8)), "load differs from load_layer"
            backed_up = host_kv.clone()
            backup(
                device_kv,
                backed_up,
                device_indices=device_idx,
                host_indices=host_idx,
                layout=layout,
                page_size=page_size,
                backend=backend,
            )
            results[backend] = (loaded.view(torch.uint8), backed_up.view(torch.uint8))
        assert torch.equal(results["triton"][0], results["torch"][0]), "load_layer differs"
        assert torch.equal(results["triton"][1], results["torch"][1]), "backup differs"
        assert not torch.equal(results["triton"][0], device_kv.view(torch.uint8)), "load_layer moved nothing"
        assert not torch.equal(results["triton"][1], host_kv.view(torch.uint8)), "backup moved nothing"

    @pytest.mark.parametrize("seed", range(RANDOM_CASES))
    def test_random_case(seed: int) -> None:
        rng = random.Random(seed)
        mla = rng.random() < 0.3
        assert_triton_matches_torch(
            layout=list(KVLayout)[seed % 3],
            dtype=rng.choice(DTYPES),
            halves=1 if mla else 2,
            layers=rng.randint(1, 4),
            heads=1 if mla else rng.randint(1, 3),
            head_dim=rng.choice((3, 4, 8, 12, 20, 36)),
            page_size=rng.choice((1, 2, 4, 8, 16)),
            device_pages=rng.randint(2, 4),
            host_pages=rng.randint(2, 4),
            pattern=rng.choice(("pages", "scattered", "unaligned_run")),
            seed=seed,
        )

    @pytest.mark.parametrize(
        "name, overrides",
        [
            # 2560-byte rows: 320 int64 words, so two word blocks (the second masked) and, with
            # 24 tokens in tiles of 8, three token tiles.
            (
                "wide_rows_many_tiles",
                dict(dtype=torch.float32, heads=4, head_dim=160, page_size=8, pattern="all_reversed"),
            ),
            # 3-byte rows: only one-byte words divide them.
            ("odd_byte_rows", dict(dtype=torch.uint8, halves=1, heads=1, head_dim=3, pattern="scattered")),
            # 6-byte rows: two-byte words.
            ("two_byte_words", dict(dtype=torch.bfloat16, heads=1, head_dim=3, pattern="scattered")),
            ("misaligned_host_pool", dict(dtype=torch.float16, misalign_host=True, pattern="scattered")),
            # MLA geometry (one latent buffer of 576 values per token) in float8.
            ("mla_float8", dict(dtype=torch.float8_e4m3fn, halves=1, heads=1, head_dim=576, pattern="pages")),
            ("page_size_64", dict(page_size=64, device_pages=2, host_pages=2, head_dim=4, heads=1, pattern="pages")),
        ],
    )
    @pytest.mark.parametrize("layout", list(KVLayout))
    def test_edge_case(name: str, overrides: dict, layout: KVLayout) -> None:
        args = dict(
            layout=layout,
            dtype=torch.float16,
            halves=2,
            layers=2,
            heads=2,
            head_dim=8,
            page_size=4,
            device_pages=4,
            host_pages=3,
            pattern="pages",
            seed=1000 + len(name),
        )
        args.update(overrides)
        assert_triton_matches_torch(**args)

    def test_dispatch_under_the_interpreter() -> None:
        device_kv = torch.zeros(2, 1, 4, 1, 4)
        host_kv = torch.zeros(2, 4, 1, 1, 4)
        assert select_backend(device_kv, host_kv) == "torch"
        assert select_backend(device_kv, host_kv, "triton") == "triton"

    def test_gpu_benchmark_dry_run_includes_the_triton_method(tmp_path: Path) -> None:
        result = subprocess.run(
            [sys.executable, "benchmarks/kernels_gpu.py", "--dry-run", "--out", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert result.returncode == 0, result.stdout + result.stderr
        report = json.loads((tmp_path / "kernels_gpu.json").read_text())
        triton_checks = [check for check in report["checks"] if check["name"].startswith("triton/")]
        assert triton_checks and all(check["ok"] for check in triton_checks)
        triton_rows = [row for row in report["results"] if row["method"] == "triton"]
        assert triton_rows and all(row["verified"] for row in triton_rows)
