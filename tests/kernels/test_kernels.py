"""Transfer API on the CPU: layouts, the torch backend against the copy-per-run oracle, dispatch,
input validation, and the GPU benchmark script's dry run.

The Triton kernels are checked under the interpreter in ``test_kernels_interpret.py`` (its own
subprocess, so ``TRITON_INTERPRET`` never leaks into this process).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hicache_storage.errors import InvalidArgumentError
from hicache_storage.kernels import (
    BACKEND_ENV,
    KVLayout,
    backup,
    host_shape,
    load,
    load_layer,
    reference,
    select_backend,
)

REPO = Path(__file__).resolve().parents[2]
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn)


@dataclass(frozen=True)
class Case:
    layout: KVLayout
    dtype: torch.dtype
    halves: int
    layers: int
    heads: int
    head_dim: int
    page_size: int
    device_pages: int
    host_pages: int
    pattern: str
    seed: int


def random_case(seed: int) -> Case:
    rng = random.Random(seed)
    mla = rng.random() < 0.3
    return Case(
        layout=rng.choice(list(KVLayout)),
        dtype=rng.choice(DTYPES),
        halves=1 if mla else 2,
        layers=rng.randint(1, 4),
        heads=1 if mla else rng.randint(1, 3),
        head_dim=rng.choice((3, 4, 8, 12, 20)),
        page_size=rng.choice((1, 2, 4, 8)),
        device_pages=rng.randint(2, 5),
        host_pages=rng.randint(2, 5),
        pattern=rng.choice(("pages", "scattered", "one_slot")),
        seed=seed,
    )


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random bytes viewed as ``dtype``: every bit pattern, NaNs included, must survive a transfer."""
    width = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * width), dtype=torch.uint8, generator=generator)
    return raw.view(dtype)


