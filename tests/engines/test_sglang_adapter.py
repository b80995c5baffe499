"""The SGLang adapter, built by SGLang's own factory, moving pages of SGLang's own host pool code,
in the project's environment.

SGLang's own cache stack (``UnifiedRadixCache``, ``HybridCacheController``, the real host pools)
drives the adapter in tests/sglang_tier, in SGLang's own environment. This file keeps what that
tier does not reach: every case on three connectors (memory, file, redis), TP and PP ranks side by
side, deployments of another identity kept apart, three ``STORAGE_BATCH_SIZE`` batches, failing
stores. The project's torch (2.13.0+cpu) cannot import SGLang's host pool module
(``sglang.srt.configs`` imports transformers' image code, which needs a torchvision built for the
installed torch), so the methods that decide a page's bytes and addresses (``init_kv_buffer``,
``get_page_buffer_meta``, ``get_data_page``, ``set_from_flat_data_page``,
``get_dummy_flat_data_page``, and the DCP page helpers) are compiled from the installed SGLang
source, unchanged, over a plain CPU allocation (``pin_memory`` off). Only the allocator and the
constructor's bookkeeping are ours.
"""

from __future__ import annotations

import __future__
import ast
import importlib
import itertools
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import types
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from queue import Queue
from typing import Any, List, Optional

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    count_pool_hits,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

from hicache_storage.errors import BackendUnavailableError, ConfigError, InvalidArgumentError, StorageError
from hicache_storage.keys import page_hashes
from hicache_storage.sglang import HiCacheStorageAdapter, page_hash_of

SGLANG_ROOT = Path(list(importlib.util.find_spec("sglang").submodule_search_locations)[0])


# --- SGLang's host pool code over a CPU allocation ------------------------------------------------


def sglang_code(relative_path: str, names: tuple[str, ...], within: str | None = None, **globals_: Any) -> dict[str, Any]:
    """Compile the named definitions (top-level ones, or methods of class ``within``) from the
    installed SGLang source file, unchanged; ``globals_`` supplies the names they use."""
    path = SGLANG_ROOT / relative_path
    body = ast.parse(path.read_text()).body
    if within is not None:
        body = next(node for node in body if isinstance(node, ast.ClassDef) and node.name == within).body
    found = {node.name: node for node in body if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names}
    missing = set(names) - set(found)
    assert not missing, f"SGLang's {relative_path} no longer defines {sorted(missing)}; update the stand-in"
    if within is not None:  # keep @property; drop method decorators such as @synchronized
        for node in found.values():
            node.decorator_list = [d for d in node.decorator_list if isinstance(d, ast.Name) and d.id == "property"]
    namespace: dict[str, Any] = {"torch": torch, **globals_}
    module = ast.Module(body=list(found.values()), type_ignores=[])
    code = compile(module, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, namespace)
    return {name: namespace[name] for name in names}


def _cpu_alloc(dims: tuple, dtype: torch.dtype, device: str, pin_memory: bool, allocator: Any, **_: Any) -> torch.Tensor:
    assert not pin_memory and device == "cpu"
    return torch.empty(dims, dtype=dtype, device=device)


_PAGE_METHODS = ("init_kv_buffer", "get_page_buffer_meta", "get_data_page", "set_from_flat_data_page", "get_dummy_flat_data_page")
_ALLOC = {"ALLOC_MEMORY_FUNCS": defaultdict(lambda: _cpu_alloc)}
_BASE = sglang_code("srt/mem_cache/pool_host/base.py", ("logical_size", "logical_page_size"), within="HostKVCache")
MHAHostPool = type(
    "MHATokenToKVPoolHost",
    (),
    {**_BASE, **sglang_code("srt/mem_cache/pool_host/mha.py", _PAGE_METHODS, within="MHATokenToKVPoolHost", **_ALLOC)},
)
MLAHostPool = type(
    "MLATokenToKVPoolHost",
    (),
    {
        **_BASE,
        **sglang_code(
            "srt/mem_cache/pool_host/mla.py", (*_PAGE_METHODS, "_storage_page_index"), within="MLATokenToKVPoolHost", **_ALLOC
        ),
    },
)


def make_host_pool(
    kind: str = "mha", layout: str = "page_first", page_size: int = 4, pages: int = 24, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> Any:
    """A host pool of ``pages`` pages (plus SGLang's padding page), filled with seeded random bytes."""
    pool = (MHAHostPool if kind == "mha" else MLAHostPool)()
    pool.layout, pool.page_size, pool.dtype = layout, page_size, dtype
    pool.page_num = pages + 1
    pool.size = pool.page_num * page_size
    pool.layer_num = 3
    pool.device, pool.pin_memory, pool.allocator = "cpu", False, None
    pool._transfer_device = torch.device("cpu")
    pool.dcp_size, pool.dcp_rank = 1, 0
    if kind == "mha":
        pool.head_num, pool.head_dim, pool.v_head_dim = 2, 8, 8
    else:
        pool.kv_lora_rank, pool.qk_rope_head_dim = 12, 4
        pool.kv_cache_dim = 16
    pool.kv_buffer = pool.init_kv_buffer()
    generator = torch.Generator().manual_seed(seed)
    flat = pool.kv_buffer.view(torch.uint8).view(-1)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=generator))
    return pool


