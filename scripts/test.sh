#!/usr/bin/env bash
# The whole test suite on a fresh machine: install, start real servers on loopback (the pytest
# fixtures start and stop them), run every test. Extra arguments go to the main pytest run.
#   0. the type check: mypy over every package as installed (scripts/typecheck.py), once;
#   1. the main run, in this machine's python (tests/, except tests/sglang_tier and tests/vllm_tier);
#   2. the SGLang tier, in SGLang's own environment (scripts/sglang_env.sh): our adapter inside
#      SGLang 0.5.23's UnifiedRadixCache / HybridCacheController;
#   3. the vLLM tier, in vLLM's own environment (scripts/vllm_env.sh): our KV connector inside real
#      vLLM 0.32 CPU engines, writer and reader in separate processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --services
sglang_python=$(bash scripts/sglang_env.sh)
vllm_python=$(bash scripts/vllm_env.sh)
# pytest exits 5 when it collected no test: that is a failure here, never hidden. Every run goes
# on whatever the others give, and the command fails if any does (with the first failure's status).
status=0
python3 scripts/typecheck.py || status=$?
python3 -m pytest "$@" || status=$((status ? status : $?))
HICACHE_SGLANG_TIER=1 "$sglang_python" -m pytest tests/sglang_tier --durations=5 || status=$((status ? status : $?))
HICACHE_VLLM_TIER=1 "$vllm_python" -m pytest tests/vllm_tier --durations=5 || status=$((status ? status : $?))
exit "$status"