def make_tensors(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random device and host KV plus paired index lists, per the case's index pattern."""
    generator = torch.Generator().manual_seed(case.seed)
    device_slots = case.device_pages * case.page_size
    host_slots = case.host_pages * case.page_size
    device_kv = random_bits((case.halves, case.layers, device_slots, case.heads, case.head_dim), case.dtype, generator)
    shape = host_shape(
        case.layout,
        halves=case.halves,
        layers=case.layers,
        slots=host_slots,
        heads=case.heads,
        head_dim=case.head_dim,
        page_size=case.page_size,
    )
    host_kv = random_bits(shape, case.dtype, generator)
    pages = min(case.device_pages, case.host_pages)
    if case.pattern == "pages":
        # Whole pages, as the core allocates them, in a shuffled order on both sides.
        count = torch.randint(1, pages + 1, (), generator=generator).item()
        device_pages = torch.randperm(case.device_pages, generator=generator)[:count]
        host_pages = torch.randperm(case.host_pages, generator=generator)[:count]
        offsets = torch.arange(case.page_size)
        device_idx = (device_pages[:, None] * case.page_size + offsets).reshape(-1)
        host_idx = (host_pages[:, None] * case.page_size + offsets).reshape(-1)
    elif case.pattern == "scattered":
        count = torch.randint(1, min(device_slots, host_slots) + 1, (), generator=generator).item()
        device_idx = torch.randperm(device_slots, generator=generator)[:count]
        host_idx = torch.randperm(host_slots, generator=generator)[:count]
    else:
        device_idx = torch.tensor([device_slots - 1])
        host_idx = torch.tensor([host_slots - 1])
    return device_kv, host_kv, device_idx, host_idx


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


def expected_after(case: Case, device_kv, host_kv, device_idx, host_idx):
    """Oracle: every layer loaded host -> device, and a separate backup device -> host."""
    runs = reference.contiguous_runs(device_idx, host_idx, case.layout, case.page_size)
    loaded = device_kv.clone()
    for layer in range(case.layers):
        reference.load_layer(loaded, host_kv, runs, layer=layer, layout=case.layout, page_size=case.page_size)
    backed_up = host_kv.clone()
    reference.backup(device_kv, backed_up, runs, layout=case.layout, page_size=case.page_size)
    return loaded, backed_up


@pytest.mark.parametrize("seed", range(60))
def test_torch_backend_matches_copy_per_run_oracle(seed: int) -> None:
    case = random_case(seed)
    device_kv, host_kv, device_idx, host_idx = make_tensors(case)
    want_device, want_host = expected_after(case, device_kv, host_kv, device_idx, host_idx)

    loaded = device_kv.clone()
    for layer in range(case.layers):
        used = load_layer(
            loaded,
            host_kv,
            layer=layer,
            device_indices=device_idx,
            host_indices=host_idx,
            layout=case.layout,
            page_size=case.page_size,
        )
        assert used == "torch"
    loaded_at_once = device_kv.clone()
    used = load(
        loaded_at_once, host_kv, device_indices=device_idx, host_indices=host_idx, layout=case.layout, page_size=case.page_size
    )
    assert used == "torch"
    backed_up = host_kv.clone()
    backup(
        device_kv,
        backed_up,
        device_indices=device_idx,
        host_indices=host_idx,
        layout=case.layout.value,
        page_size=case.page_size,
    )
    assert torch.equal(as_bits(loaded), as_bits(want_device)), case
    assert torch.equal(as_bits(loaded_at_once), as_bits(want_device)), case
    assert torch.equal(as_bits(backed_up), as_bits(want_host)), case
    # The transfer moved something: the oracle is not vacuously equal to the input.
    assert not torch.equal(as_bits(loaded), as_bits(device_kv))
    assert not torch.equal(as_bits(backed_up), as_bits(host_kv))


@pytest.mark.parametrize("seed", range(0, 60, 6))
def test_staged_path_for_accelerators_matches_the_oracle(monkeypatch, seed: int) -> None:
    """The gather/copy/scatter path a device KV off the CPU takes (no Triton), run on CPU tensors."""
    from hicache_storage.kernels import torch_transfer

    monkeypatch.setattr(torch_transfer, "_both_on_cpu", lambda *_: False)
    case = random_case(seed)
    assert_matches_oracle(case, *make_tensors(case))


def test_load_layer_touches_only_the_listed_slots_of_that_layer() -> None:
    case = Case(KVLayout.PAGE_FIRST, torch.float16, 2, 3, 2, 4, 4, 4, 4, "pages", 7)
    device_kv, host_kv, _, _ = make_tensors(case)
    before = device_kv.clone()
    load_layer(
        device_kv,
        host_kv,
        layer=1,
        device_indices=torch.tensor([5, 6]),
        host_indices=torch.tensor([9, 2]),
        layout="page_first",
        page_size=4,
    )
    device_bits, host_bits, before_bits = as_bits(device_kv), as_bits(host_kv), as_bits(before)
    assert torch.equal(device_bits[:, 1, 5], host_bits[:, 9, 1])
    assert torch.equal(device_bits[:, 1, 6], host_bits[:, 2, 1])
    untouched = torch.ones(device_kv.shape[:3], dtype=torch.bool)
    untouched[:, 1, 5:7] = False
    assert torch.equal(device_bits[untouched], before_bits[untouched])


def test_host_shapes_of_the_three_layouts() -> None:
    sizes = dict(halves=2, layers=3, slots=8, heads=5, head_dim=7, page_size=4)
    assert host_shape(KVLayout.LAYER_FIRST, **sizes) == (2, 3, 8, 5, 7)
    assert host_shape("page_first", **sizes) == (2, 8, 3, 5, 7)
    assert host_shape("page_first_direct", **sizes) == (2, 2, 3, 4, 5, 7)
    assert host_shape("page_first", **{**sizes, "halves": 1, "heads": 1}) == (1, 8, 3, 1, 7)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"slots": 10}, "multiple of page_size"),
        ({"halves": 3}, "halves must be 2"),
        ({"layers": 0}, "layers must be a positive int"),
        ({"layout": "token_first"}, "unknown KV layout"),
    ],
)
def test_host_shape_rejects_bad_sizes(change: dict, message: str) -> None:
    args = dict(layout="page_first", halves=2, layers=3, slots=8, heads=5, head_dim=7, page_size=4)
    args.update(change)
    layout = args.pop("layout")
    with pytest.raises(ValueError, match=message):
        host_shape(layout, **args)


def small_pair(layout: KVLayout = KVLayout.PAGE_FIRST, dtype: torch.dtype = torch.float32):
    device_kv = torch.zeros(2, 2, 8, 2, 4, dtype=dtype)
    host_kv = torch.zeros(
        host_shape(layout, halves=2, layers=2, slots=8, heads=2, head_dim=4, page_size=4), dtype=dtype
    )
    return device_kv, host_kv


def test_select_backend_defaults_to_torch_on_cpu_and_honours_overrides(monkeypatch) -> None:
    device_kv, host_kv = small_pair()
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert select_backend(device_kv, host_kv) == "torch"
    assert select_backend(device_kv, host_kv, "auto") == "torch"
    assert select_backend(device_kv, host_kv, " Torch ") == "torch"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert select_backend(device_kv, host_kv) == "torch"


