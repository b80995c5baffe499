#!/usr/bin/env bash
# Build (once) vLLM's own environment for tests/vllm_tier and print its python.
# Every pin lives in scripts/vllm-env.txt; the venv's name carries that file's hash (and this
# script's), so a changed pin builds a new one. HICACHE_VLLM_VENV overrides where it lives.
set -euo pipefail
cd "$(dirname "$0")/.."
pins=scripts/vllm-env.txt
vllm_version=0.32.0
digest=$(cat "$pins" "$0" | sha256sum | cut -c1-12)
venv=${HICACHE_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/hicache-storage/vllm-$vllm_version-$digest}
if [[ ! -x "$venv/.ready" ]]; then
    echo "building vLLM's environment in $venv (about 2 minutes, 3.5 GB)" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    pip="$venv/bin/python -m pip --disable-pip-version-check --quiet"
    $pip install -r "$pins"
    # The registry's torchvision is a CUDA build that breaks `from transformers import LlamaConfig`
    # against the CPU torch; a text model needs none of these.
    $pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    printf '#!/bin/sh\n' > "$venv/.ready" && chmod +x "$venv/.ready"
fi
# This checkout's package, without its dependencies (the pins above carry what the tier needs).
"$venv/bin/python" -m pip --disable-pip-version-check --quiet install --no-deps -e . >&2
echo "$venv/bin/python"
