"""The vLLM tier: our connector inside a real vLLM 0.32 CPU engine, in vLLM's own environment.

Runs only in the environment ``scripts/vllm_env.sh`` builds (``scripts/test.sh`` runs it there);
the main test run does not collect this folder (tests/conftest.py). Engines run in processes of
their own (``engine_role.py``), one process per role, each running its engines one after another.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
