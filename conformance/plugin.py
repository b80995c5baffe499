"""pytest plugin of the conformance suite, loaded through the ``pytest11`` entry point.

Adds the options that pick the backend for ``pytest --pyargs hicache_storage.conformance``, and
writes the report when ``--hicache-report`` is given. The options are checked once, before any
clause runs: a bad config, layer spec or unusable store is one usage error, not the same error
from every clause. A clause that fails on an exception that is neither an assertion nor a
``StorageError`` (a connector's bare ``ValueError``, ``KeyError``...) is marked so, and the report
names the failure an untyped error.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from hicache_storage.conformance.preflight import check_options, one_line
from hicache_storage.conformance.report import UNTYPED_ERROR, ReportCollector
from hicache_storage.errors import StorageError

pytest.register_assert_rewrite(
    "hicache_storage.conformance.suite",
    "hicache_storage.conformance.clauses",
    "hicache_storage.conformance.stateful",
    "hicache_storage.conformance.clauses_bytes",
    "hicache_storage.conformance.clauses_capabilities",
    "hicache_storage.conformance.clauses_concurrency",
    "hicache_storage.conformance.clauses_identity",
    "hicache_storage.conformance.pages",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hicache", "hicache-storage conformance suite")
    group.addoption("--hicache-backend", help="backend under test: a registered name or 'package.module:Class'")
    group.addoption("--hicache-config", help="backend config: a JSON object or @path to a json/toml/yaml file")
    group.addoption("--hicache-layers", help="layer specs to open the backend under, innermost first, as a JSON list")
    group.addoption("--hicache-report", metavar="STEM", help="write the report to STEM.json and STEM.md")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    backend = config.getoption("--hicache-backend", default=None)
    if backend:
        try:
            check_options(backend, config.getoption("--hicache-config"), config.getoption("--hicache-layers"))
        except StorageError as exc:
            raise pytest.UsageError(f"hicache-storage conformance: {one_line(str(exc))}") from None
    stem = config.getoption("--hicache-report", default=None)
    if stem:
        config.pluginmanager.register(ReportCollector(config, stem), "hicache-conformance-report")




@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    error = call.excinfo.value if call.excinfo is not None else None
    # pytest's own outcomes (fail, skip) are BaseExceptions, not Exceptions
    if isinstance(error, Exception) and not isinstance(error, (AssertionError, StorageError)):
        from hicache_storage.conformance.suite import ConformanceTests

        if isinstance(getattr(item, "instance", None), ConformanceTests):
            outcome.get_result().user_properties.append((UNTYPED_ERROR, type(error).__name__))
