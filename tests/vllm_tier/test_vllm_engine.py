"""Our connector as the L3 of a real vLLM engine: writer and reader engines in separate processes.

The writer process makes a tiny Llama, runs it without L3 (the reference outputs), then once per
store with our connector, which saves every block its requests complete. The reader process (a
new process: nothing in memory carries over) runs the same prompts, and follow-up prompts that
extend the writer's prompts with the writer's own generated tokens, once per store, and checks
what it loaded from L3 and that its greedy outputs equal the reference. Corrupted pages, a
failing store and a hanging store run in the reader process too. Every check reads vLLM's own
outputs and our connector's per-request report (``kv_transfer_params``).

The same two processes run the secondary-tier route too: vLLM's ``OffloadingConnector`` with our
``HiCacheStorageTier`` behind its CPU primary tier (the writer's engine cascades to four stores at
once; each reader engine is a new engine, with an empty primary tier, on one of them), its
worker on the CPU the stand-in of ``cpu_offload.py``.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from engine_role import BLOCK_SIZE
from roles import run_role

from hicache_storage.testing.connector_configs import CONFIGS

# A role runs several engines; on a loaded 2-core machine a module's setup can pass pytest's default 600 s.
pytestmark = [pytest.mark.services, pytest.mark.timeout(1800)]

CONNECTORS = ("file", "redis", "mooncake")
PROMPT_TOKENS = 280  # 8 full blocks and a partial one
OUTPUT_TOKENS = 24  # the writer's last computed block holds generated tokens
QUESTION_TOKENS = 40
VOCAB = 512

_rng = random.Random(26)


def _prompts(count: int, length: int) -> list[list[int]]:
    return [[_rng.randrange(2, VOCAB) for _ in range(length)] for _ in range(count)]


#: Prompts repeated as they are, and prompts whose follow-up turn carries the writer's answer.
REPEATED = _prompts(3, PROMPT_TOKENS)
FIRST_TURNS = _prompts(3, PROMPT_TOKENS)
QUESTIONS = _prompts(3, QUESTION_TOKENS)


def _batches(*names: str, followups: list[list[int]] | None = None) -> list[dict[str, Any]]:
    prompts = {"repeated": REPEATED, "first_turns": FIRST_TURNS, "followups": followups}
    return [{"name": name, "prompts": prompts[name]} for name in names]


def _engine(name: str, kv: dict[str, Any] | None, batches: list[dict[str, Any]], tp: int = 1) -> dict[str, Any]:
    return {"name": name, "kv": kv, "tp": tp, "max_tokens": OUTPUT_TOKENS, "batches": batches}


def _full_blocks(tokens: int) -> int:
    return tokens // BLOCK_SIZE


def _corrupt_pages(root: Path, every: int) -> int:
    """Overwrite the middle half of every ``every``-th page file under ``root`` with a constant
    pattern (each float32 about 10.0); returns how many pages were corrupted."""
    pages = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "namespace.json" and ".tmp" not in p.parts)
    corrupted = 0
    for page in pages[::every]:
        data = bytearray(page.read_bytes())
        quarter = len(data) // 4
        data[quarter : 3 * quarter] = b"\x20\x41" * (quarter)
        page.write_bytes(bytes(data))
        corrupted += 1
    return corrupted


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory, redis_server: Any, mooncake_master: Any) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-tier")
    servers = {"redis_server": redis_server, "mooncake_master": mooncake_master}
    stores = {name: {"connector": name, "connector_config": CONFIGS[name].config(servers, work, "vllm")} for name in CONNECTORS}
    integrity_root = work / "file-integrity"
    stores["file-integrity"] = {
        "connector": "file",
        "connector_config": {"root": str(integrity_root)},
        "layers": [{"kind": "integrity"}],
    }
    model = str(work / "tiny-llama")
    # The secondary-tier route: its own file stores; redis and mooncake the KV connector's very
    # stores (their namespaces keep the two routes' pages apart).
    tier_stores = {
        "file": {"connector": "file", "connector_config": {"root": str(work / "tier-file")}},
        "file-integrity": {"connector": "file", "connector_config": {"root": str(work / "tier-integrity")}, "layers": [{"kind": "integrity"}]},
        "redis": stores["redis"],
        "mooncake": stores["mooncake"],
    }

    written = run_role(
        {
            "model": model,
            "make_model": {},
            "engines": [_engine("reference", None, _batches("repeated", "first_turns"))]
            + [_engine(f"write-{name}", kv, _batches("repeated", "first_turns")) for name, kv in stores.items()]
            + [{**_engine("fail-policy", stores["file"], []), "transfer": {"kv_load_failure_policy": "fail"}}]
            + [_tier_engine("write-tier", *tier_stores.values())],
        },
        work,
        "writer",
    )["engines"]
    reference = written["reference"]
    assert "error" not in reference, reference.get("error")
    followups = [p + out["tokens"] + q for p, out, q in zip(FIRST_TURNS, reference["batches"]["first_turns"], QUESTIONS)]

    # A copy of the plain file store with pages corrupted, and the integrity store's pages corrupted alike.
    file_root = Path(stores["file"]["connector_config"]["root"])
    corrupt_root = work / "file-corrupt"
    shutil.copytree(file_root, corrupt_root)
    corrupted = {"file-corrupt": _corrupt_pages(corrupt_root, 3), "file-integrity": _corrupt_pages(integrity_root, 3)}
    tier_corrupt_root = work / "tier-file-corrupt"
    shutil.copytree(work / "tier-file", tier_corrupt_root)
    corrupted["tier-file-corrupt"] = _corrupt_pages(tier_corrupt_root, 3)
    corrupted["tier-file-integrity"] = _corrupt_pages(work / "tier-integrity", 3)
    tier_readers = {
        **{name: tier_stores[name] for name in CONNECTORS + ("file-integrity",)},
        "file-corrupt": {"connector": "file", "connector_config": {"root": str(tier_corrupt_root)}},
        "file-empty": {"connector": "file", "connector_config": {"root": str(work / "tier-empty")}},
    }
    failing = {
        "kind": "faults",
        **{op: {"error_rate": 1.0, "errors": ["unavailable"]} for op in ("exists", "get", "put")},
    }
    hanging = {"kind": "faults", "get": {"hang_rate": 1.0, "hang_seconds": 10.0}, "put": {"hang_rate": 1.0, "hang_seconds": 10.0}}
    file_config = stores["file"]["connector_config"]
    readers = {
        **{name: stores[name] for name in CONNECTORS},
        "file-integrity": stores["file-integrity"],
        "file-corrupt": {"connector": "file", "connector_config": {"root": str(corrupt_root)}},
        "failing-store": {"connector": "file", "connector_config": file_config, "layers": [failing]},
        "hanging-reads": {"connector": "file", "connector_config": file_config, "layers": [hanging], "timeout_s": 1.0},
    }
    read = run_role(
        {
            "model": model,
            "engines": [_engine("reference-followups", None, _batches("followups", followups=followups))]
            + [_engine(f"read-{name}", kv, _batches("repeated", "followups", followups=followups)) for name, kv in readers.items()]
            + [_tier_engine(f"read-tier-{name}", store) for name, store in tier_readers.items()],
        },
        work,
        "reader",
    )["engines"]
    return {"written": written, "read": read, "followups": followups, "corrupted": corrupted}


def _engine_result(results: dict[str, Any], name: str) -> dict[str, Any]:
    result = results[name]
    assert "error" not in result, f"engine {name} failed:\n{result['error']}"
    return result


def _tokens(result: dict[str, Any], batch: str) -> list[list[int]]:
    return [out["tokens"] for out in result["batches"][batch]]


def _reference(tier: dict[str, Any], batch: str) -> list[list[int]]:
    if batch == "followups":
        return _tokens(_engine_result(tier["read"], "reference-followups"), batch)
    return _tokens(_engine_result(tier["written"], "reference"), batch)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_writer_stores_what_it_computes(tier: dict[str, Any], connector: str) -> None:
    writer = _engine_result(tier["written"], f"write-{connector}")
    for batch in ("repeated", "first_turns"):
        assert _tokens(writer, batch) == _reference(tier, batch)
        for out in writer["batches"][batch]:
            assert out["report"]["external_tokens"] == 0, "the writer's store started empty"
    # every request's computed full blocks: its prompt's and the generated tokens' (all but the last token computed)
    handed_out = sum(out["report"]["saved_blocks"] for batch in writer["batches"].values() for out in batch)
    assert handed_out == 6 * _full_blocks(PROMPT_TOKENS + OUTPUT_TOKENS - 1)
    assert writer["counts"]["worker"]["blocks_stored"] == handed_out


def test_load_failure_policy_must_be_recompute(tier: dict[str, Any]) -> None:
    """vLLM's default policy would fail a request whose page turned bad after its lookup; the
    connector refuses it at start, saying what to set."""
    error = tier["written"]["fail-policy"].get("error", "")
    assert "kv_load_failure_policy" in error and '"recompute"' in error, error[-2000:]


@pytest.mark.parametrize("connector", CONNECTORS)
def test_reader_loads_repeated_prompts_from_l3(tier: dict[str, Any], connector: str) -> None:
    reader = _engine_result(tier["read"], f"read-{connector}")
    assert _tokens(reader, "repeated") == _reference(tier, "repeated")
    for out in reader["batches"]["repeated"]:
        report = out["report"]
        assert report["local_tokens"] == 0
        assert report["loaded_tokens"] >= 0.9 * _full_blocks(PROMPT_TOKENS) * BLOCK_SIZE, report
        assert report["failed_blocks"] == 0
        assert out["num_cached_tokens"] == report["loaded_tokens"]


@pytest.mark.parametrize("connector", CONNECTORS)
def test_reader_loads_blocks_of_generated_tokens(tier: dict[str, Any], connector: str) -> None:
    """A follow-up turn (prompt, the writer's answer, a new question) loads the blocks that hold
    the writer's generated tokens too, and answers as the reference does."""
    reader = _engine_result(tier["read"], f"read-{connector}")
    assert _tokens(reader, "followups") == _reference(tier, "followups")
    written_blocks = _full_blocks(PROMPT_TOKENS + OUTPUT_TOKENS - 1)
    assert written_blocks > _full_blocks(PROMPT_TOKENS)
    for out in reader["batches"]["followups"]:
        report = out["report"]
        assert report["loaded_tokens"] >= 0.9 * written_blocks * BLOCK_SIZE, report
        assert report["loaded_tokens"] > _full_blocks(PROMPT_TOKENS) * BLOCK_SIZE, report


def test_corrupted_pages_under_integrity_are_misses(tier: dict[str, Any]) -> None:
    """Pages corrupted on disk fail the integrity layer's check: vLLM recomputes from the first bad
    block, and every output stays equal to the reference."""
    assert tier["corrupted"]["file-integrity"] > 0
    reader = _engine_result(tier["read"], "read-file-integrity")
    failed = 0
    for batch in ("repeated", "followups"):
        assert _tokens(reader, batch) == _reference(tier, batch)
        failed += sum(out["report"]["failed_blocks"] for out in reader["batches"][batch])
    assert failed > 0, "no corrupted page was read: the test proves nothing"
    assert reader["counts"]["worker_stats"]["integrity_miss_checksum"] > 0
    # blocks before the first bad one still came from L3
    assert any(out["report"]["loaded_tokens"] > 0 for out in reader["batches"]["repeated"])


def test_corrupted_pages_without_integrity_change_outputs(tier: dict[str, Any]) -> None:
    """The same corruption without the integrity layer is loaded as if it were good, and the
    outputs change: what the reader loads from L3 is what its model attends to."""
    assert tier["corrupted"]["file-corrupt"] > 0
    reader = _engine_result(tier["read"], "read-file-corrupt")
    assert sum(out["report"]["failed_blocks"] for out in reader["batches"]["repeated"]) == 0
    assert _tokens(reader, "repeated") != _reference(tier, "repeated")


def test_failing_store_degrades_to_recompute(tier: dict[str, Any]) -> None:
    """Every store call fails (temporarily): lookups find nothing, the breaker opens, and vLLM
    computes everything, with the reference's outputs."""
    reader = _engine_result(tier["read"], "read-failing-store")
    for batch in ("repeated", "followups"):
        assert _tokens(reader, batch) == _reference(tier, batch)
        assert all(out["report"]["external_tokens"] == 0 for out in reader["batches"][batch])
    assert reader["counts"]["scheduler_store"]["breaker_opened"] >= 1
    assert reader["counts"]["scheduler_store"].get("skipped_exists", 0) >= 1


def test_hanging_reads_degrade_to_recompute(tier: dict[str, Any]) -> None:
    """Lookups answer but every read hangs: each load times out, its blocks are recomputed, and
    the outputs equal the reference's."""
    reader = _engine_result(tier["read"], "read-hanging-reads")
    for batch in ("repeated", "followups"):
        assert _tokens(reader, batch) == _reference(tier, batch)
    outs = reader["batches"]["repeated"]
    assert all(out["report"]["external_tokens"] > 0 for out in outs), "lookups should find the pages"
    assert all(out["report"]["loaded_tokens"] == 0 for out in outs)
    worker = reader["counts"]["worker_store"]
    assert worker.get("failed_get", 0) + worker.get("skipped_get", 0) >= len(outs)


# --- the secondary-tier route: HiCacheStorageTier behind vLLM's CPU offloading ----------------------

#: vLLM's CPU primary tier: 64 rows of one block (4 layers x 32 KiB in float32)
TIER_CPU_BYTES = 8 << 20
#: Full blocks of the repeated prompts: vLLM offloads prompt blocks only (offload_prompt_only)
TIER_ROWS = len(REPEATED) * (PROMPT_TOKENS // BLOCK_SIZE)


def _tier_engine(name: str, *stores: dict[str, Any]) -> dict[str, Any]:
    """An engine with vLLM's OffloadingConnector and one HiCacheStorageTier per store. On a GPU the
    spec is vLLM's own "TieringOffloadingSpec"; here its subclass whose worker copies in host
    memory (cpu_offload.py), since vLLM's refuses the CPU platform."""
    offload = {
        "spec_name": "CpuTieringOffloadingSpec",
        "spec_module_path": "cpu_offload",
        "cpu_bytes_to_use": TIER_CPU_BYTES,
        "secondary_tiers": [{"type": "HiCacheStorageTier", "module_path": "hicache_storage.vllm.tier", **store} for store in stores],
    }
    return {"name": name, "kv": None, "offload": offload, "max_tokens": OUTPUT_TOKENS, "batches": _batches("repeated")}


def _tier_counts(result: dict[str, Any], index: int = 0) -> dict[str, int]:
    return result["tiers"][index]["tier"]


def _assert_loaded_from_l3(reader: dict[str, Any]) -> None:
    """Each repeated prompt's full blocks came from the store: the reader is a new engine, whose
    prefix cache and CPU primary tier start empty, so every cached token was promoted from L3."""
    for out in reader["batches"]["repeated"]:
        assert out["num_cached_tokens"] >= 0.9 * _full_blocks(PROMPT_TOKENS) * BLOCK_SIZE, out["num_cached_tokens"]
    assert _tier_counts(reader).get("rows_loaded", 0) >= 0.9 * TIER_ROWS, _tier_counts(reader)


def test_tier_writer_cascades_to_every_tier(tier: dict[str, Any]) -> None:
    """vLLM cascades each block its CPU primary tier stores to every secondary tier: each of the
    writer's four tiers (file, file + integrity, redis, mooncake) stored every full prompt block."""
    writer = _engine_result(tier["written"], "write-tier")
    assert _tokens(writer, "repeated") == _reference(tier, "repeated")
    assert all(out["num_cached_tokens"] == 0 for out in writer["batches"]["repeated"])
    assert len(writer["tiers"]) == 4
    for counts in writer["tiers"]:
        assert counts["tier"].get("rows_stored") == TIER_ROWS, counts
        assert counts["tier"].get("rows_not_stored", 0) == 0, counts


@pytest.mark.parametrize("connector", CONNECTORS)
def test_tier_reader_loads_repeated_prompts_from_l3(tier: dict[str, Any], connector: str) -> None:
    reader = _engine_result(tier["read"], f"read-tier-{connector}")
    assert _tokens(reader, "repeated") == _reference(tier, "repeated")
    _assert_loaded_from_l3(reader)
    assert _tier_counts(reader).get("rows_failed_to_load", 0) == 0


def test_tier_reader_with_the_store_emptied_loads_nothing(tier: dict[str, Any]) -> None:
    """On an empty store the same reader computes everything, with the same outputs, and the check
    that the blocks came from L3 fails: what the other readers pass is not vLLM's own cache."""
    reader = _engine_result(tier["read"], "read-tier-file-empty")
    assert _tokens(reader, "repeated") == _reference(tier, "repeated")
    assert all(out["num_cached_tokens"] == 0 for out in reader["batches"]["repeated"])
    assert _tier_counts(reader).get("rows_found", 0) == 0
    with pytest.raises(AssertionError):
        _assert_loaded_from_l3(reader)


def test_tier_corrupted_rows_under_integrity_are_misses(tier: dict[str, Any]) -> None:
    """Rows corrupted on disk fail the integrity check when promoted: vLLM frees their slots and
    computes them (outputs equal the reference), the rows before the first bad one still come from
    L3, and the recomputed rows are written again."""
    assert tier["corrupted"]["tier-file-integrity"] > 0
    reader = _engine_result(tier["read"], "read-tier-file-integrity")
    assert _tokens(reader, "repeated") == _reference(tier, "repeated")
    counts = _tier_counts(reader)
    assert counts.get("rows_failed_to_load", 0) > 0, counts
    assert counts.get("rows_loaded", 0) > 0, counts
    assert reader["tiers"][0]["stats"].get("integrity_miss_checksum", 0) > 0
    assert counts.get("rows_stored", 0) >= counts["rows_failed_to_load"], counts


def test_tier_corrupted_rows_without_integrity_change_outputs(tier: dict[str, Any]) -> None:
    """The same corruption without the integrity layer loads as if it were good and the outputs
    change: the reader's model attends to the rows the tier promoted."""
    assert tier["corrupted"]["tier-file-corrupt"] > 0
    reader = _engine_result(tier["read"], "read-tier-file-corrupt")
    assert _tier_counts(reader).get("rows_failed_to_load", 0) == 0
    assert _tier_counts(reader).get("rows_loaded", 0) == TIER_ROWS
    assert _tokens(reader, "repeated") != _reference(tier, "repeated")


# --- TP = 2 --------------------------------------------------------------------------------------

TP2_PROMPTS = REPEATED[:2]
TP2_OUTPUT_TOKENS = 8


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A TP-2 writer engine, then a TP-2 reader engine with new worker processes (vLLM's
    multiprocessing executor), in a role process of their own: each rank a CPU core."""
    work = tmp_path_factory.mktemp("vllm-tp2")
    root = work / "file-tp2"
    kv = {"connector": "file", "connector_config": {"root": str(root)}}
    batches = [{"name": "repeated", "prompts": TP2_PROMPTS}]
    engines = [
        {"name": f"{role}-tp2", "kv": kv, "tp": 2, "max_tokens": TP2_OUTPUT_TOKENS, "batches": batches}
        for role in ("write", "read")
    ]
    results = run_role(
        {"model": str(work / "tiny-llama"), "make_model": {}, "engines": engines},
        work,
        "tp2",
        # vLLM's CPU workers bind their threads per NUMA node unless told which cores to take
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )["engines"]
    return {"results": results, "root": root}


def test_tp2_each_rank_restores_its_own_shard(tp2: dict[str, Any]) -> None:
    """At TP 2 each rank stores and loads its own heads (its own shard of every page): the reader
    loads every full block of each prompt and answers as the writer did (TP 2 numerics)."""
    writer = _engine_result(tp2["results"], "write-tp2")
    reader = _engine_result(tp2["results"], "read-tp2")
    assert all(out["report"]["external_tokens"] == 0 for out in writer["batches"]["repeated"])
    blocks = _full_blocks(PROMPT_TOKENS + TP2_OUTPUT_TOKENS - 1)
    shards = {
        rank: [p for p in tp2["root"].rglob("*") if p.is_file() and any(part.startswith(f"tp{rank}of2-") for part in p.parts)]
        for rank in (0, 1)
    }
    assert len(shards[0]) == len(shards[1]) == len(TP2_PROMPTS) * blocks
    assert _tokens(reader, "repeated") == _tokens(writer, "repeated")
    for out in reader["batches"]["repeated"]:
        assert out["report"]["loaded_tokens"] >= 0.9 * _full_blocks(PROMPT_TOKENS) * BLOCK_SIZE, out["report"]
        assert out["report"]["failed_blocks"] == 0
