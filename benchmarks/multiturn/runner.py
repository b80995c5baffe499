"""Run one multi-turn workload under several tier configurations, side by side, in one process.

Each configuration gets a fresh engine (and, for the default file backend, an empty store), the
same questions and the same compute, so the only difference between L1, L1+L2 and L1+L2+L3 is
where a prefix's KV can come back from. Metrics follow SGLang's benchmark: cache hit rate =
cached / prompt tokens; input throughput = prompt tokens / wall time (cached tokens count).
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import torch

from hicache_storage.cost import CostConfig, LoadPolicy

from hicache_storage.benchmarks.multiturn.bound import Legs, bound_of, measure_legs
from hicache_storage.benchmarks.multiturn.reachable import RequestWork, RoundWork, Shape, reachable_bound
from hicache_storage.benchmarks.multiturn.workload import Served, Workload, run_workload
from hicache_core.controller import ControllerConfig, PrefetchConfig, StopPolicy, WritePolicy
from hicache_core.engine import CacheTiers, Engine, EngineConfig
from hicache_core.hybrid.model import HybridModelConfig
from hicache_core.hybrid.modeled import HYBRID_SHAPES
from hicache_core.model import ModelConfig, ModeledCompute
from hicache_core.requests import AdmissionOrder, HybridPools

#: The modeled deployment: Qwen2.5-7B-Instruct with an FP8 KV cache on one NVIDIA L4 (24 GB).
#: Prefill: 7.6B params x 2 FLOP/token = 15.2 GFLOP/token; L4 dense bf16 ~121 TFLOP/s at ~50% MFU
#: gives ~4,000 tokens/s. Decode: one step reads ~15 GB of weights at ~300 GB/s: ~50 ms.
L4_PREFILL_TOKENS_PER_S = 4_000.0
L4_DECODE_STEP_S = 0.050
#: The same model (its KV shape unchanged) on one NVIDIA H200: prefill 15.2 GFLOP/token at ~60% of
#: the H200's 989 dense bf16 TFLOP/s gives ~40,000 tokens/s; a decode step reads ~15 GB of weights
#: at 4.8 TB/s (3.2 ms) plus the batch's KV and kernel launches: ~5 ms (docs/benchmarks.md).
H200_PREFILL_TOKENS_PER_S = 40_000.0
H200_DECODE_STEP_S = 0.005
#: Named compute speeds (the CLI's ``--compute``): the modeled prefill rate and decode step.
COMPUTE_PRESETS: dict[str, tuple[float, float]] = {
    "l4-7b": (L4_PREFILL_TOKENS_PER_S, L4_DECODE_STEP_S),
    "h200-7b": (H200_PREFILL_TOKENS_PER_S, H200_DECODE_STEP_S),
}
#: Qwen2.5-7B's KV shape: 28 layers x 4 KV heads x 128 dims; FP8 -> 28 KiB per token.
QWEN7B_LAYERS, QWEN7B_KV_HEADS, QWEN7B_HEAD_DIM, QWEN7B_KV_DTYPE = 28, 4, 128, "float8_e4m3fn"

#: Named workload shapes (the CLI's ``--preset``): ``default``, the main job, ends in a few minutes;
#: ``long-history``, where each prompt is mostly history (the case L3 exists for), in under ten.
PRESETS: dict[str, dict[str, Any]] = {
    "default": {"clients": 16, "rounds": 4, "request_length": 512, "device_tokens": 12288, "tiers": "L1,L1+L2,L1+L2+L3"},
    "long-history": {"clients": 4, "rounds": 30, "request_length": 512, "device_tokens": 32768, "tiers": "L1,L1+L2,L1+L2+L3"},
}

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float8_e4m3fn": torch.float8_e4m3fn}
TIER_CHOICES = {tier.value: tier for tier in CacheTiers}


@dataclass
class BenchConfig:
    workload: Workload = field(default_factory=Workload)
    tiers: Sequence[CacheTiers] = (CacheTiers.L1, CacheTiers.L1_L2, CacheTiers.L1_L2_L3)
    #: ``reference``: the real tiny model; ``modeled``: compute replaced by its modeled cost;
    #: ``hybrid-swa`` / ``hybrid-swa-recurrent``: a hybrid shape of :data:`HYBRID_SHAPES`, modeled
    #: (its own pools, window and checkpoint; ``layers``, ``kv_heads``, ``head_dim``, ``dtype`` unused).
    model: str = "modeled"
    #: A named compute speed of :data:`COMPUTE_PRESETS` (FULL-only modeled model); the two
    #: fields below override it.
    compute: str | None = None
    #: Modeled costs; ``None``: the compute preset's, else the model's own (Qwen2.5-7B on an L4,
    #: or the hybrid shape's).
    prefill_tokens_per_s: float | None = None
    decode_step_s: float | None = None
    layers: int = QWEN7B_LAYERS
    kv_heads: int = QWEN7B_KV_HEADS
    head_dim: int = QWEN7B_HEAD_DIM
    dtype: str = QWEN7B_KV_DTYPE
    page_size: int = 64
    #: Device (L1) capacity in tokens; the host pool (L2) is ``host_ratio`` times that.
    device_tokens: int = 12288
    host_ratio: float = 1.0
    layout: str = "page_first"
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    stop_policy: StopPolicy = PrefetchConfig.stop_policy
    admission_order: AdmissionOrder = AdmissionOrder.FCFS
    prefetch_threshold: int = 256
    #: Which stored pages a prefetch loads (the cost model's, or all: see hicache_storage.cost).
    load_policy: LoadPolicy = LoadPolicy.COST
    #: L3 backend; ``None`` is the embedded default: the file connector in a temporary directory.
    backend: str | None = None
    backend_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.model not in ("reference", "modeled", *HYBRID_SHAPES):
            raise ValueError(f"model must be one of reference, modeled, {', '.join(HYBRID_SHAPES)}; got {self.model!r}")
        hybrid = HYBRID_SHAPES.get(self.model)
        if self.compute is not None:
            if self.compute not in COMPUTE_PRESETS:
                raise ValueError(f"compute must be one of {', '.join(COMPUTE_PRESETS)}; got {self.compute!r}")
            if hybrid or self.model == "reference":
                raise ValueError(f"a compute preset models Qwen2.5-7B's compute: it needs model 'modeled', not {self.model!r}")
            prefill, decode = COMPUTE_PRESETS[self.compute]
            self.prefill_tokens_per_s = prefill if self.prefill_tokens_per_s is None else self.prefill_tokens_per_s
            self.decode_step_s = decode if self.decode_step_s is None else self.decode_step_s
        if self.prefill_tokens_per_s is None:
            self.prefill_tokens_per_s = hybrid.compute.prefill_tokens_per_s if hybrid else L4_PREFILL_TOKENS_PER_S
        if self.decode_step_s is None:
            self.decode_step_s = hybrid.compute.decode_step_s if hybrid else L4_DECODE_STEP_S
        if self.page_size < 1 or self.device_tokens < self.page_size or self.device_tokens % self.page_size:
            raise ValueError(f"device_tokens ({self.device_tokens}) must be a positive multiple of page_size ({self.page_size})")
        for name in ("host_ratio", "prefill_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.decode_step_s < 0:
            raise ValueError(f"decode_step_s must not be negative, got {self.decode_step_s}")

    @property
    def hybrid(self) -> bool:
        return self.model in HYBRID_SHAPES

    def model_and_compute(self) -> tuple[ModelConfig | HybridModelConfig, ModeledCompute | None]:
        """The model whose KV the pools hold, and the modeled cost replacing its forward pass (if any)."""
        assert self.prefill_tokens_per_s is not None and self.decode_step_s is not None
        compute = ModeledCompute(self.prefill_tokens_per_s, self.decode_step_s)
        if self.model == "reference":
            return ModelConfig(), None
        if self.hybrid:
            return HYBRID_SHAPES[self.model].config, compute
        model = ModelConfig(layers=self.layers, kv_heads=self.kv_heads, q_heads=self.kv_heads, head_dim=self.head_dim, dtype=DTYPES[self.dtype])
        return model, compute

    def full_pool_model(self) -> ModelConfig:
        """A FULL-only model with the FULL pool's geometry (the legs are timed on it)."""
        model = self.model_and_compute()[0]
        if isinstance(model, ModelConfig):
            return model
        full = model.full_geometry
        return ModelConfig(layers=full.layers, kv_heads=full.kv_heads, q_heads=full.kv_heads, head_dim=full.head_dim, dtype=full.dtype)

    def engine_config(self, tiers: CacheTiers, storage_root: str | None) -> EngineConfig:
        model, compute = self.model_and_compute()
        backend, backend_config = self.backend, self.backend_config
        if tiers.storage and backend is None:
            backend, backend_config = "file", {"root": storage_root}
        return EngineConfig(
            model=model,
            tiers=tiers,
            page_size=self.page_size,
            device_pages=self.device_tokens // self.page_size,
            host_ratio=self.host_ratio,
            layout=self.layout,
            controller=ControllerConfig(
                write_policy=self.write_policy,
                prefetch=PrefetchConfig(threshold_tokens=self.prefetch_threshold, stop_policy=self.stop_policy),
                cost=CostConfig(policy=self.load_policy),
            ),
            storage_backend=backend if tiers.storage else None,
            storage_config=backend_config if tiers.storage else None,
            tenant=f"bench-{uuid.uuid4().hex[:12]}",  # a shared store never serves an earlier run's pages
            max_running=self.workload.max_running,
            admission_order=self.admission_order,
            compute=compute,
            # The bench's hybrid shapes have no draft model; the SWA pools default to the FULL pool's pages.
            hybrid=HybridPools(draft=False),
        )

    def kv_bytes_per_token(self) -> int:
        """Bytes per token of the FULL pool (a hybrid model's other pools: ``describe``)."""
        return self.full_pool_model().geometry.token_bytes


