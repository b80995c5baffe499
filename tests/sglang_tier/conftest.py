"""The SGLang tier: our adapter inside SGLang 0.5.23's own cache code, in SGLang's environment.

Runs only in the environment ``scripts/sglang_env.sh`` builds (``scripts/test.sh`` runs it there);
the main test run does not collect this folder (tests/conftest.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