@pytest.mark.parametrize("via_env", [False, True])
def test_select_backend_rejects_unknown_names(monkeypatch, via_env: bool) -> None:
    device_kv, host_kv = small_pair()
    if via_env:
        monkeypatch.setenv(BACKEND_ENV, "cuda")
        with pytest.raises(ValueError, match=r"unknown kernel backend 'cuda' \(from \$HICACHE_KERNEL_BACKEND\)"):
            select_backend(device_kv, host_kv)
    else:
        with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
            select_backend(device_kv, host_kv, "cuda")


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="under TRITON_INTERPRET=1 Triton does run on CPU tensors"
)
def test_triton_requested_on_cpu_without_interpreter_is_a_clear_error(monkeypatch) -> None:
    pytest.importorskip("triton", reason="without triton the error names the missing package instead")
    device_kv, host_kv = small_pair()
    monkeypatch.setenv(BACKEND_ENV, "triton")
    with pytest.raises(ValueError, match="need a CUDA device_kv"):
        select_backend(device_kv, host_kv)
    with pytest.raises(ValueError, match="need a CUDA device_kv"):
        backup(
            device_kv,
            host_kv,
            device_indices=torch.tensor([0]),
            host_indices=torch.tensor([0]),
            layout="page_first",
            page_size=4,
        )


def test_argument_beats_environment(monkeypatch) -> None:
    device_kv, host_kv = small_pair()
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert select_backend(device_kv, host_kv, "torch") == "torch"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d, h, kw: {**kw, "host_kv": h.to(torch.float16)}, "dtype"),
        (lambda d, h, kw: {**kw, "host_kv": h[..., :2].contiguous()}, "does not match"),
        (lambda d, h, kw: {**kw, "device_kv": d.transpose(3, 4)}, "contiguous"),
        (lambda d, h, kw: {**kw, "layer": 2}, r"layer must be an int in \[0, 2\)"),
        (lambda d, h, kw: {**kw, "layer": 1.0}, r"layer must be an int in \[0, 2\), got 1.0"),
        (lambda d, h, kw: {**kw, "page_size": 3}, "multiple of page_size"),
        (lambda d, h, kw: {**kw, "layout": "layer_first"}, "does not match"),
        (lambda d, h, kw: {**kw, "host_indices": torch.tensor([0, 1])}, "same length"),
        (lambda d, h, kw: {**kw, "host_indices": torch.tensor([8])}, r"host_indices must lie in \[0, 8\)"),
        (lambda d, h, kw: {**kw, "device_indices": torch.tensor([-1])}, "device_indices must lie"),
        (lambda d, h, kw: {**kw, "device_indices": torch.tensor([0.0])}, "must hold integers"),
        (lambda d, h, kw: {**kw, "device_indices": torch.tensor([[0]])}, "must be 1-D"),
        (lambda d, h, kw: {**kw, "device_indices": [0]}, "must be a torch.Tensor"),
    ],
)
def test_bad_input_raises_before_writing(mutate, message: str) -> None:
    device_kv, host_kv = small_pair()
    host_kv.fill_(1.0)
    kwargs = dict(
        device_kv=device_kv,
        host_kv=host_kv,
        layer=1,
        device_indices=torch.tensor([3]),
        host_indices=torch.tensor([5]),
        layout="page_first",
        page_size=4,
    )
    with pytest.raises(InvalidArgumentError, match=message):
        load_layer(**mutate(device_kv, host_kv, kwargs))
    assert not device_kv.any()


def test_int32_indices_tensor_layer_and_empty_lists_are_accepted() -> None:
    device_kv, host_kv = small_pair(KVLayout.PAGE_FIRST_DIRECT)
    host_kv.copy_(torch.arange(host_kv.numel(), dtype=torch.float32).view(host_kv.shape))
    empty = torch.empty(0, dtype=torch.int64)
    assert (
        load_layer(
            device_kv,
            host_kv,
            layer=0,
            device_indices=empty,
            host_indices=empty,
            layout="page_first_direct",
            page_size=4,
        )
        == "torch"
    )
    assert not device_kv.any()
    load_layer(
        device_kv,
        host_kv,
        layer=torch.tensor(1),
        device_indices=torch.tensor([2], dtype=torch.int32),
        host_indices=torch.tensor([6], dtype=torch.int32),
        layout="page_first_direct",
        page_size=4,
    )
    assert torch.equal(device_kv[:, 1, 2], host_kv[:, 1, 1, 2])


