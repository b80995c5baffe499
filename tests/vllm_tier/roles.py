"""Running a role of the vLLM tier: one process of its own (``engine_role.py``), its engines one after another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROLE = Path(__file__).with_name("engine_role.py")
#: Longest a role may take; a role that hangs fails its tests instead of the whole run.
ROLE_TIMEOUT_S = 900


def run_role(plan: dict[str, Any], workdir: Path, name: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one role process with ``plan``; its results, with its output tail on failure."""
    plan_path, result_path, log_path = (workdir / f"{name}.{ext}" for ext in ("plan.json", "result.json", "log"))
    plan_path.write_text(json.dumps(plan))
    full_env = {
        **os.environ,
        # the engine core runs in the role's process (one vLLM import for all its engines)
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # Mooncake clients listen on loopback only
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
        **(env or {}),
    }
    with log_path.open("w") as log:
        done = subprocess.run(
            [sys.executable, str(ROLE), str(plan_path), str(result_path)],
            stdout=log, stderr=subprocess.STDOUT, env=full_env, timeout=ROLE_TIMEOUT_S, check=False,
        )
    if done.returncode != 0 or not result_path.exists():
        tail = log_path.read_text()[-6000:]
        raise AssertionError(f"role {name} exited {done.returncode}; its output ends:\n{tail}")
    return json.loads(result_path.read_text())
