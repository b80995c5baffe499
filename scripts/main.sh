#!/usr/bin/env bash
# The main job on a fresh machine: install, then run the conformance suite on the embedded file
# connector (no services needed) and write its report under results/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
hicache-storage conformance file --config "{\"root\": \"$root\"}" --report-dir results/conformance