def host_indices(pool: Any, page_ids: list[int]) -> torch.Tensor:
    """Token slots of the given pages, as SGLang's allocator hands them out (page-aligned runs)."""
    return torch.cat([torch.arange(p * pool.page_size, (p + 1) * pool.page_size, dtype=torch.int64) for p in page_ids])


def page_bytes(pool: Any, page_id: int) -> bytes:
    return pool.get_data_page(page_id * pool.page_size, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def chain(n: int, salt: str = "") -> list[str]:
    import hashlib

    return [hashlib.sha256(f"{salt}page{i}".encode()).hexdigest() for i in range(n)]


# --- building the adapter the way SGLang does ----------------------------------------------------


@dataclass
class Rank:
    tp_rank: int = 0
    tp_size: int = 1
    is_mla: bool = False
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    metrics: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def storage_config(rank: Rank, connector: str, connector_config: dict[str, Any]) -> HiCacheStorageConfig:
    extra = {
        "backend_name": "hicache",
        "module_path": "hicache_storage.sglang",
        "class_name": "HiCacheStorageAdapter",
        "interface_v1": 1,
        "connector": connector,
        "connector_config": connector_config,
        **rank.extra,
    }
    return HiCacheStorageConfig(
        tp_rank=rank.tp_rank,
        tp_size=rank.tp_size,
        pp_rank=rank.pp_rank,
        pp_size=rank.pp_size,
        attn_cp_rank=rank.cp_rank,
        attn_cp_size=rank.cp_size,
        is_mla_model=rank.is_mla,
        enable_storage_metrics=rank.metrics,
        is_page_first_layout=True,
        model_name=rank.model,
        extra_config=extra,
    )


@pytest.fixture(params=["memory", "file", "redis"])
def connector(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """Each connector's config; instances built from it share one store."""
    if request.param == "memory":
        return "memory", {"store": f"sglang-{request.node.name}"}
    if request.param == "file":
        return "file", {"root": str(tmp_path / "kv")}
    server = request.getfixturevalue("redis_server")
    return "redis", {"url": server.url, "prefix": f"t{abs(hash(request.node.nodeid)) % 10**8}"}


@pytest.fixture
def open_adapter(connector: tuple[str, dict[str, Any]]) -> Any:
    opened: list[HiCacheStorageAdapter] = []

    def build(pool: Any, rank: Rank | None = None) -> HiCacheStorageAdapter:
        name, config = connector
        rank = rank or Rank(is_mla=isinstance(pool, MLAHostPool))
        adapter = StorageBackendFactory.create_backend("dynamic", storage_config(rank, name, config), pool)
        assert type(adapter) is HiCacheStorageAdapter
        adapter.register_mem_pool_host(pool)  # what SGLang's cache controller does next
        opened.append(adapter)
        return adapter

    yield build
    for adapter in opened:
        adapter.close()


# --- zero-copy round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_pages_round_trip_bit_exact_between_two_engines(open_adapter: Any, kind: str, layout: str) -> None:
    writer_pool = make_host_pool(kind, layout, seed=1)
    reader_pool = make_host_pool(kind, layout, seed=2)
    writer, reader = open_adapter(writer_pool), open_adapter(reader_pool)
    keys = chain(6, salt=f"{kind}{layout}")
    src_pages, dst_pages = [3, 9, 1, 17, 4, 22], [20, 2, 11, 5, 14, 7]
    assert writer.batch_set_v1(keys, host_indices(writer_pool, src_pages)) == [True] * 6
    assert reader.batch_exists(keys) == 6
    assert reader.batch_get_v1(keys, host_indices(reader_pool, dst_pages)) == [True] * 6
    for src, dst in zip(src_pages, dst_pages):
        assert page_bytes(reader_pool, dst) == page_bytes(writer_pool, src)


@pytest.mark.services
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_mooncake_round_trip_from_the_registered_host_pool(request: pytest.FixtureRequest, kind: str) -> None:
    """Pages round-trip through a real Mooncake master, with the host pool registered by the adapter."""
    pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine(-non-cuda)")
    master = request.getfixturevalue("mooncake_master")
    pools = [make_host_pool(kind, seed=50), make_host_pool(kind, seed=51)]
    adapters = []
    for pool in pools:
        config = storage_config(Rank(is_mla=kind == "mla"), "mooncake", master.client_config())
        adapter = StorageBackendFactory.create_backend("dynamic", config, pool)
        adapter.register_mem_pool_host(pool)
        adapters.append(adapter)
    try:
        keys = chain(5, salt=f"mooncake-{kind}-{time.time_ns()}")
        assert adapters[0].batch_set_v1(keys, host_indices(pools[0], [0, 1, 2, 3, 4])) == [True] * 5
        assert adapters[1].batch_exists(keys) == 5
        assert adapters[1].batch_get_v1(keys, host_indices(pools[1], [9, 8, 7, 6, 5])) == [True] * 5
        for src, dst in zip([0, 1, 2, 3, 4], [9, 8, 7, 6, 5]):
            assert page_bytes(pools[1], dst) == page_bytes(pools[0], src)
    finally:
        for adapter in adapters:
            adapter.close()


def test_segments_per_page_follow_the_pool(open_adapter: Any) -> None:
    """Page-first MHA pages are two segments (K, V); MLA one; layer-first one per layer and half."""
    from hicache_storage.sglang import PageIO, PoolBinding, _page_segments

    cases = [("mha", "page_first", 2), ("mla", "page_first", 1), ("mha", "layer_first", 6), ("mla", "layer_first", 3)]
    for kind, layout, expected in cases:
        pool = make_host_pool(kind, layout)
        binding = PoolBinding("kv", pool, PageIO.SEGMENTS, scopes=(), writes=True)
        segments, total = _page_segments(binding, 2, host_indices(pool, [1, 2]))
        assert [len(s) for s in segments] == [expected, expected]
        assert total == 2 * len(page_bytes(pool, 1))


def test_missing_pages_are_per_key_misses_and_prefix_stops_at_the_first_hole(open_adapter: Any) -> None:
    pool = make_host_pool()
    adapter = open_adapter(pool)
    keys = chain(8, salt="holes")
    present = [0, 1, 2, 4, 5]
    assert adapter.batch_set_v1([keys[i] for i in present], host_indices(pool, present)) == [True] * 5
    assert adapter.batch_exists(keys) == 3
    assert adapter.batch_exists(keys[1:]) == 2
    assert adapter.batch_exists(keys[3:]) == 0
    assert adapter.batch_exists([]) == 0
    results = adapter.batch_get_v1(keys[:6], host_indices(pool, [10, 11, 12, 13, 14, 15]))
    assert results == [True, True, True, False, True, True]
    assert [page_bytes(pool, 10 + i) for i in present] == [page_bytes(pool, i) for i in present]
    assert adapter.exists(keys[4]) and not adapter.exists(keys[3])


def test_two_tp_ranks_do_not_collide(open_adapter: Any) -> None:
    pools = [make_host_pool(seed=10), make_host_pool(seed=11)]
    ranks = [open_adapter(pools[r], Rank(tp_rank=r, tp_size=2)) for r in range(2)]
    keys = chain(4, salt="tp")
    assert ranks[0].batch_set_v1(keys, host_indices(pools[0], [0, 1, 2, 3])) == [True] * 4
    assert ranks[1].batch_exists(keys) == 0, "rank 1 must not see rank 0's head shard"
    assert ranks[1].batch_set_v1(keys, host_indices(pools[1], [0, 1, 2, 3])) == [True] * 4
    for r in range(2):
        assert ranks[r].batch_get_v1(keys, host_indices(pools[r], [5, 6, 7, 8])) == [True] * 4
        for page in range(4):
            assert page_bytes(pools[r], 5 + page) == page_bytes(pools[r], page)
    assert page_bytes(pools[0], 5) != page_bytes(pools[1], 5)


def test_mla_only_rank_zero_writes_and_every_rank_reads(open_adapter: Any) -> None:
    pools = [make_host_pool("mla", seed=20), make_host_pool("mla", seed=21)]
    ranks = [open_adapter(pools[r], Rank(tp_rank=r, tp_size=2, is_mla=True)) for r in range(2)]
    keys = chain(3, salt="mla")
    assert ranks[1].batch_set_v1(keys, host_indices(pools[1], [0, 1, 2])) == [True] * 3, "non-writers report success"
    assert ranks[0].batch_exists(keys) == 0, "a non-writer rank wrote"
    assert ranks[1].batch_set([keys[0]], [pools[1].get_data_page(0)]) is True
    assert ranks[0].batch_exists(keys) == 0, "a non-writer rank wrote through the legacy path"
    assert ranks[0].batch_set_v1(keys, host_indices(pools[0], [0, 1, 2])) == [True] * 3
    assert ranks[1].batch_exists(keys) == 3
    assert ranks[1].batch_get_v1(keys, host_indices(pools[1], [4, 5, 6])) == [True] * 3
    for page in range(3):
        assert page_bytes(pools[1], 4 + page) == page_bytes(pools[0], page)


def test_mla_attention_cp_ranks_each_write_their_own_slice(open_adapter: Any) -> None:
    """Attention CP of 2 with attention TP of 2 (TP 4): each CP rank holds its own slice of every
    MLA page, the same on its two attention-TP ranks. The first attention-TP rank of each CP rank
    writes its slice under its own CP key (and SGLang, which backs up MLA on TP rank 0 only, is
    told to back up there); the other reads it. The SGLang tier runs this through SGLang's tree
    on a real CP group (test_attention_cp_ranks_restore_their_own_slices)."""
    pools = [make_host_pool("mla", seed=30 + r) for r in range(4)]
    ranks = [open_adapter(pools[r], Rank(tp_rank=r, tp_size=4, is_mla=True, cp_rank=r // 2, cp_size=2)) for r in range(4)]
    assert [a.is_writer for a in ranks] == [True, False, True, False]
    assert [a.storage_config.is_storage_writer for a in ranks] == [True, False, True, False], "SGLang would skip CP rank 1"
    keys = chain(2, salt="cp")
    for r in (1, 3):
        assert ranks[r].batch_set_v1(keys, host_indices(pools[r], [0, 1])) == [True, True], "non-writers report success"
    assert ranks[0].batch_exists(keys) == 0 and ranks[2].batch_exists(keys) == 0, "a non-writer rank wrote"
    for r in (0, 2):
        assert ranks[r].batch_set_v1(keys, host_indices(pools[r], [0, 1])) == [True, True]
    for r in range(4):
        assert ranks[r].batch_get_v1(keys, host_indices(pools[r], [4, 5])) == [True, True]
        writer = pools[2 * (r // 2)]
        assert [page_bytes(pools[r], p) for p in (4, 5)] == [page_bytes(writer, p) for p in (0, 1)], f"rank {r} read another CP rank's slice"


@pytest.mark.parametrize(
    ("other_pool", "other_rank"),
    [
        ({"dtype": torch.float16}, {}),
        ({"layout": "layer_first"}, {}),
        ({"page_size": 8}, {}),
        ({}, {"model": "Qwen/Qwen3-8B"}),
        ({}, {"extra": {"tenant": "team-b"}}),
        ({}, {"extra": {"model_revision": "v2"}}),
        ({}, {"pp_rank": 1, "pp_size": 2}),
    ],
    ids=["dtype", "layout", "page_size", "model", "tenant", "revision", "pp_rank"],
)
def test_deployments_that_differ_in_identity_never_share_pages(open_adapter: Any, other_pool: dict, other_rank: dict) -> None:
    mine = make_host_pool()
    theirs = make_host_pool(**other_pool)
    writer = open_adapter(mine)
    reader = open_adapter(theirs, Rank(**other_rank))
    keys = chain(2, salt="identity")
    assert writer.batch_set_v1(keys, host_indices(mine, [0, 1])) == [True, True]
    assert reader.batch_exists(keys) == 0
    assert reader.batch_get_v1(keys, host_indices(theirs, [2, 3])) == [False, False]


def test_writes_skip_pages_already_stored(open_adapter: Any) -> None:
    pool = make_host_pool()
    adapter = open_adapter(pool)
    keys = chain(4, salt="skip")
    assert adapter.batch_set_v1(keys[:2], host_indices(pool, [0, 1])) == [True, True]
    puts_before = adapter.store.stats()["put_keys"]
    assert adapter.batch_set_v1(keys, host_indices(pool, [0, 1, 2, 3])) == [True] * 4
    assert adapter.store.stats()["put_keys"] - puts_before == 2


# --- legacy copy path and SGLang's other entry points -------------------------------------------


def test_legacy_flat_page_path_round_trips(open_adapter: Any) -> None:
    pool = make_host_pool("mha", "layer_first")
    adapter = open_adapter(pool)
    keys = chain(3, salt="legacy")
    assert adapter.batch_set(keys, [pool.get_data_page(p * pool.page_size) for p in range(3)]) is True
    pages = adapter.batch_get(keys + chain(1, salt="absent"), [pool.get_dummy_flat_data_page() for _ in range(4)])
    assert pages[3] is None
    for p in range(3):
        pool.set_from_flat_data_page((10 + p) * pool.page_size, pages[p])
        assert page_bytes(pool, 10 + p) == page_bytes(pool, p)
    single = adapter.get(keys[0])
    assert single is not None and single.view(torch.uint8).numpy().tobytes() == page_bytes(pool, 0)
    assert adapter.set(chain(1, salt="one")[0], pool.get_data_page(0)) is True


def test_non_hex_keys_map_to_stable_page_hashes(open_adapter: Any) -> None:
    pool = make_host_pool()
    adapter = open_adapter(pool)
    assert page_hash_of("ab" * 32) == "ab" * 32
    assert page_hash_of("prefix-key.mamba") == page_hash_of("prefix-key.mamba") != page_hash_of("prefix-key")
    assert adapter.batch_set_v1(["prefix-key.mamba"], host_indices(pool, [0])) == [True]
    assert adapter.batch_exists(["prefix-key.mamba"]) == 1


def test_clear_removes_only_this_deployment(open_adapter: Any) -> None:
    pool = make_host_pool()
    mine, other = open_adapter(pool), open_adapter(pool, Rank(extra={"tenant": "other"}))
    keys = chain(2, salt="clear")
    mine.batch_set_v1(keys, host_indices(pool, [0, 1]))
    other.batch_set_v1(keys, host_indices(pool, [0, 1]))
    mine.clear()
    assert mine.batch_exists(keys) == 0
    assert other.batch_exists(keys) == 2


def test_pool_transfers_v2_with_a_side_pool(open_adapter: Any) -> None:
    kv_pool, swa_pool = make_host_pool(seed=30), make_host_pool(dtype=torch.float16, seed=31)
    adapter = open_adapter(kv_pool)
    adapter.register_mem_host_pool_v2(swa_pool, PoolName.SWA)
    keys = chain(6, salt="v2")
    kv = PoolTransfer(name=PoolName.KV, keys=keys, host_indices=host_indices(kv_pool, list(range(6))))
    swa = PoolTransfer(name=PoolName.SWA, keys=keys[4:], host_indices=host_indices(swa_pool, [4, 5]))
    assert adapter.batch_set_v2([kv, swa]) == {"kv": [True] * 6, "swa": [True, True]}

    trailing = PoolTransfer(name=PoolName.SWA, keys=keys[4:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    result = adapter.batch_exists_v2(keys, [trailing])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (6, [6])
    every = PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    assert adapter.batch_exists_v2(keys, [every]).kv_hit_pages == 0

    read = PoolTransfer(name=PoolName.SWA, keys=keys[4:], host_indices=host_indices(swa_pool, [10, 11]))
    assert adapter.batch_get_v2([read]) == {"swa": [True, True]}
    assert page_bytes(swa_pool, 10) == page_bytes(swa_pool, 4)
    assert adapter.batch_get_v1(keys[4:], host_indices(kv_pool, [10, 11])) == [True, True]
    assert page_bytes(kv_pool, 11) == page_bytes(kv_pool, 5) != page_bytes(swa_pool, 5)


def test_v2_lookup_asks_each_pool_under_its_own_scope(open_adapter: Any) -> None:
    """MLA KV is replicated across TP ranks, the mamba state is TP-sharded and of its own dtype:
    rank 1 sees rank 0's KV but not rank 0's state, and the state's keys carry the float16 dtype."""
    kv_pools = [make_host_pool("mla", seed=40 + r) for r in range(2)]
    state_pools = [make_host_pool(dtype=torch.float16, seed=42 + r) for r in range(2)]
    ranks = [open_adapter(kv_pools[r], Rank(tp_rank=r, tp_size=2, is_mla=True)) for r in range(2)]
    for rank, state_pool in zip(ranks, state_pools):
        rank.register_mem_host_pool_v2(state_pool, PoolName.MAMBA)
    keys = chain(6, salt="scopes")
    kv = PoolTransfer(name=PoolName.KV, keys=keys, host_indices=host_indices(kv_pools[0], list(range(6))))
    state = PoolTransfer(name=PoolName.MAMBA, keys=keys[2:3], host_indices=host_indices(state_pools[0], [2]))
    assert ranks[0].batch_set_v2([kv, state]) == {"kv": [True] * 6, "mamba": [True]}

    query = PoolTransfer(name=PoolName.MAMBA, keys=keys[2:3], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    mine = ranks[0].batch_exists_v2(keys, [query])
    assert (mine.kv_hit_pages, mine.restorable_prefix_pages, mine.extra_pool_hit_pages) == (3, [3], {"kv": 6, "mamba": 3})
    other = ranks[1].batch_exists_v2(keys, [query])
    assert (other.kv_hit_pages, other.restorable_prefix_pages, other.extra_pool_hit_pages) == (0, [], {"kv": 6})

    scope = ranks[0].bindings[PoolName.MAMBA.value].scopes[0]
    assert (scope.namespace.kv_dtype, scope.shard.replicated, scope.part) == ("float16", False, "mamba")
    assert ranks[0].store.exists(scope.keys([page_hash_of(keys[2])])) == [True]
    # Page 5 is stored in the KV pool only: under the state's scope its hash names nothing.
    assert ranks[0].store.exists([ranks[0].scope.key(page_hash_of(keys[5])), scope.key(page_hash_of(keys[5]))]) == [True, False]


def test_get_stats_has_sglang_shape_and_resets_on_read(open_adapter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang asserts ``isinstance(stats, StorageMetrics)``; its module cannot import on this CPU box
    (see the module docstring), so the class is stood in with SGLang's four fields."""

    @dataclass
    class StorageMetrics:
        prefetch_pgs: list = field(default_factory=list)
        backup_pgs: list = field(default_factory=list)
        prefetch_bandwidth: list = field(default_factory=list)
        backup_bandwidth: list = field(default_factory=list)

    module = types.ModuleType("sglang.srt.observability.metrics_collector")
    module.StorageMetrics = StorageMetrics
    monkeypatch.setitem(sys.modules, module.__name__, module)
    pool = make_host_pool()
    adapter = open_adapter(pool, Rank(metrics=True))
    keys = chain(3, salt="stats")
    adapter.batch_set_v1(keys, host_indices(pool, [0, 1, 2]))
    adapter.batch_get_v1(keys, host_indices(pool, [3, 4, 5]))
    stats = adapter.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert (stats.backup_pgs, stats.prefetch_pgs) == ([3], [3])
    assert stats.backup_bandwidth[0] > 0 and stats.prefetch_bandwidth[0] > 0
    assert adapter.get_stats() == StorageMetrics()


# --- SGLang's cache controller I/O code driving the adapter -------------------------------------
#
# HiCacheController cannot be imported here either (same import chain); its storage I/O methods
# and operation classes are compiled from the installed source, unchanged, and run against the
# adapter: the backup loop, the hit query (SGLang's own hashing, batched by STORAGE_BATCH_SIZE),
# and the prefetch transfer loop.

_CONTROLLER_GLOBALS = {
    "STORAGE_BATCH_SIZE": STORAGE_BATCH_SIZE,
    "HiCacheStorageExtraInfo": HiCacheStorageExtraInfo,
    "PoolName": PoolName,
    "PoolTransfer": PoolTransfer,
    "count_pool_hits": count_pool_hits,
    "get_storage_hash_str": get_storage_hash_str,
    "logger": logging.getLogger("sglang.srt.managers.cache_controller"),
    "dataclass": dataclass,
    "threading": threading,
    "time": time,
    "List": List,
    "Optional": Optional,
}
_OPERATIONS = sglang_code(
    "srt/managers/cache_controller.py", ("PrefetchAck", "StorageOperation", "PrefetchOperation"), **_CONTROLLER_GLOBALS
)
_CONTROLLER_GLOBALS.update(_OPERATIONS)
HiCacheController = type(
    "HiCacheController",
    (),
    sglang_code(
        "srt/managers/cache_controller.py",
        (
            "_page_backup",
            "_page_set_zero_copy",
            "_page_get_zero_copy",
            "_generic_page_set",
            "_generic_page_get",
            "_storage_hit_query",
            "_page_transfer",
            "_page_transfer_kv_batch",
        ),
        within="HiCacheController",
        **_CONTROLLER_GLOBALS,
    ),
)
StorageOperation, PrefetchOperation = _OPERATIONS["StorageOperation"], _OPERATIONS["PrefetchOperation"]


def controller(adapter: HiCacheStorageAdapter, pool: Any, zero_copy: bool) -> Any:
    """The controller state those methods read, wired as SGLang wires it for ``interface_v1`` 1 or 0."""
    ctrl = HiCacheController()
    ctrl.storage_backend, ctrl.storage_host_pool, ctrl.page_size = adapter, pool, pool.page_size
    ctrl.prefetch_sync_queue = Queue()
    if zero_copy:
        ctrl.page_get_func, ctrl.page_set_func = ctrl._page_get_zero_copy, ctrl._page_set_zero_copy
    else:
        ctrl.page_get_func, ctrl.page_set_func = ctrl._generic_page_get, ctrl._generic_page_set
    return ctrl


@pytest.mark.parametrize("zero_copy", [True, False], ids=["interface_v1", "legacy"])
def test_sglang_controller_backs_up_queries_and_prefetches_through_the_adapter(open_adapter: Any, zero_copy: bool) -> None:
    pages = STORAGE_BATCH_SIZE * 2 + 44  # three storage batches
    writer_pool, reader_pool = make_host_pool(pages=2 * pages, seed=40), make_host_pool(pages=2 * pages, seed=41)
    writer = controller(open_adapter(writer_pool), writer_pool, zero_copy)
    reader = controller(open_adapter(reader_pool), reader_pool, zero_copy)
    tokens = [(i * 7919) % 150_000 for i in range(pages * writer_pool.page_size + 3)]
    hashes = get_storage_hash_str(tokens, None, page_size=writer_pool.page_size)[:pages]
    assert hashes == page_hashes(tokens, writer_pool.page_size)

    stored = pages - 50  # the backup of the last 50 pages has not happened
    backup = StorageOperation(host_indices(writer_pool, list(range(stored))), tokens, hash_value=hashes[:stored])
    writer._page_backup(backup)
    assert backup.completed_tokens == stored * writer_pool.page_size

    prefetch = PrefetchOperation("request-1", tokens[: pages * reader_pool.page_size])
    hit_hashes, hit_tokens = reader._storage_hit_query(prefetch)
    assert (hit_hashes, hit_tokens) == (hashes[:stored], stored * reader_pool.page_size)
    prefetch.hash_value = hit_hashes
    prefetch.host_indices = host_indices(reader_pool, list(range(pages, pages + stored)))
    assert reader._page_transfer(prefetch) == stored
    acks = [reader.prefetch_sync_queue.get_nowait() for _ in range(reader.prefetch_sync_queue.qsize())]
    assert acks[-1].completed_tokens == stored * reader_pool.page_size
    for page in (0, STORAGE_BATCH_SIZE, stored - 1):
        assert page_bytes(reader_pool, pages + page) == page_bytes(writer_pool, page)


# --- the launch examples in docs/sglang.md are valid --------------------------------------------

DOCS = Path(__file__).resolve().parents[2] / "docs" / "sglang.md"


def connector_config_class(name: str) -> type:
    """A connector's Config class, without requiring its client library."""
    from hicache_storage.registry import known_specs

    module, _, attr = known_specs()[name].target.partition(":")
    return getattr(importlib.import_module(module), attr).Config


def check_extra_config(extra: dict[str, Any]) -> None:
    from hicache_storage.sglang import AdapterConfig

    config = AdapterConfig.from_extra_config(extra)
    assert (extra["module_path"], extra["class_name"], extra["interface_v1"]) == ("hicache_storage.sglang", "HiCacheStorageAdapter", 1)
    connector_config_class(config.connector).parse(config.connector_config)


def test_documented_launch_flags_give_valid_adapter_configs() -> None:
    text = DOCS.read_text()
    common = re.search(r"^X='(.*)'$", text, re.M).group(1)
    examples = re.findall(r"^\s+(\"\{\$X, .*\}\")\s*$", text, re.M)
    connectors = []
    for word in examples:  # what the shell hands SGLang for each documented command line
        shell = subprocess.run(["bash", "-c", f"X='{common}'; printf '%s' {word}"], capture_output=True, text=True, check=True)
        extra = json.loads(shell.stdout)
        check_extra_config(extra)
        connectors.append(extra["connector"])
    assert sorted(connectors) == ["file", "fsspec", "memory", "mooncake", "redis", "s3"]


def test_documented_config_file_parses_with_sglangs_own_parser(tmp_path: Path) -> None:
    parse = sglang_code(
        "srt/mem_cache/hybrid_cache/hybrid_cache_controller.py",
        ("parse_storage_backend_extra_config",),
        within="HybridCacheController",
        json=json,
        os=os,
    )["parse_storage_backend_extra_config"]
    path = tmp_path / "hicache.yaml"
    path.write_text(re.search(r"```yaml\n(.*?)```", DOCS.read_text(), re.S).group(1))
    extra, prefetch_threshold, *_ = parse(f"@{path}")
    assert prefetch_threshold == 256 and "prefetch_threshold" not in extra
    check_extra_config(extra)


# --- failures degrade, bad config is loud -------------------------------------------------------


def test_backup_and_prefetch_threads_at_once(open_adapter: Any) -> None:
    """SGLang's backup and prefetch threads call one backend concurrently."""
    pool = make_host_pool(pages=64)
    adapter = open_adapter(pool)
    keys = chain(64, salt="threads")
    assert adapter.batch_set_v1(keys[:32], host_indices(pool, list(range(32)))) == [True] * 32
    errors: list[BaseException] = []

    def backup() -> None:
        try:
            for start in range(32, 64, 4):
                assert adapter.batch_set_v1(keys[start : start + 4], host_indices(pool, list(range(start, start + 4)))) == [True] * 4
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=backup)
    thread.start()
    for _ in range(8):
        assert adapter.batch_get_v1(keys[:32], host_indices(pool, [p % 32 for p in range(32)])) == [True] * 32
    thread.join(timeout=60)
    assert not thread.is_alive() and not errors, errors
    assert adapter.batch_exists(keys) == 64


def test_a_failing_store_degrades_to_misses(tmp_path: Path) -> None:
    failing = {"kind": "faults", "exists": {"error_rate": 1.0}, "get": {"error_rate": 1.0}, "put": {"error_rate": 1.0}}
    pool = make_host_pool()
    config = storage_config(Rank(extra={"layers": [failing]}), "memory", {})
    adapter = StorageBackendFactory.create_backend("dynamic", config, pool)
    adapter.register_mem_pool_host(pool)
    keys = chain(2, salt="down")
    assert adapter.batch_set_v1(keys, host_indices(pool, [0, 1])) == [False, False]
    assert adapter.batch_get_v1(keys, host_indices(pool, [2, 3])) == [False, False]
    assert adapter.batch_exists(keys) == 0
    assert adapter.exists(keys[0]) is False
    assert adapter.batch_set(keys, [pool.get_data_page(0)] * 2) is False
    assert adapter.batch_get(keys, [pool.get_dummy_flat_data_page()] * 2) == [None, None]


def test_a_store_that_keeps_failing_is_not_called_until_a_probe_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Consecutive temporary failures open the adapter's breaker: SGLang's lookups then answer
    "nothing stored" without calling the store; once the store answers a probe, calls resume."""
    pool = make_host_pool()
    breaker = {"failures_to_open": 3, "probe_backoff_s": 0.01, "probe_backoff_max_s": 0.01}
    adapter = StorageBackendFactory.create_backend("dynamic", storage_config(Rank(extra={"breaker": breaker}), "memory", {}), pool)
    adapter.register_mem_pool_host(pool)
    adapter.breaker._run_probe = lambda probe: probe()  # probe on the caller's thread: no race in the test
    keys = chain(2, salt="breaker")
    assert adapter.batch_set_v1(keys, host_indices(pool, [0, 1])) == [True, True]
    store_exists, calls, down = adapter.store.exists, [], [True]

    def exists(page_keys: Any) -> list[bool]:  # the fault: a store that stopped answering
        calls.append(len(page_keys))
        if down[0]:
            raise BackendUnavailableError("injected: store down", backend="memory")
        return store_exists(page_keys)

    monkeypatch.setattr(adapter.store, "exists", exists)
    monkeypatch.setattr(adapter.store, "prefix_exists", lambda page_keys: sum(1 for _ in itertools.takewhile(bool, exists(page_keys))))
    assert [adapter.batch_exists(keys) for _ in range(3)] == [0, 0, 0]
    assert len(calls) == 3 and adapter.health_counts["breaker_opened"] == 1
    assert adapter.batch_exists(keys) == 0 and len(calls) == 3, "an open breaker must not call the store"
    assert adapter.batch_set_v1(keys, host_indices(pool, [0, 1])) == [False, False] and len(calls) == 3
    assert adapter.health_counts["skipped_exists"] == 2
    down[0] = False
    time.sleep(0.05)  # past the probe backoff
    answers = [adapter.batch_exists(keys) for _ in range(2)]
    assert answers[-1] == 2 and adapter.health_counts["breaker_closed"] == 1


def test_a_bad_breaker_config_is_a_config_error() -> None:
    config = storage_config(Rank(extra={"breaker": {"failures_to_open": 0}}), "memory", {})
    with pytest.raises(ConfigError, match="breaker.*failures_to_open"):
        StorageBackendFactory.create_backend("dynamic", config, None)


@pytest.mark.parametrize(("kind", "degrades"), [("capacity", True), ("authentication", False), ("contract", False)])
def test_the_errors_status_decides_miss_or_raise(kind: str, degrades: bool) -> None:
    """A temporary error (a full store, though a PermanentError by class) is a miss; a permanent one is raised."""
    failing = {"kind": "faults", "exists": {"error_rate": 1.0, "errors": [kind]}}
    pool = make_host_pool()
    adapter = StorageBackendFactory.create_backend("dynamic", storage_config(Rank(extra={"layers": [failing]}), "memory", {}), pool)
    adapter.register_mem_pool_host(pool)
    keys = chain(2, salt=kind)
    if degrades:
        assert adapter.batch_exists(keys) == 0
    else:
        with pytest.raises(StorageError, match=f"injected fault: {kind}"):
            adapter.batch_exists(keys)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"connector": None}, "needs 'connector'"),
        ({"conector_config": {}}, "unknown config key"),
        ({"connector": "nosuch"}, "unknown storage backend"),
        ({"connector_config": {"bogus": 1}}, "unknown config key"),
        ({"tenant": 5}, "tenant"),
    ],
)
def test_bad_extra_config_is_a_config_error(extra: dict[str, Any], message: str) -> None:
    config = storage_config(Rank(), "memory", {})
    config.extra_config.update(extra)
    if extra.get("connector", "") is None:
        del config.extra_config["connector"]
    with pytest.raises(Exception) as info:
        StorageBackendFactory.create_backend("dynamic", config, None)
    assert isinstance(info.value, (ConfigError, LookupError)) and message in str(info.value)


def test_unsupported_layout_and_unregistered_pool_are_refused() -> None:
    adapter = HiCacheStorageAdapter(storage_config(Rank(), "memory", {}))
    with pytest.raises(InvalidArgumentError, match="register_mem_pool_host"):
        adapter.batch_exists(chain(1))
    pool = make_host_pool()
    pool.layout = "page_diagonal"
    with pytest.raises(ConfigError, match="page_diagonal.*page_first_kv_split, page_head"):
        adapter.register_mem_pool_host(pool)
    good = make_host_pool()
    adapter.register_mem_pool_host(good)
    with pytest.raises(InvalidArgumentError, match="host indices"):
        adapter.batch_get_v1(chain(2), host_indices(good, [0]))


def test_importing_hicache_storage_does_not_import_sglang() -> None:
    code = "import sys, hicache_storage, hicache_storage.registry; assert 'sglang' not in sys.modules, 'sglang imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
