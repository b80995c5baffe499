"""Install the real servers and client packages the test suite uses, if they are missing.

``python -m hicache_storage.testing.install`` (called by ``scripts/setup.sh --services``). Each
server module provides ``ensure_installed()``; this runs them all, so no test spends its time
installing.
"""

from __future__ import annotations

import importlib

SERVER_MODULES = (
    "hicache_storage.testing.redis_server",
    "hicache_storage.testing.seaweedfs",
    "hicache_storage.testing.mooncake_master",
)


def main() -> None:
    for name in SERVER_MODULES:
        importlib.import_module(name).ensure_installed()


if __name__ == "__main__":
    main()
