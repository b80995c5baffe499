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
from sglang.srt.mem_cache.hicache_storage import PoolName

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
