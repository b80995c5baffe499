"""bench-io runs end to end and reports every path side by side (figures are not asserted: they drift)."""

import json
import subprocess
import sys

import pytest

from hicache_storage import open_store
from hicache_storage.benchmarks.storage_io.measure import ratios, render_markdown, run_bench_io


def test_bench_io_memory_reports_sdk_raw_and_layouts():
    with open_store({"backend": "memory"}) as store:
        result = run_bench_io(store, page_sizes=[4096], batch_sizes=[1, 8], bytes_per_case=64 * 4096, repeats=1)
    paths = {(m["op"], m["path"]) for m in result["measurements"]}
    assert {("put", "sdk zero-copy"), ("get", "sdk zero-copy"), ("put", "sdk copy"), ("get", "dict"), ("exists", "sdk")} <= paths
    assert len(ratios(result)) == 6  # put / get / exists x two batch sizes
    assert [l["layout"] for l in result["layouts"]] == ["page_first", "layer_first"]
    assert result["layouts"][1]["segments_per_page"] == 64
    assert "SDK / raw" in render_markdown(result)


def test_bench_io_cli_writes_json_and_markdown(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "hicache_storage.cli", "bench-io", "memory", "--page-sizes", "4K", "--batch-sizes", "4",
         "--bytes-per-case", "64K", "--out", str(tmp_path)],
        check=True, capture_output=True, timeout=300,
    )
    data = json.loads((tmp_path / "bench-io-memory.json").read_text())
    assert data["backend"] == "memory" and data["ratios"]
    assert (tmp_path / "bench-io-memory.md").read_text().startswith("## bench-io: `memory`")


def test_a_store_that_refuses_pages_gets_no_ratio():
    from hicache_storage import Store
    from hicache_storage.connectors.memory import MemoryBackend

    class Full(MemoryBackend):
        def _put_from(self, keys, sources):
            return [False] * len(keys)

    result = run_bench_io(Store(Full()), page_sizes=[4096], batch_sizes=[4], bytes_per_case=4 * 4096, repeats=1)
    puts = [m for m in result["measurements"] if m["op"] == "put" and m["path"].startswith("sdk")]
    assert puts and all(m["failed"] == 4 for m in puts)
    assert not [r for r in ratios(result) if r["op"] == "put"]


@pytest.mark.services
def test_no_single_server_raw_client_for_a_cluster_given_by_startup_nodes(redis_cluster):
    """A config naming only startup nodes is a cluster (RedisConfig.is_cluster): the raw baseline
    must not talk to its first node as one server (keys on other slots would answer MOVED)."""
    from hicache_storage import Store
    from hicache_storage.benchmarks.storage_io.raw import make_raw
    from hicache_storage.connectors.redis import RedisBackend

    first, *others = redis_cluster.startup_nodes
    with Store(RedisBackend({"url": f"redis://{first}", "startup_nodes": others})) as store:
        assert make_raw(store) is None
