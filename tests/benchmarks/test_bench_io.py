"""bench-io runs end to end and reports every path side by side (figures are not asserted: they drift)."""

import json
import subprocess
import sys

import pytest

from hicache_storage import Store, open_store
from hicache_storage.benchmarks.storage_io.measure import ratios, render_markdown, run_bench_io
from hicache_storage.benchmarks.storage_io.raw import MemoryRaw
from hicache_storage.connectors.memory import MemoryBackend


def test_bench_io_memory_reports_sdk_raw_and_layouts():
    with open_store({"backend": "memory"}) as store:
        result = run_bench_io(store, page_sizes=[4096], batch_sizes=[1, 8], bytes_per_case=64 * 4096, repeats=1)
    paths = {(m["op"], m["path"]) for m in result["measurements"]}
    assert {("put", "sdk zero-copy"), ("get", "sdk zero-copy"), ("put", "sdk copy"), ("get", "dict"), ("exists", "sdk")} <= paths
    assert len(ratios(result)) == 8  # put / overwrite / get / exists x two batch sizes
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
    assert {"put", "overwrite"} <= {r["op"] for r in data["ratios"]}
    assert (tmp_path / "bench-io-memory.md").read_text().startswith("## bench-io: `memory`")


def test_a_store_that_refuses_pages_gets_no_ratio():
    class Full(MemoryBackend):
        def _put_from(self, keys, sources):
            return [False] * len(keys)

    result = run_bench_io(Store(Full()), page_sizes=[4096], batch_sizes=[4], bytes_per_case=4 * 4096, repeats=1)
    puts = [m for m in result["measurements"] if m["op"] == "put" and m["path"].startswith("sdk")]
    assert puts and all(m["failed"] == 4 for m in puts)
    assert not [r for r in ratios(result) if r["op"] == "put"]


class WriteLog:
    """Every put call's names, classified when it arrives: all never written before in the run
    (fresh), or all stored right now (overwrite). ``mixed`` counts calls that were neither."""

    def __init__(self) -> None:
        self.ever_written: set = set()
        self.fresh: list[list] = []
        self.overwrites: list[list] = []
        self.mixed = 0

    def record(self, names: list, stored) -> None:
        if not self.ever_written.intersection(names):
            self.fresh.append(list(names))
        elif all(name in stored for name in names):
            self.overwrites.append(list(names))
        else:
            self.mixed += 1
        self.ever_written.update(names)


class LoggedMemory(MemoryBackend):
    """The memory connector, logging its puts and the most pages of each key part it held at once."""

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.log = WriteLog()
        self.peak_by_part: dict[str, int] = {}

    def _put_from(self, keys, sources):
        self.log.record(keys, self.page_table.pages)
        results = super()._put_from(keys, sources)
        for part in {k.scope.part for k in keys}:
            held = sum(1 for k in self.page_table.pages if k.scope.part == part)
            self.peak_by_part[part] = max(self.peak_by_part.get(part, 0), held)
        return results


class LoggedRaw(MemoryRaw):
    def __init__(self) -> None:
        super().__init__()
        self.log = WriteLog()
        self.peak = 0
        self.left_at_close = -1

    def put(self, names, pages) -> None:
        self.log.record(names, self.pages)
        super().put(names, pages)
        self.peak = max(self.peak, len(self.pages))

    def close(self) -> None:
        self.left_at_close = len(self.pages)
        super().close()


# Two page sizes x two batch sizes, 4 pages per pass in every case (8 in the layout comparison).
SMALL_RUN = dict(page_sizes=[4096, 8192], batch_sizes=[2, 4], bytes_per_case=4 * 4096, repeats=3)
CASES, PAGES, SDK_PATHS = 4, 4, 2


def pages_in(calls: list[list]) -> list:
    return [name for call in calls for name in call]


def test_every_put_pass_writes_fresh_keys_and_one_more_pass_overwrites():
    connector, raw = LoggedMemory(), LoggedRaw()
    with Store(connector) as store:
        result = run_bench_io(store, raw=raw, **SMALL_RUN)

    sdk_fresh = pages_in(connector.log.fresh)
    for log, fresh, paths in (
        (connector.log, [k for k in sdk_fresh if k.scope.part == "kv"], SDK_PATHS),
        (raw.log, pages_in(raw.log.fresh), 1),
    ):
        assert log.mixed == 0  # a put call is all fresh keys or all keys that exist
        assert len(fresh) == len(set(fresh)) == CASES * paths * SMALL_RUN["repeats"] * PAGES
        assert len(pages_in(log.overwrites)) == CASES * paths * PAGES  # one pass per case and path
    layout = [k for k in sdk_fresh if k.scope.part == "layout"]
    assert len(layout) == len(set(layout)) == 2 * 8  # page_first and layer_first, keys of their own

    ops = {(m["op"], m["path"]) for m in result["measurements"]}
    for path in ("sdk zero-copy", "sdk copy", "dict"):
        assert {("put", path), ("overwrite", path), ("get", path)} <= ops
    overwrites = [m for m in result["measurements"] if m["op"] == "overwrite"]
    assert len(overwrites) == CASES * (SDK_PATHS + 1) and not any(m["failed"] for m in overwrites)
    gets = [m for m in result["measurements"] if m["op"] == "get"]
    assert gets and not any(m["failed"] for m in gets)  # every get read keys that were written


def test_each_pass_is_deleted_before_the_next_and_nothing_is_left():
    connector, raw = LoggedMemory(), LoggedRaw()
    with Store(connector) as store:
        run_bench_io(store, raw=raw, **SMALL_RUN)
        assert not connector.page_table.pages
    assert connector.peak_by_part == {"kv": PAGES, "layout": 8}
    assert raw.peak == PAGES and raw.left_at_close == 0


def test_a_store_that_cannot_delete_keeps_its_passes_until_the_runs_clear():
    class NoDelete(LoggedMemory):
        capabilities = MemoryBackend.capabilities.replace(delete=False)

    connector = NoDelete()
    with Store(connector) as store:
        run_bench_io(store, raw=LoggedRaw(), **SMALL_RUN)
        assert not connector.page_table.pages
    assert connector.log.mixed == 0
    assert len(pages_in(connector.log.overwrites)) == CASES * SDK_PATHS * PAGES
    assert connector.peak_by_part["kv"] == CASES * SDK_PATHS * SMALL_RUN["repeats"] * PAGES


def test_the_report_shows_fresh_puts_and_overwrites_side_by_side():
    with open_store({"backend": "memory"}) as store:
        result = run_bench_io(store, page_sizes=[4096], batch_sizes=[4], bytes_per_case=4 * 4096, repeats=1)
    rows = [line.split("|")[1:3] for line in render_markdown(result).splitlines() if line.startswith("| ")]
    ops_by_path: dict[str, list[str]] = {}
    for op, path in rows:
        ops_by_path.setdefault(path.strip(), []).append(op.strip())
    assert ops_by_path["sdk zero-copy"][:2] == ["put", "overwrite"]  # adjacent rows
    assert ops_by_path["dict"][:2] == ["put", "overwrite"]
    assert {r["op"] for r in ratios(result)} == {"put", "overwrite", "get", "exists"}


def test_a_run_needs_at_least_one_pass():
    with open_store({"backend": "memory"}) as store, pytest.raises(ValueError, match="repeats must be at least 1"):
        run_bench_io(store, page_sizes=[4096], batch_sizes=[4], bytes_per_case=4 * 4096, repeats=0)


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