@dataclass
class RoundStats:
    round: int | str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    device_tokens: int
    host_tokens: int
    storage_tokens: int
    computed_tokens: int
    cache_hit_rate: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    wall_s: float
    input_tokens_per_s: float


@dataclass
class TierRun:
    tiers: str
    rounds: list[RoundStats]
    overall: RoundStats
    storage_bytes_written: int
    storage_bytes_read: int
    metrics: dict[str, float]
    #: What the measured legs allow this run (see :mod:`.bound`); None without modeled compute.
    bound: dict[str, Any] | None = None
    #: A hybrid model's SWA and checkpoint bytes moved (``load``, ``backup``, ``storage_read``), which
    #: the engine's counters (FULL pool) leave out, and the seconds its device <-> host copies took
    #: (``load_seconds``, ``backup_seconds``); None for FULL-only models.
    side_pool_bytes: dict[str, float] | None = None
    #: What each round moved, request by request (the reachable bound's input; see :mod:`.reachable`).
    round_work: list[RoundWork] = field(default_factory=list)
    #: The bound this run could reach, with the best load-or-recompute choice (see :mod:`.reachable`).
    reachable: dict[str, Any] | None = None


def summarize(label: int | str, served: Sequence[Served], wall_s: float | None = None) -> RoundStats:
    from hicache_storage.benchmarks.stats import percentile

    results = [s.result for s in served]
    ttfts = [r.ttft_s * 1e3 for r in results]
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    if wall_s is None:
        wall_s = max(s.finished for s in served) - min(s.submitted for s in served)
    return RoundStats(
        round=label,
        requests=len(results),
        prompt_tokens=prompt,
        cached_tokens=cached,
        device_tokens=sum(r.cached_device for r in results),
        host_tokens=sum(r.cached_host for r in results),
        storage_tokens=sum(r.cached_storage for r in results),
        computed_tokens=sum(r.computed for r in results),
        cache_hit_rate=cached / prompt if prompt else 0.0,
        ttft_mean_ms=sum(ttfts) / len(ttfts),
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p90_ms=percentile(ttfts, 90),
        ttft_p99_ms=percentile(ttfts, 99),
        wall_s=wall_s,
        input_tokens_per_s=prompt / wall_s if wall_s > 0 else 0.0,
    )


