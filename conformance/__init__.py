"""The conformance suite every connector runs: a pytest base class, a pytest plugin and a report.

``from hicache_storage.conformance import ConformanceTests`` and subclass it (see
:mod:`hicache_storage.conformance.suite`), or run ``hicache-storage conformance NAME``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ConformanceTests"]


def __getattr__(name: str) -> Any:
    # Imported on first use, after the plugin has registered the suite for assertion rewriting.
    if name == "ConformanceTests":
        from hicache_storage.conformance.suite import ConformanceTests

        return ConformanceTests
    raise AttributeError(name)
