"""Pages round-trip exact through SGLang's ``UnifiedRadixCache`` / ``HybridCacheController`` with
our adapter as L3: a producer engine backs a request up to storage, a fresh engine that shares
only the store prefetches it and loads it to its device, and the device KV is the producer's, bit
for bit. The same restore against an empty store finds nothing, so the bytes came from L3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Deployment, Engine
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

from hicache_storage.sglang import PageIO


@pytest.fixture
def engines():
    opened: list[Engine] = []

    def open_engine(deployment: Deployment) -> Engine:
        engine = Engine(deployment)
        opened.append(engine)
        return engine

    yield open_engine
    for engine in reversed(opened):  # each holds an override of SGLang's parallel context: innermost first
        engine.close()


def round_trip(engines: Any, deployment: Deployment, pages: int = 6) -> None:
    tokens = list(range(1, 1 + pages * deployment.page_size))
    producer = engines(deployment)
    leaf = producer.insert(tokens)
    written = producer.fill(producer.cache.path_device_indices(leaf), seed=pages)
    side_written = producer.fill_side_state(leaf, seed=pages + 1)
    producer.back_up(leaf)

    consumer = engines(deployment)
    restored, rows = consumer.restore(tokens)
    assert restored == len(tokens)
    assert same_bytes(rows, written), "restored device KV (full attention, draft, MTP layers, DSA indexer) differs"
    side = [buffer[index] for buffer, index in consumer.side_state(consumer.leaf(tokens))]
    assert len(side) == len(side_written) and same_bytes(side, side_written), "restored SWA / Mamba state differs"


def same_bytes(got: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    return len(got) == len(expected) and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, expected))


def empty_store_restores_nothing(engines: Any, deployment: Deployment) -> None:
    restored, _ = engines(deployment).restore(list(range(1, 1 + 6 * deployment.page_size)))
    assert restored == 0


MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_mha_round_trips_exact_on_file(engines: Any, tmp_path: Path, layout: str) -> None:
    deployment = Deployment("file", {"root": str(tmp_path / "l3")}, layout=layout)
    empty_store_restores_nothing(engines, deployment)
    round_trip(engines, deployment)


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_round_trips_exact_on_file(engines: Any, tmp_path: Path, layout: str) -> None:
    deployment = Deployment("file", {"root": str(tmp_path / "l3")}, layout=layout, mla=True)
    empty_store_restores_nothing(engines, deployment)
    round_trip(engines, deployment)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_round_trips_exact_on_redis(engines: Any, redis_server: Any, request: pytest.FixtureRequest, mla: bool) -> None:
    config = {"url": redis_server.url, "prefix": f"tier{abs(hash(request.node.nodeid)) % 10**8}"}
    round_trip(engines, Deployment("redis", config, mla=mla))


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_round_trips_exact_on_mooncake(engines: Any, mooncake_master: Any, mla: bool) -> None:
    round_trip(engines, Deployment("mooncake", {**mooncake_master.client_config(), "key_prefix": f"tier-{mla}/"}, mla=mla))


@pytest.mark.parametrize("components", [("FULL", "SWA"), ("FULL", "MAMBA")], ids=["swa", "mamba"])
def test_hybrid_round_trips_exact_on_file(engines: Any, tmp_path: Path, components: tuple[str, ...]) -> None:
    deployment = Deployment("file", {"root": str(tmp_path / "l3")}, components=components)
    empty_store_restores_nothing(engines, deployment)
    round_trip(engines, deployment)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_two_tp_ranks_restore_their_own_shard(engines: Any, tmp_path: Path, mla: bool) -> None:
    """TP2: each rank's engine backs up and restores through SGLang's tree. MHA ranks hold
    different heads: each restores its own bytes, never the other rank's. MLA KV is the same on
    every rank: SGLang backs it up from rank 0 only, and rank 1 restores rank 0's copy."""
    tokens = list(range(1, 1 + 6 * 4))
    config = {"root": str(tmp_path / "l3")}
    written = {}
    for rank in (0, 1):
        producer = engines(Deployment("file", config, mla=mla, tp_rank=rank, tp_size=2))
        leaf = producer.insert(tokens)
        written[rank] = producer.fill(producer.cache.path_device_indices(leaf), seed=10 + rank)
        producer.back_up(leaf)
    assert not same_bytes(written[0], written[1])
    for rank in (0, 1):
        restored, rows = engines(Deployment("file", config, mla=mla, tp_rank=rank, tp_size=2)).restore(tokens)
        assert restored == len(tokens)
        assert same_bytes(rows, written[0 if mla else rank]), f"rank {rank} restored the wrong shard"