def run_tiers(config: BenchConfig, tiers: CacheTiers, on_round: Callable[[int], None] | None = None) -> TierRun:
    """Serve the workload once with ``tiers`` on a fresh engine (and a fresh default store)."""
    scratch = tempfile.mkdtemp(prefix="hicache-bench-")
    try:
        engine_config = config.engine_config(tiers, storage_root=f"{scratch}/l3")
        questions = config.workload.questions(engine_config.model.vocab_size)
        with Engine(engine_config) as engine:
            moved = getattr(engine.runner, "moved", None)
            marks = [_round_mark(engine.metrics.snapshot(), moved)]

            def round_done(round_: int) -> None:
                marks.append(_round_mark(engine.metrics.snapshot(), moved))
                if on_round is not None:
                    on_round(round_)

            started = time.perf_counter()
            served = run_workload(engine, config.workload, questions, round_done)
            wall = time.perf_counter() - started
            metrics = engine.metrics.snapshot()
            side = {**moved.bytes, **{f"{leg}_seconds": s for leg, s in moved.copy_seconds.items()}} if moved is not None else None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rounds = [summarize(r, [s for s in served if s.round == r]) for r in range(config.workload.rounds)]
    page_bytes = config.page_size * config.kv_bytes_per_token()
    work = [
        RoundWork(
            tuple(
                RequestWork(
                    s.result.cached_host,
                    s.result.cached_storage,
                    s.result.stored_recomputed,
                    s.result.computed,
                    s.result.prompt_tokens + len(s.result.output_ids),
                    from_device=s.result.cached_device,
                )
                for s in served
                if s.round == r
            ),
            shared_pages=_share_pages([s.prompt_head for s in served if s.round == r]),
            storage_written=after["storage_backup_bytes"] - before["storage_backup_bytes"],
            backed_up=(after["host_backup_pages"] - before["host_backup_pages"]) * page_bytes + after["side_backup"] - before["side_backup"],
            side_read=after["side_storage_read"] - before["side_storage_read"],
            side_loaded=after["side_load"] - before["side_load"],
        )
        for r, (before, after) in enumerate(zip(marks, marks[1:]))
    ]
    return TierRun(
        tiers=tiers.value,
        rounds=rounds,
        overall=summarize("all", served, wall),
        storage_bytes_written=int(metrics["storage_backup_bytes"]),
        storage_bytes_read=int(metrics["prefetch_bytes"]) + (side["storage_read"] if side else 0),
        metrics=metrics,
        side_pool_bytes=side,
        round_work=work,
    )