def test_gpu_benchmark_script_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "results"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "kernels_gpu.py"), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "kernels_gpu.json").read_text())
    assert report["mode"] == "dry-run"
    assert report["checks"] and all(check["ok"] for check in report["checks"])
    methods = {row["method"] for row in report["results"]}
    assert {"copy_per_page", "torch_gather_scatter"} <= methods
    assert (out / "kernels_gpu.md").read_text().startswith("# ")


def test_triton_requested_without_triton_names_the_package(monkeypatch) -> None:
    from hicache_storage.kernels import dispatch

    def missing() -> None:
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(dispatch, "_triton", missing)
    device_kv, host_kv = small_pair()
    with pytest.raises(ValueError, match=r"triton does not import .*pip install 'hicache-storage\[kernels\]'"):
        select_backend(device_kv, host_kv, "triton")
    assert select_backend(device_kv, host_kv) == "torch"


# --- The CPU fast path: page-aligned runs copied in place (kernels/cpu_transfer.py) -------------


def page_runs_indices(
    pattern: str, device_pages: int, host_pages: int, count: int, page_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole pages as the engine passes them: ``coalesced`` (one stretch on both sides),
    ``fragmented`` (random pages), ``stretches`` (random stretches of 1-4 consecutive pages), or
    ``mixed`` (stretches plus single slots and unaligned pieces, so both CPU paths run in one call)."""
    offsets = torch.arange(page_size)
    if pattern == "coalesced":
        device = torch.arange(count) + int(torch.randint(0, device_pages - count + 1, (), generator=generator))
        host = torch.arange(count) + int(torch.randint(0, host_pages - count + 1, (), generator=generator))
    elif pattern == "fragmented":
        device = torch.randperm(device_pages, generator=generator)[:count]
        host = torch.randperm(host_pages, generator=generator)[:count]
    else:
        device, host = stretches(device_pages, host_pages, count, generator)
    device_idx = (device[:, None] * page_size + offsets).reshape(-1)
    host_idx = (host[:, None] * page_size + offsets).reshape(-1)
    if pattern == "mixed":
        # Drop a few slots and shift a piece off its page boundary: short and unaligned runs.
        keep = torch.rand(device_idx.numel(), generator=generator) > 0.1
        device_idx, host_idx = device_idx[keep], host_idx[keep]
        cut = device_idx.numel() // 2
        host_idx = torch.cat([host_idx[:cut], host_idx[cut:].roll(1)])
    return device_idx, host_idx


def stretches(device_pages: int, host_pages: int, count: int, generator: torch.Generator):
    """Up to ``count`` distinct pages per side (as many on both), in shuffled stretches of 1-4
    consecutive pages."""
    chosen: list[torch.Tensor] = []
    for pages in (device_pages, host_pages):
        order = torch.randperm(pages // 4, generator=generator).tolist()
        picked: list[int] = []
        for group in order:
            length = int(torch.randint(1, 5, (), generator=generator))
            picked += range(group * 4, group * 4 + length)
            if len(picked) >= count:
                break
        chosen.append(torch.tensor(picked[:count]))
    both = min(len(chosen[0]), len(chosen[1]))
    return chosen[0][:both], chosen[1][:both]


def assert_matches_oracle(case: Case, device_kv, host_kv, device_idx, host_idx) -> None:
    want_device, want_host = expected_after(case, device_kv, host_kv, device_idx, host_idx)
    loaded = device_kv.clone()
    for layer in range(case.layers):
        load_layer(
            loaded, host_kv, layer=layer, device_indices=device_idx, host_indices=host_idx,
            layout=case.layout, page_size=case.page_size,
        )
    loaded_at_once = device_kv.clone()
    load(loaded_at_once, host_kv, device_indices=device_idx, host_indices=host_idx, layout=case.layout, page_size=case.page_size)
    backed_up = host_kv.clone()
    backup(
        device_kv, backed_up, device_indices=device_idx, host_indices=host_idx,
        layout=case.layout, page_size=case.page_size,
    )
    assert torch.equal(as_bits(loaded), as_bits(want_device)), case
    assert torch.equal(as_bits(loaded_at_once), as_bits(want_device)), case
    assert torch.equal(as_bits(backed_up), as_bits(want_host)), case
    assert not torch.equal(as_bits(loaded), as_bits(device_kv))
    assert not torch.equal(as_bits(backed_up), as_bits(host_kv))


@pytest.mark.parametrize("pattern", ["coalesced", "fragmented", "stretches", "mixed"])
@pytest.mark.parametrize("layout", list(KVLayout), ids=[layout.value for layout in KVLayout])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_cpu_page_runs_match_the_oracle(layout: KVLayout, pattern: str, mla: bool) -> None:
    seed = hash((layout.value, pattern, mla)) % 10_000
    dtype = DTYPES[seed % len(DTYPES)]
    page_size = (16, 64)[seed % 2]
    case = Case(layout, dtype, 1 if mla else 2, 3, 1 if mla else 2, 12, page_size, 24, 20, "pages", seed)
    generator = torch.Generator().manual_seed(seed)
    device_kv, host_kv, _, _ = make_tensors(case)
    device_idx, host_idx = page_runs_indices(pattern, case.device_pages, case.host_pages, 12, page_size, generator)
    assert_matches_oracle(case, device_kv, host_kv, device_idx, host_idx)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_page_runs_move_bits_of_every_dtype(dtype: torch.dtype) -> None:
    for layout in KVLayout:
        case = Case(layout, dtype, 2, 2, 2, 8, 4, 12, 10, "pages", 3)
        generator = torch.Generator().manual_seed(5)
        device_kv, host_kv, _, _ = make_tensors(case)
        device_idx, host_idx = page_runs_indices("stretches", 12, 10, 6, 4, generator)
        assert_matches_oracle(case, device_kv, host_kv, device_idx, host_idx)


def test_plan_runs_coalesces_pages_and_sends_short_runs_to_the_row_path() -> None:
    from hicache_storage.kernels.cpu_transfer import MIN_RUN_SLOTS, plan_runs

    device = torch.tensor([8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 30, 40, 41, 42, 43])
    host = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23, 2, 50, 51, 52, 53])
    runs = plan_runs(device, host, block=1)
    assert MIN_RUN_SLOTS <= 4
    assert list(zip(runs.device_starts, runs.host_starts, runs.lengths)) == [(8, 4, 8), (0, 20, 4), (40, 50, 4)]
    assert runs.device_rest.tolist() == [30] and runs.host_rest.tolist() == [2]
    # page_first_direct splits at host pages (block 4): host 4..11 is two blocks.
    paged = plan_runs(device, host, block=4)
    assert list(zip(paged.device_starts, paged.host_starts, paged.lengths))[:2] == [(8, 4, 4), (12, 8, 4)]


def test_plan_reuse_never_returns_a_stale_plan_after_an_in_place_change() -> None:
    case = Case(KVLayout.PAGE_FIRST, torch.float16, 2, 2, 1, 8, 4, 8, 8, "pages", 11)
    device_kv, host_kv, _, _ = make_tensors(case)
    device_idx = torch.arange(8, 16)
    host_idx = torch.arange(0, 8)
    loaded = device_kv.clone()
    args = dict(device_indices=device_idx, host_indices=host_idx, layout="page_first", page_size=4)
    load_layer(loaded, host_kv, layer=0, **args)
    host_idx.numpy()[:] = torch.arange(16, 24).numpy()  # same tensor, same version counter, new contents
    load_layer(loaded, host_kv, layer=1, **args)
    assert torch.equal(as_bits(loaded[:, 1, 8:16]), as_bits(host_kv[:, 16:24, 1]))


def test_cpu_benchmark_reports_verified_rows_for_every_leg() -> None:
    from hicache_storage.benchmarks.kernels_cpu import measure_cpu_transfers

    report = measure_cpu_transfers(
        layers=2, heads=1, head_dim=16, dtypes=("bfloat16",), page_size=4, pages=(3,),
        patterns=("fragmented", "slots"), repeats=1,
    )
    rows = report["results"]
    assert len(rows) == 3 * 2 * 2  # layouts x patterns x directions
    assert all(row["verified"] and row["gbps"] > 0 and row["ratio_to_copy"] > 0 for row in rows)
    assert {row["direction"] for row in rows} == {"load", "backup"}


def test_cpu_benchmark_script_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "results"
    result = subprocess.run(
        [
            sys.executable, str(REPO / "benchmarks" / "kernels_cpu.py"), "--out", str(out),
            "--layers", "2", "--heads", "1", "--head-dim", "8", "--page-size", "4", "--pages", "2",
            "--dtypes", "float8_e4m3fn", "--layouts", "page_first", "--repeats", "1",
        ],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "kernels_cpu.json").read_text())
    assert len(report["results"]) == 4 and all(row["verified"] for row in report["results"])
    assert (out / "kernels_cpu.md").read_text().startswith("# CPU transfer kernels")
    bad = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "kernels_cpu.py"), "--pages", "12Q"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert bad.returncode == 2 and "--pages takes comma-separated positive integers" in bad.stderr
