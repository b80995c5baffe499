#!/usr/bin/env bash
# Install what the project needs on a fresh machine (Debian/Ubuntu, Python >= 3.10, root or sudo).
#   scripts/setup.sh            python packages only (enough for the main job)
#   scripts/setup.sh --services also the real servers the connector tests start (Redis, SeaweedFS,
#                               Mooncake master) and sglang for the interoperability tests
set -euo pipefail
cd "$(dirname "$0")/.."

PIP="python3 -m pip --disable-pip-version-check"
# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build.
python3 -c "import torch" 2>/dev/null || $PIP install --quiet torch==2.13.0
$PIP install --quiet -c scripts/constraints.txt -e '.[all,dev]'

if [[ "${1:-}" == "--services" ]]; then
    # sglang without its GPU stack: the package itself, then only what its storage interface,
    # host pool and radix tree modules import (see docs/sglang.md).
    # sglang compiles its page-hash C++ extension on first use.
    missing=$(for p in g++ ninja-build libssl-dev; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
    if [[ -n "$missing" ]]; then
        apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing
    fi
    if ! python3 -c "import sglang" 2>/dev/null; then
        $PIP install --quiet --no-deps sglang==0.5.23
        $PIP install --quiet -c scripts/constraints.txt numpy orjson psutil pybase64 requests triton packaging \
            pillow starlette msgspec pydantic pyzmq tqdm ipython aiohttp transformers dill
    fi
    python3 -m hicache_storage.testing.install
fi
