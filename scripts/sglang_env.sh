#!/usr/bin/env bash
# Build (once) SGLang's own environment for tests/sglang_tier and print its python.
# Every pin lives in scripts/sglang-env.txt; the venv's name carries that file's hash, so a changed
# pin builds a new one. HICACHE_SGLANG_VENV overrides where it lives.
set -euo pipefail
cd "$(dirname "$0")/.."
pins=scripts/sglang-env.txt
sglang_version=0.5.23
digest=$(cat "$pins" "$0" | sha256sum | cut -c1-12)
venv=${HICACHE_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/hicache-storage/sglang-$sglang_version-$digest}
if [[ ! -x "$venv/.ready" ]]; then
    echo "building SGLang's environment in $venv (about 4 minutes, 6.5 GB)" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    pip="$venv/bin/python -m pip --disable-pip-version-check --quiet"
    # sglang itself without its dependency set (a GPU stack); what its cache code imports is pinned.
    $pip install --no-deps "sglang==$sglang_version"
    $pip install -r "$pins"
    printf '#!/bin/sh\n' > "$venv/.ready" && chmod +x "$venv/.ready"
fi
# This checkout's package, without its dependencies (the pins above carry what the tier needs).
"$venv/bin/python" -m pip --disable-pip-version-check --quiet install --no-deps -e . >&2
echo "$venv/bin/python"
