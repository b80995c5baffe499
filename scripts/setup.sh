#!/usr/bin/env bash
# Install what the project needs on a fresh machine (Debian/Ubuntu, Python >= 3.10, root or sudo).
#   scripts/setup.sh            python packages only (enough for the main job)
#   scripts/setup.sh --services also the real servers the connector tests start (Redis, SeaweedFS,
#                               Mooncake master) and the sglang package for the interop tests
set -euo pipefail
cd "$(dirname "$0")/.."

PIP="python3 -m pip"
# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build.
python3 -c "import torch" 2>/dev/null || $PIP install --quiet torch==2.13.0
$PIP install --quiet -e '.[all,dev]'

if [[ "${1:-}" == "--services" ]]; then
    python3 -m hicache_storage.testing.install
fi