def test_eagle_draft_on_an_mla_target_round_trips_per_rank(engines: Any, tmp_path: Path) -> None:
    """TP2, MLA target with an MHA draft sidecar (EAGLE3 on Kimi-K2 / DeepSeek): the target KV is
    written once (rank 0) and shared, each rank's draft heads are its own, and rank 1's draft
    reaches storage although SGLang backs up nothing else on MLA ranks other than 0."""
    tokens = list(range(1, 1 + 6 * 4))
    config = {"root": str(tmp_path / "l3")}
    written, draft_rows = {}, {}
    for rank in (0, 1):
        producer = engines(Deployment("file", config, mla=True, draft=True, tp_rank=rank, tp_size=2))
        leaf = producer.insert(tokens)
        written[rank] = producer.fill(producer.cache.path_device_indices(leaf), seed=20 + rank)
        draft_rows[rank] = written[rank][-2:]  # the draft layer's K and V come last
        producer.back_up(leaf)
    assert not same_bytes(draft_rows[0], draft_rows[1])
    for rank in (0, 1):
        restored, rows = engines(Deployment("file", config, mla=True, draft=True, tp_rank=rank, tp_size=2)).restore(tokens)
        assert restored == len(tokens)
        assert same_bytes(rows[:-2], written[0][:-2]), f"rank {rank}: the MLA target KV is rank 0's"
        assert same_bytes(rows[-2:], draft_rows[rank]), f"rank {rank} restored another rank's draft heads"


def test_mtp_and_no_mtp_deployments_of_one_model_each_restore_their_own(engines: Any, tmp_path: Path) -> None:
    """MTP draft layers are packed into the MLA target's KV host pages. A deployment with them and
    one without, under one model name and one store: neither takes the other's pages as its own,
    and each fills L3 and restores its own pages exactly."""
    tokens = list(range(1, 1 + 6 * 4))
    config = {"root": str(tmp_path / "l3")}
    plain, mtp = Deployment("file", config, mla=True), Deployment("file", config, mla=True, mtp_layers=1)
    written = {}
    for name, deployment in (("plain", plain), ("mtp", mtp)):
        producer = engines(deployment)
        leaf = producer.insert(tokens)
        written[name] = producer.fill(producer.cache.path_device_indices(leaf), seed=len(written))
        if name == "plain":
            assert engines(mtp).restore(tokens)[0] == 0, "the MTP deployment read pages without its draft layer"
        producer.back_up(leaf)
    for name, deployment in (("plain", plain), ("mtp", mtp)):
        restored, rows = engines(deployment).restore(tokens)
        assert restored == len(tokens) and same_bytes(rows, written[name]), f"{name} did not restore its own pages"


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_dsa_indexer_round_trips_exact_on_file(engines: Any, tmp_path: Path, layout: str) -> None:
    """DeepSeek V3.2: MLA KV plus SGLang's DSA indexer pool as a KV sidecar. On layer_first the
    indexer pool cannot describe a page as runs; its pages move as flat copies."""
    deployment = Deployment("file", {"root": str(tmp_path / "l3")}, layout=layout, dsa=True, page_size=64)  # DSA's page
    empty_store_restores_nothing(engines, deployment)
    round_trip(engines, deployment, pages=3)
    indexer = engines(deployment).adapter.bindings[PoolName.INDEXER.value]
    assert indexer.io is (PageIO.FLAT if layout == "layer_first" else PageIO.SEGMENTS)


# --- DeepSeek V4 -------------------------------------------------------------------------------

