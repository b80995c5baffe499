"""The adapter over SGLang's real host pool classes, for deployments SGLang's own backends serve
and the adapter once refused or got wrong: DeepSeek V4's logical KV anchor, an EAGLE draft (MHA)
on an MLA target, MTP draft layers packed into the KV pages, pools that cannot describe a page as
runs, and the flags SGLang adds to the extra config itself.

Host pools come from SGLang's own ``init_hicache`` (the harness's engines); adapters are built
by SGLang's ``StorageBackendFactory`` from a ``HiCacheStorageConfig``, as its controller does.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Deployment, Engine
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from hicache_storage.sglang import HiCacheStorageAdapter, PageIO


def keys(n: int, salt: str) -> list[str]:
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


def slots(pool: Any, pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * pool.page_size, (p + 1) * pool.page_size) for p in pages])


def page(pool: Any, p: int) -> bytes:
    return pool.get_data_page(p * pool.page_size, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def randomize(pool: Any, seed: int) -> None:
    buffers = pool.kv_buffer if isinstance(pool.kv_buffer, (list, tuple)) else [pool.kv_buffer]
    generator = torch.Generator().manual_seed(seed)
    for buffer in buffers:
        flat = buffer.view(torch.uint8).view(-1)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=generator))


@pytest.fixture
def host_pools():
    """Real SGLang host pools: the KV host pool of an engine built with ``init_hicache``."""
    engines: list[Engine] = []

    def build(tmp: Path, **deployment: Any) -> Any:
        engine = Engine(Deployment("memory", {"store": f"pools-{len(engines)}-{tmp.name}"}, **deployment))
        engines.append(engine)
        pool = engine.cache.cache_controller.storage_host_pool
        randomize(pool, seed=len(engines))
        return pool

    yield build
    for engine in engines:
        engine.close()


def adapter(root: Path, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False, **extra: Any) -> HiCacheStorageAdapter:
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=True, is_page_first_layout=True, model_name="tier/model",
        extra_config={"backend_name": "hicache", "module_path": "hicache_storage.sglang",
                      "class_name": "HiCacheStorageAdapter", "interface_v1": 1, "connector": "file",
                      "connector_config": {"root": str(root)}, **extra},
    )  # fmt: skip
    built = StorageBackendFactory.create_backend("dynamic", config, None)
    assert type(built) is HiCacheStorageAdapter
    return built


def test_deepseek_v4_logical_anchor_round_trips_through_its_side_pools(host_pools: Any, tmp_path: Path) -> None:
    """V4's KV anchor holds no bytes: it is accepted, its own I/O is a no-op, and the side pools
    decide what is stored (SGLang's Mooncake backend does the same)."""
    side = host_pools(tmp_path, mla=True)
    anchor = LogicalHostPool(side.size, side.page_size, layout=side.layout)
    name = PoolName.DEEPSEEK_V4_C4
    writer, reader = adapter(tmp_path / "l3", mla=True), adapter(tmp_path / "l3", mla=True)
    other = host_pools(tmp_path, mla=True)
    for a, pool in ((writer, side), (reader, other)):
        a.register_mem_pool_host(anchor)
        a.register_mem_host_pool_v2(anchor, PoolName.KV)
        a.register_mem_host_pool_v2(pool, name)
    assert writer.bindings["kv"].io is PageIO.LOGICAL
    ks = keys(3, "v4")
    assert writer.batch_set_v1(ks, slots(side, [1, 2, 3])) == [True] * 3  # nothing to write for the anchor
    assert writer.batch_set_v2([PoolTransfer(name, host_indices=slots(side, [1, 2, 3]), keys=ks)]) == {str(name): [True] * 3}
    query = [PoolTransfer(name, keys=ks, hit_policy=PoolHitPolicy.ALL_PAGES)]
    assert reader.batch_exists_v2(ks + keys(1, "absent"), query).kv_hit_pages == 3
    assert reader.batch_get_v2([PoolTransfer(name, host_indices=slots(other, [5, 6, 7]), keys=ks)]) == {str(name): [True] * 3}
    assert [page(other, p) for p in (5, 6, 7)] == [page(side, p) for p in (1, 2, 3)]
    # Without a pool that holds every page, nothing proves the head of the prefix is stored.
    trailing = [PoolTransfer(name, keys=ks[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    assert reader.batch_exists_v2(ks, trailing).kv_hit_pages == 0
    assert reader.batch_exists(ks) == 0


def test_eagle_draft_on_an_mla_target_is_keyed_per_tp_rank(host_pools: Any, tmp_path: Path) -> None:
    """An MHA draft is TP-sharded although the MLA target is replicated: rank 1 stores and
    restores its own draft heads, and SGLang is told to back up on rank 1 (it skips every backup
    on MLA ranks other than 0 otherwise)."""
    target = [host_pools(tmp_path, mla=True) for _ in range(2)]
    drafts = [host_pools(tmp_path) for _ in range(2)]
    ranks = [adapter(tmp_path / "l3", tp_rank=r, tp_size=2, mla=True) for r in range(2)]
    for r, a in enumerate(ranks):
        a.register_mem_pool_host(target[r])
        assert a.storage_config.is_storage_writer == (r == 0)
        a.register_mem_host_pool_v2(drafts[r], PoolName.DRAFT)
    assert ranks[1].storage_config.is_storage_writer, "SGLang would skip rank 1's draft backups"
    assert ranks[0].bindings["kv"].scopes[0].shard.replicated and not ranks[1].bindings["draft"].scopes[0].shard.replicated
    ks = keys(2, "eagle")
    for r, a in enumerate(ranks):
        assert a.batch_set_v1(ks, slots(target[r], [1, 2])) == [True, True]
        assert a.batch_set_v2([PoolTransfer(PoolName.DRAFT, host_indices=slots(drafts[r], [1, 2]), keys=ks)]) == {"draft": [True, True]}
    for r, a in enumerate(ranks):
        assert a.batch_get_v2([PoolTransfer(PoolName.DRAFT, host_indices=slots(drafts[r], [8, 9]), keys=ks)]) == {"draft": [True, True]}
        assert [page(drafts[r], p) for p in (8, 9)] == [page(drafts[r], p) for p in (1, 2)], f"rank {r} read another rank's draft heads"
        assert a.batch_get_v1(ks, slots(target[r], [8, 9])) == [True, True]
        assert [page(target[r], p) for p in (8, 9)] == [page(target[0], p) for p in (1, 2)], "MLA KV is rank 0's, shared"
    assert page(drafts[0], 1) != page(drafts[1], 1)


def test_mtp_and_no_mtp_deployments_of_one_model_do_not_collide(host_pools: Any, tmp_path: Path) -> None:
    """MTP draft layers are packed into the KV host pool (more layers per page): its pages are
    keyed apart from a deployment without them, so each fills and reads its own."""
    plain, with_mtp = host_pools(tmp_path, mla=True, layers=4), host_pools(tmp_path, mla=True, layers=5)
    a, b = adapter(tmp_path / "l3", mla=True), adapter(tmp_path / "l3", mla=True)
    a.register_mem_pool_host(plain)
    b.register_mem_pool_host(with_mtp)
    assert a.scope.namespace != b.scope.namespace
    ks = keys(2, "mtp")
    assert a.batch_set_v1(ks, slots(plain, [1, 2])) == [True, True]
    assert b.batch_exists(ks) == 0, "the MTP deployment must not take the other's pages as its own"
    assert b.batch_set_v1(ks, slots(with_mtp, [1, 2])) == [True, True]
    assert b.batch_get_v1(ks, slots(with_mtp, [7, 8])) == [True, True]
    assert [page(with_mtp, p) for p in (7, 8)] == [page(with_mtp, p) for p in (1, 2)]


def test_a_pool_that_cannot_describe_a_page_moves_flat_copies(host_pools: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's DSA indexer pool on layer_first and Mamba pools with slot side state raise in
    ``get_page_buffer_meta``; their pages move as flat copies instead of being dropped."""
    pools = [host_pools(tmp_path, layout="layer_first") for _ in range(2)]
    for pool in pools:
        monkeypatch.setattr(pool, "get_page_buffer_meta", _refuse)
    a, b = adapter(tmp_path / "l3"), adapter(tmp_path / "l3")
    a.register_mem_pool_host(pools[0])
    b.register_mem_pool_host(pools[1])
    assert a.bindings["kv"].io is PageIO.FLAT and a.scope.namespace.geometry.endswith(",flat")
    ks = keys(3, "flat")
    assert a.batch_set_v1(ks, slots(pools[0], [1, 2, 3])) == [True] * 3
    assert b.batch_exists(ks) == 3
    assert b.batch_get_v1(ks, slots(pools[1], [4, 5, 6])) == [True] * 3
    assert [page(pools[1], p) for p in (4, 5, 6)] == [page(pools[0], p) for p in (1, 2, 3)]


def _refuse(indices: torch.Tensor) -> None:
    raise NotImplementedError("this pool cannot describe a page as runs")


def test_page_head_pages_are_shared_between_tp_sizes(host_pools: Any, tmp_path: Path) -> None:
    """With ``tp_lcm_size``, a page_head page is stored as head groups keyed by the rank of the
    TP-lcm deployment that holds them: a TP1 rank's two groups are a TP2 deployment's ranks."""
    whole = host_pools(tmp_path, layout="page_head")
    a = adapter(tmp_path / "l3", tp_lcm_size=2)
    a.storage_config.tp_lcm_size, a.storage_config.should_split_heads = 2, True  # what SGLang's controller sets
    a.register_mem_pool_host(whole)
    assert [s.shard.tp_rank for s in a.bindings["kv"].scopes] == [0, 1]
    ks = keys(2, "heads")
    assert a.batch_set_v1(ks, slots(whole, [1, 2])) == [True, True]
    assert a.batch_exists(ks) == 2
    assert a.batch_get_v1(ks, slots(whole, [5, 6])) == [True, True]
    assert [page(whole, p) for p in (5, 6)] == [page(whole, p) for p in (1, 2)]


def test_flags_sglang_adds_are_accepted_and_unread_ones_warned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hicache_storage.sglang"):
        built = adapter(tmp_path / "l3", file_storage_path="/data/hicache", prefetch_timeout_max=30)
    assert built.config.connector == "file"
    messages = [record.getMessage() for record in caplog.records]
    assert any("file_storage_path" in m and "--file-storage-path" in m for m in messages)
    assert any("prefetch_timeout_max" in m and "no effect" in m for m in messages)


def test_clear_covers_every_registered_pool(host_pools: Any, tmp_path: Path) -> None:
    kv, side = host_pools(tmp_path, mla=True), host_pools(tmp_path)
    writer = adapter(tmp_path / "l3", mla=True)
    writer.register_mem_pool_host(kv)
    writer.register_mem_host_pool_v2(side, PoolName.DRAFT)
    ks = keys(2, "clear")
    writer.batch_set_v1(ks, slots(kv, [1, 2]))
    writer.batch_set_v2([PoolTransfer(PoolName.DRAFT, host_indices=slots(side, [1, 2]), keys=ks)])
    restarted = adapter(tmp_path / "l3", mla=True)  # a new process: its pools registered, no I/O yet
    restarted.register_mem_pool_host(kv)
    restarted.register_mem_host_pool_v2(side, PoolName.DRAFT)
    restarted.clear()
    draft = [PoolTransfer(PoolName.DRAFT, keys=ks, hit_policy=PoolHitPolicy.ALL_PAGES)]
    assert writer.batch_exists(ks) == 0
    assert writer.batch_exists_v2(ks, draft).kv_hit_pages == 0
    assert not any(p.is_file() for p in (tmp_path / "l3").rglob("*") if p.name not in ("namespace.json",))
