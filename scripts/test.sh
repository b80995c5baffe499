#!/usr/bin/env bash
# The whole test suite on a fresh machine: install, start real servers on loopback (the pytest
# fixtures start and stop them), run every test. Extra arguments go to the main pytest run.
#   1. the main run, in this machine's python (tests/, except tests/sglang_tier);
#   2. the SGLang tier, in SGLang's own environment (scripts/sglang_env.sh): our adapter inside
#      SGLang 0.5.23's UnifiedRadixCache / HybridCacheController.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --services
sglang_python=$(bash scripts/sglang_env.sh)
# pytest exits 5 when it collected no test: that is a failure here, never hidden. Both runs go
# on whatever the other gives, and the command fails if either does.
status=0
python3 -m pytest "$@" || status=$?
HICACHE_SGLANG_TIER=1 "$sglang_python" -m pytest tests/sglang_tier --durations=5 || status=$((status ? status : $?))
exit "$status"