def _share_pages(heads: list[tuple[int, ...]]) -> bool:
    """Whether two of a round's prompts share pages: in a prefix tree, two sequences share a page
    only if they share their first (``heads``: each prompt's first page of tokens)."""
    return len(set(heads)) < len(heads)


def _round_mark(metrics: dict[str, float], moved: Any) -> dict[str, float]:
    """The counters a round's work is the difference of (a hybrid model's side pools too)."""
    side = moved.bytes if moved is not None else {}
    return {
        "storage_backup_bytes": metrics["storage_backup_bytes"],
        "host_backup_pages": metrics["host_backup_pages"],
        "side_backup": side.get("backup", 0.0),
        "side_storage_read": side.get("storage_read", 0.0),
        "side_load": side.get("load", 0.0),
    }


def run_bench(config: BenchConfig, progress: Callable[[str, int], None] | None = None, *, l1_wall_s: float | None = None) -> dict[str, Any]:
    """Every tier configuration of ``config``, one after the other, each with its bound; plain data for JSON.

    The legs (store, copies, compute) are measured in the same process, on the geometry and
    store of the L3 configuration (see :mod:`~hicache_storage.benchmarks.multiturn.bound`), before
    the runs and again after them; each speed is the faster of the two, and of the store speeds
    the runs' own backups and prefetches reached (:meth:`Legs.reached_by`). A timing takes a
    fraction of a second, and one taken while the disk still wrote back an earlier run's files
    read the store at a third of its speed: the runs then beat their bound.
    """
    legs = measure_bench_legs(config)
    runs = []
    for tiers in config.tiers:
        runs.append(run_tiers(config, tiers, partial(progress, tiers.value) if progress else None))
    legs = legs.fastest(measure_bench_legs(config))
    for run in runs:
        legs = legs.reached_by(run.metrics)
    l1_wall = next((run.overall.wall_s for run in runs if run.tiers == CacheTiers.L1.value), l1_wall_s)
    page_bytes = config.page_size * config.kv_bytes_per_token()
    for run in runs:
        bound = bound_of(run.metrics, run.overall.wall_s, legs, page_bytes, l1_wall, run.side_pool_bytes)
        run.bound = bound.as_dict() if bound is not None else None
        shape = Shape(config.kv_bytes_per_token(), config.workload.output_length, config.workload.max_running, config.device_tokens)
        reachable = reachable_bound(run.round_work, legs, shape, wall_s=run.overall.wall_s, l1_wall_s=l1_wall)
        run.reachable = reachable.as_dict() if reachable is not None else None
    return {"config": describe(config), "legs": legs.as_dict(), "runs": [asdict(run) for run in runs]}