#: Layer compress ratios: SWA-only and C4 layers (page size 4), and a C128 layer too (page size
#: 128, the smallest page a C128 pool has a slot in).
V4_CASES = {
    "c4-page_first": ("page_first", 4, (0, 4, 0, 4)),
    "c4-layer_first": ("layer_first", 4, (0, 4, 0, 4)),
    "c4-page_first_direct": ("page_first_direct", 4, (0, 4, 0, 4)),
    "c4-c128-page_first": ("page_first", 128, (0, 4, 128, 4)),
}


@pytest.mark.parametrize("case", list(V4_CASES))
def test_deepseek_v4_round_trips_exact_through_the_tree(engines: Any, tmp_path: Path, case: str) -> None:
    """DeepSeek V4 as SGLang builds it: its ``DeepSeekV4TokenToKVPool`` device pool, the tree's
    FULL + SWA components, and the host pools ``build_deepseek_v4_hicache_stack`` registers: a
    logical KV anchor without bytes, the SWA pool, the C4 (and C128) compressed KV and the C4
    indexer as KV sidecars (all pages), the C4 compress states as SWA sidecars (trailing pages).
    The compressed pages of the whole prefix, and the SWA pages and compress state rings of the
    last window, come back from L3 exactly."""
    layout, page_size, ratios = V4_CASES[case]
    deployment = Deployment(
        "file", {"root": str(tmp_path / "l3")}, layout=layout, components=("FULL", "SWA"), page_size=page_size,
        v4_ratios=ratios,
    )  # fmt: skip
    pages = 3 if page_size > 4 else 6
    empty_store_restores_nothing(engines, deployment)
    round_trip(engines, deployment, pages=pages)
    consumer = engines(deployment)
    bindings = consumer.adapter.bindings
    expected = {"kv", "swa", "deepseek_v4_c4", "deepseek_v4_c4_indexer", "deepseek_v4_c4_state", "deepseek_v4_c4_indexer_state"}
    expected |= {"deepseek_v4_c128"} if 128 in ratios else set()
    assert set(bindings) == expected
    assert bindings["kv"].io is PageIO.LOGICAL
    assert all(binding.io is PageIO.SEGMENTS for name, binding in bindings.items() if name != "kv")
    policies = {str(spec.pool_name): spec.hit_policy for spec in consumer.cache.sidecar_pool_specs}
    assert policies["deepseek_v4_c4"] is PoolHitPolicy.ALL_PAGES
    assert policies["deepseek_v4_c4_state"] is PoolHitPolicy.TRAILING_PAGES


# --- MLA on page_first_kv_split (Ascend) --------------------------------------------------------


@pytest.mark.parametrize("dsa", [False, True], ids=["mla", "mla-dsa"])
def test_mla_page_first_kv_split_round_trips_exact(engines: Any, tmp_path: Path, dsa: bool) -> None:
    """``page_first_kv_split``, SGLang's MLA layout on Ascend: its NPU MLA device pool (latent,
    rope and a DSA indexer's K in separate layer-major buffers), its host pool mirroring each
    page-major, moved by the ``kernel_ascend`` backend (our CPU dim exchange). Each page is stored
    as its K, V (and indexer) runs."""
    deployment = Deployment("file", {"root": str(tmp_path / "l3")}, layout="page_first_kv_split", mla=True, dsa=dsa)
    empty_store_restores_nothing(engines, deployment)
    round_trip(engines, deployment)
    kv = engines(deployment).adapter.bindings["kv"]
    assert kv.io is PageIO.SEGMENTS
    _, sizes = kv.pool.get_page_buffer_meta(torch.arange(deployment.page_size))
    assert len(sizes) == (3 if dsa else 2), "one run per page for K, V and the indexer's K"


