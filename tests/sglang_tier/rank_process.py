"""One rank of a multi-rank SGLang deployment, in a process of its own.

Some ranks reach SGLang's cache code only through ``torch.distributed``: the controller reads a
rank's attention-CP rank and size from its attention-CP process group
(``HiCacheController.get_attn_cp_rank_and_size``), and the tree and controller agree on hit
lengths and completions over that group (all-reduce MIN/MAX). So each rank runs here, in its own
process joined to a real gloo group, and every rank walks the same steps in the same order, as a
launched server's schedulers do:

1. a fresh engine restores the request from the store (which nothing has written yet);
2. a producer engine inserts it, fills its device KV with this rank's bytes, backs it up;
3. a fresh engine restores it.

Rank 0 runs in the test's own process (:func:`run_rank`), which has SGLang imported already;
every other rank as ``python rank_process.py SPEC.json RANK``; ``SPEC.json`` holds ``port``, ``world``,
``cases`` (name -> ``harness.Deployment`` fields, each case with its own store) and ``out`` (a
folder). The rank writes ``out/rank{RANK}.pt``: per case, the tokens each restore found, the
bytes it wrote and restored, and the key shard its adapter stored them under.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from harness import Deployment, Engine  # noqa: E402


def main(spec_path: str, rank: int) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.save(run_rank(spec, rank), Path(spec["out"]) / f"rank{rank}.pt")


def run_rank(spec: dict, rank: int) -> dict:
    """Join the group as ``rank`` and run every case; each case's results, by name."""
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec['port']}",
        rank=rank,
        world_size=spec["world"],
        timeout=timedelta(seconds=spec.get("timeout", 60)),
    )
    try:
        return {name: run_case(Deployment(**{**fields, "tp_rank": rank}), rank) for name, fields in spec["cases"].items()}
    finally:
        torch.distributed.destroy_process_group()


def run_case(deployment: Deployment, rank: int, pages: int = 6) -> dict:
    tokens = list(range(1, 1 + pages * deployment.page_size))
    opened: list[Engine] = []

    def engine() -> Engine:
        opened.append(Engine(deployment, attn_cp_group=torch.distributed.group.WORLD))
        return opened[-1]

    try:
        before, _ = engine().restore(tokens)
        producer = engine()
        leaf = producer.insert(tokens)
        written = producer.fill(producer.cache.path_device_indices(leaf), seed=100 + rank)
        producer.back_up(leaf)
        after, rows = engine().restore(tokens)
        shard = producer.adapter.scope.shard.token
        return {"before": before, "after": after, "tokens": len(tokens), "written": written, "restored": rows, "shard": shard}
    finally:
        for opened_engine in reversed(opened):  # each holds an override of SGLang's parallel context
            opened_engine.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