def measure_bench_legs(config: BenchConfig) -> Legs:
    """The legs of ``config``'s engine: the copies, and the store (the default one in a scratch
    directory) when a configuration uses L3."""
    tiers = CacheTiers.L1_L2_L3 if any(t.storage for t in config.tiers) else CacheTiers.L1_L2
    scratch = tempfile.mkdtemp(prefix="hicache-legs-")
    try:
        engine_config = config.engine_config(tiers, storage_root=f"{scratch}/l3")
        return measure_legs(replace(engine_config, model=config.full_pool_model()))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def describe(config: BenchConfig) -> dict[str, Any]:
    data = asdict(config)
    data["tiers"] = [t.value for t in config.tiers]
    data["write_policy"] = config.write_policy.value
    data["stop_policy"] = config.stop_policy.value
    data["admission_order"] = config.admission_order.value
    data["load_policy"] = config.load_policy.value
    data["kv_bytes_per_token"] = config.kv_bytes_per_token()
    data["backend"] = config.backend or "file (temporary directory)"
    if config.hybrid:
        data["hybrid"] = HYBRID_SHAPES[config.model].describe()
    if config.backend_config is not None:
        data["backend_config"] = "(given)"  # may hold credentials; never written to results
    return data


def stop_policy_comparison(config: BenchConfig, cheap_prefill_tokens_per_s: float, progress: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """L1+L2+L3 under each stop policy, with expensive (config's) and cheap recomputation."""
    rows = []
    for cost, prefill in (("expensive", config.prefill_tokens_per_s), ("cheap", cheap_prefill_tokens_per_s)):
        for policy in StopPolicy:
            variant = replace(config, tiers=(CacheTiers.L1_L2_L3,), stop_policy=policy, prefill_tokens_per_s=prefill)
            label = f"{policy.value} / {cost} recompute"
            run = run_tiers(variant, CacheTiers.L1_L2_L3, partial(progress, label) if progress else None)
            rows.append({"recompute": cost, "prefill_tokens_per_s": prefill, "stop_policy": policy.value, "overall": asdict(run.overall), "metrics": run.metrics})
    return {"config": describe(config), "stop_policies": rows}
