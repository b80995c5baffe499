#!/usr/bin/env bash
# The main job on a fresh machine: install, then run the multi-turn benchmark (L1 vs L1+L2 vs
# L1+L2+L3) on the embedded default backend (the file connector in a temporary directory; no
# services needed). Writes results/bench.{json,md,png}. Extra arguments go to `hicache-storage bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec hicache-storage bench --out results "$@"
