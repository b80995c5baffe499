"""Tensor parallelism: two ranks (processes, gloo) whose stores answer at different speeds make the
same cache decisions under every stop policy, never deadlock, and match the single-process output.
MLA: only rank 0 writes storage, both read it. A hybrid model (FULL + SWA + recurrent, with a
draft model) too: every pool's prefetch is agreed the same way. The runs that count what L3
restored read and write every page (``pinned_cost``); one run per model kind plans with the
default cost model, each rank on its own store's speeds, and the ranks still agree."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hicache_core.engine import CacheTiers, Engine, EngineConfig, make_conversations, serve_conversations

HELPERS = Path(__file__).resolve().parents[1] / "helpers"  # pinned_cost, imported by the ranks
#: The end of the names of the runs that plan with the default cost model: only their outputs and
#: the ranks' agreement are checked (what L3 restored depends on the speeds timed).
COST_MODEL = "cost-model"

WORKER = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from hicache_core.controller import ControllerConfig
    from hicache_core.prefetch import PrefetchConfig, StopPolicy
    from hicache_core.engine import CacheTiers, Engine, EngineConfig, Request, make_conversations, serve_conversations
    from hicache_core.hybrid.model import HybridModelConfig
    from hicache_core.model import ModelConfig
    from hicache_core.tp import TPContext
    from hicache_storage import create_backend
    from hicache_storage.cost import CostConfig
    from hicache_storage.layers.faults import FaultInjectionLayer
    from pinned_cost import LOAD_AND_STORE_EVERY_PAGE

    rank, world, (port, root, out, cost_model) = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:7]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tp = TPContext.from_torch_distributed()
    conversations = make_conversations(clients=2, rounds=3, turn_tokens=20, vocab_size=256, seed=21)
    delay = 0.001 if rank == 0 else 0.02  # the ranks' stores answer at very different speeds
    records = {}
    # Every page written and read where the test counts what L3 restored; the default cost model
    # (under the default stop policy) in the runs named after it.
    runs = [(kind, policy, LOAD_AND_STORE_EVERY_PAGE, "") for kind in ("mha", "mla", "hybrid") for policy in StopPolicy]
    runs += [(kind, StopPolicy.TIMEOUT, CostConfig(), f"-{cost_model}") for kind in ("mha", "hybrid")]
    for kind, policy, cost, suffix in runs:
        model = model_for(kind)
        name = f"{kind}-{policy.value}{suffix}"
        slow = {"latency_rate": 1.0, "latency_seconds": delay}
        backend = FaultInjectionLayer(create_backend("file", {"root": f"{root}/{name}"}), {"get": slow, "exists": slow})
        prefetch = PrefetchConfig(threshold_tokens=8, stop_policy=policy, timeout_base_s=60.0)
        controller = ControllerConfig(prefetch=prefetch, cost=cost)
        config = EngineConfig(model=model, tiers=CacheTiers.L1_L2_L3, page_size=4, device_pages=24, host_pages=24,
                              host_ratio=None, controller=controller, max_running=2, tp=tp)
        with Engine(config, storage=backend) as engine:
            rounds = serve_conversations(engine, conversations, 3)
            engine.flush_cache()
            last = [Request(f"again-{r.rid}", prompt, 3) for r, prompt in zip(rounds[-1], engine_prompts(rounds, conversations))]
            again = engine.serve(last)
            records[name] = {
                "results": [[r.rid, r.output_ids, r.cached_device, r.cached_host, r.cached_storage]
                            for rnd in rounds + [again] for r in rnd],
                "storage_backup_ops": engine.metrics.snapshot()["storage_backup_ops"],
            }
            if kind == "hybrid":
                records[name]["draft_ids"] = [r.draft_ids for rnd in rounds + [again] for r in rnd]
    json.dump(records, open(out, "w"))
    dist.destroy_process_group()
    """
)

PROMPTS = textwrap.dedent(
    """
    def model_for(kind):
        from hicache_core.hybrid.model import HybridModelConfig
        from hicache_core.model import ModelConfig

        if kind == "hybrid":
            return HybridModelConfig(vocab_size=256, hidden=32, q_heads=4, kv_heads=2, head_dim=8, ffn=64, window=8,
                                     state_dim=8, seed=4)
        mla = kind == "mla"
        return ModelConfig(vocab_size=256, hidden=32, layers=2, q_heads=4, kv_heads=1 if mla else 2, head_dim=8,
                           ffn=64, mla=mla, latent_dim=16, seed=4)

    def engine_prompts(rounds, conversations):
        histories = [[] for _ in conversations]
        prompts = []
        for r, results in enumerate(rounds):
            for c, result in enumerate(results):
                prompt = histories[c] + conversations[c][r]
                histories[c] = prompt + result.output_ids
                if r == len(rounds) - 1:
                    prompts.append(prompt)
        return prompts
    """
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_ranks_agree_under_every_stop_policy(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(PROMPTS + WORKER)
    port = free_port()
    outs = [tmp_path / f"rank{rank}.json" for rank in range(2)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HELPERS), os.environ.get("PYTHONPATH")]))}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), "2", str(port), str(tmp_path / "l3"), str(outs[rank]), COST_MODEL],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for rank in range(2)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=300)[0].decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, f"a rank failed (or deadlocked and was killed):\n{log[-4000:]}"
    rank0, rank1 = (json.loads(out.read_text()) for out in outs)
    kinds = ("mha", "mla", "hybrid")
    pinned = {f"{kind}-{policy}" for kind in kinds for policy in ("best_effort", "wait_complete", "timeout")}
    assert set(rank0) == pinned | {f"{kind}-timeout-{COST_MODEL}" for kind in ("mha", "hybrid")}
    for name in rank0:
        for field in ("results", "draft_ids"):
            assert rank0[name].get(field) == rank1[name].get(field), f"{name}: the ranks decided differently"
    # Outputs match a single-process run without any cache.
    namespace: dict = {}
    exec(PROMPTS, namespace)
    for kind in kinds:
        conversations = make_conversations(clients=2, rounds=3, turn_tokens=20, vocab_size=256, seed=21)
        with Engine(EngineConfig(model=namespace["model_for"](kind), tiers=CacheTiers.OFF, page_size=4, device_pages=24)) as engine:
            plain = [r for rnd in serve_conversations(engine, conversations, 3) for r in rnd]
        expected = [r.output_ids for r in plain]
        for name in (name for name in rank0 if name.startswith(f"{kind}-")):
            got = [entry[1] for entry in rank0[name]["results"]]
            assert got[: len(expected)] == expected, name
            assert got[len(expected) :] == expected[-2:], f"{name}: the flushed last round came back identical"
            if kind == "hybrid":
                drafts = rank0[name]["draft_ids"]
                assert drafts[: len(plain)] == [r.draft_ids for r in plain] and drafts[len(plain) :] == drafts[len(plain) - 2 : len(plain)]
    for kind in ("mha", "hybrid"):
        for policy in ("wait_complete", "timeout"):
            for rank in (rank0, rank1):
                restored = [entry[4] for entry in rank[f"{kind}-{policy}"]["results"][-2:]]
                assert sum(restored) > 0, f"{kind}: after the flush the last round is restored from L3"
    # MLA: KV is replicated, so only rank 0 writes; rank 1 still restores what rank 0 wrote.
    for policy in ("best_effort", "wait_complete", "timeout"):
        assert rank0[f"mla-{policy}"]["storage_backup_ops"] > 0
        assert rank1[f"mla-{policy}"]["storage_backup_ops"] == 0
    assert sum(entry[4] for entry in rank1["mla-wait_complete"]["results"][-2:]) > 0