# --- pipeline and attention context parallelism ---------------------------------------------------


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_pipeline_stages_restore_their_own_layers(engines: Any, tmp_path: Path, mla: bool) -> None:
    """PP2: each stage holds its own layers and SGLang's controller stores them with the stage's
    ``pp_rank`` / ``pp_size`` (from the parallel context, as in a launched server). Each stage's
    engine backs up and restores through SGLang's tree; each restores its own layers' bytes,
    never the other stage's, and finds nothing while only the other stage's layers are stored. (Each stage runs alone: the relay by which stage 0 decides a
    prefetch for the later stages over the PP group carries decisions, not pages.)"""
    tokens = list(range(1, 1 + 6 * 4))
    config = {"root": str(tmp_path / "l3")}
    written = {}
    for stage in (0, 1):
        # Nothing of this stage is stored yet (stage 1: only stage 0's layers are).
        assert engines(Deployment("file", config, mla=mla, pp_rank=stage, pp_size=2)).restore(tokens)[0] == 0
        producer = engines(Deployment("file", config, mla=mla, pp_rank=stage, pp_size=2))
        leaf = producer.insert(tokens)
        written[stage] = producer.fill(producer.cache.path_device_indices(leaf), seed=40 + stage)
        producer.back_up(leaf)
    assert not same_bytes(written[0], written[1])
    for stage in (0, 1):
        restored, rows = engines(Deployment("file", config, mla=mla, pp_rank=stage, pp_size=2)).restore(tokens)
        assert restored == len(tokens)
        assert same_bytes(rows, written[stage]), f"stage {stage} restored the other stage's layers"


def test_attention_cp_ranks_restore_their_own_slices(tmp_path: Path) -> None:
    """Attention CP of 2 (TP 2 = 2 CP ranks of attention TP 1): SGLang's controller takes a rank's
    CP rank from its attention-CP process group, and the ranks agree on hit lengths over it, so
    the ranks run on a real gloo group, rank 0 in this process and rank 1 in one of its own
    (``rank_process.py``). Each CP rank
    holds its own slice of every page: each backs up and restores its own bytes, never the other
    rank's; against the store before any backup neither finds anything. MLA: SGLang backs up
    only TP rank 0 of an MLA deployment, which would leave CP rank 1's slice out of storage and,
    the ranks agreeing on the smaller hit, no L3 hit on either rank; the adapter has every CP
    rank's attention-TP rank 0 write (and SGLang back it up)."""
    cases = {
        name: {"connector": "file", "connector_config": {"root": str(tmp_path / name)}, "mla": name == "mla",
               "tp_size": 2, "attn_cp_size": 2}
        for name in ("mha", "mla")
    }  # fmt: skip
    results = run_ranks(tmp_path, cases, world=2)
    for name in cases:
        ranks = [results[rank][name] for rank in (0, 1)]
        assert ranks[0]["shard"] != ranks[1]["shard"], f"{name}: both CP ranks store under one key scope"
        assert not same_bytes(ranks[0]["written"], ranks[1]["written"])
        for rank, got in enumerate(ranks):
            assert got["before"] == 0, f"{name} rank {rank} found pages in a store nothing had written"
            assert got["after"] == got["tokens"], f"{name} rank {rank} restored {got['after']} of {got['tokens']} tokens"
            assert same_bytes(got["restored"], got["written"]), f"{name} rank {rank} restored another rank's slice"


def run_ranks(tmp_path: Path, cases: dict[str, dict[str, Any]], world: int) -> list[dict[str, Any]]:
    """Run every case on ``world`` ranks of one gloo group: rank 0 here, the others each in a
    process of its own (``rank_process.py``); each rank's results."""
    import json
    import socket
    import subprocess
    import sys

    import rank_process

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spec = {"port": port, "world": world, "cases": cases, "out": str(tmp_path)}
    (tmp_path / "ranks.json").write_text(json.dumps(spec))
    logs = {rank: tmp_path / f"rank{rank}.log" for rank in range(1, world)}
    procs = {
        rank: subprocess.Popen(
            [sys.executable, rank_process.__file__, str(tmp_path / "ranks.json"), str(rank)],
            stdout=log.open("w"), stderr=subprocess.STDOUT,
        )
        for rank, log in logs.items()
    }  # fmt: skip
    try:
        try:
            here = rank_process.run_rank(spec, 0)
        except Exception as exc:
            raise AssertionError("rank 0 failed; the other ranks' logs:\n" + "\n".join(log.read_text()[-3000:] for log in logs.values())) from exc
        for proc in procs.values():
            proc.wait(timeout=600)  # a guard against a rank left waiting in a collective, not a measurement
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = {rank: proc.returncode for rank, proc in procs.items() if proc.returncode != 0}
    assert not failed, f"ranks failed {failed}:\n" + "\n".join(logs[rank].read_text()[-3000:] for rank in failed)
    return [here] + [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(1, world)]
