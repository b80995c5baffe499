#!/usr/bin/env bash
# The whole test suite on a fresh machine: install, start real servers on loopback (the pytest
# fixtures start and stop them), run every test. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --services
# pytest exits 5 when it collected no test: that is a failure here, never hidden.
exec python3 -m pytest "$@"
