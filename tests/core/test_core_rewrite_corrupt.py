"""A page corrupted in L3 is rewritten by the next backup of that page, so its hits come back.

The store keeps saying such a page exists (its file is there, same length), so a backup that
skips what ``prefix_exists`` reports would never replace it, and every later read would miss
through the integrity wrapper. The prefetcher remembers a page whose read failed although the
store reported it (``Prefetcher.suspects``); the next backup of that page rewrites it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from hicache_core import CacheTiers, Engine, Request, RequestResult
from hicache_core.page_sets import PageSet
from hicache_core.soak import tiny_engine_config
from hicache_storage import create_backend
from hicache_storage.store import Store
from hicache_storage.keys import page_hashes
from hicache_storage.layers import IntegrityLayer

PAGE_SIZE = 4  # the tiny engine's page size
PROMPT = [int(t) for t in torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(8))]
CORRUPT_PAGE = 5  # a page in the middle: the pages before it still hit, the ones after cannot
STORAGE_TIMEOUT_S = 5.0


def serve_once(engine: Engine, tag: str) -> RequestResult:
    """L1 and L2 emptied first, so whatever is cached must come from L3."""
    engine.flush_cache()
    (result,) = engine.serve([Request(tag, PROMPT, 3)])
    return result


def same_outputs(want: RequestResult, have: RequestResult) -> bool:
    assert want.logits is not None and have.logits is not None
    return want.output_ids == have.output_ids and torch.equal(want.logits.view(torch.int32), have.logits.view(torch.int32))


def integrity_misses(integrity: IntegrityLayer) -> int:
    return sum(v for k, v in integrity.event_counts().items() if k.startswith("integrity_miss"))


def corrupt_page_file(root: Path, page_hash: str) -> None:
    """Flip one byte of the page's file behind the SDK, keeping its length (so it still 'exists')."""
    (path,) = [p for p in root.rglob(page_hash) if p.is_file()]
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_corrupted_page_is_rewritten_and_hits_again(tmp_path):
    with Engine(tiny_engine_config(CacheTiers.OFF, STORAGE_TIMEOUT_S)) as off:
        expected = off.serve([Request("off", PROMPT, 3)])[0]
    root = tmp_path / "kv"
    integrity = IntegrityLayer(create_backend("file", {"root": str(root)}))
    with Engine(tiny_engine_config(CacheTiers.L1_L2_L3, STORAGE_TIMEOUT_S), storage=integrity) as engine:
        assert same_outputs(expected, serve_once(engine, "warm"))
        healthy = serve_once(engine, "healthy")
        assert same_outputs(expected, healthy)
        assert healthy.cached_storage > (CORRUPT_PAGE + 1) * PAGE_SIZE, "the healthy run must read past the page to corrupt"
        engine.flush_cache()

        bad_hash = page_hashes(PROMPT[: (CORRUPT_PAGE + 1) * PAGE_SIZE], PAGE_SIZE)[CORRUPT_PAGE]
        corrupt_page_file(root, bad_hash)
        misses = integrity_misses(integrity)
        corrupted = serve_once(engine, "corrupted")
        assert same_outputs(expected, corrupted), "a corrupted page must be a miss, never served as KV"
        assert corrupted.cached_storage == CORRUPT_PAGE * PAGE_SIZE, "reads stop at the corrupted page"
        assert integrity_misses(integrity) > misses, "the corruption was not read"
        engine.drain()  # the backup that follows the recompute

        later = [serve_once(engine, f"later{n}") for n in range(2)]
        for result in later:
            assert same_outputs(expected, result)
        assert [r.cached_storage for r in later] == [healthy.cached_storage] * 2, (
            "the corrupted page stayed in L3: its hits never came back"
        )
        assert engine.controller.prefetcher is not None and bad_hash not in engine.controller.prefetcher.suspects


def test_suspect_pages_are_bounded_and_forgotten_once_rewritten():
    suspects = PageSet(capacity=3)
    suspects.add(["a", "b", "c", "d"])  # the oldest, "a", makes room
    assert [h in suspects for h in "abcd"] == [False, True, True, True]
    assert suspects.among(["x", "c", "b", "y"]) == [1, 2]
    suspects.forget(["b", "x"])
    assert len(suspects) == 2 and "b" not in suspects


def test_suspect_pages_from_many_threads_stay_within_capacity():
    suspects = PageSet(capacity=100)

    def churn(worker: int) -> None:
        for n in range(2000):
            suspects.add([f"{worker}-{n}"])
            suspects.forget([f"{worker}-{n - 1}"])
            suspects.among([f"{worker}-{n}", f"{worker}-{n - 2}"])

    threads = [threading.Thread(target=churn, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(suspects) <= 100
