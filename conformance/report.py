"""The conformance report a vendor can publish: every clause passed, failed, skipped or unsupported.

A skip whose reason starts with ``unsupported:`` is a capability the backend does not declare
(the suite checked that the operation is refused properly); any other skip is listed with its
reason. A clause that failed on an exception that is neither an assertion nor a ``StorageError``
says so first: ``untyped error: the store raised KeyError, not a StorageError: ...``. A run in
which no clause executed is reported as a failure, never as a pass.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

OUTCOMES = ("passed", "failed", "error", "unsupported", "skipped")
#: The ``user_properties`` entry of a clause that failed on an untyped error: (name, exception
#: class), added by the plugin (:mod:`~hicache_storage.conformance.plugin`).
UNTYPED_ERROR = "untyped_error"


@dataclass
class ClauseResult:
    clause: str
    outcome: str
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Report:
    backend: str
    config: dict[str, Any]
    capabilities: dict[str, Any] | None
    started: str
    environment: dict[str, str]
    results: list[ClauseResult] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        counted = Counter(result.outcome for result in self.results)
        return {outcome: counted.get(outcome, 0) for outcome in OUTCOMES}

    @property
    def ok(self) -> bool:
        counts = self.counts
        return counts["passed"] > 0 and counts["failed"] == 0 and counts["error"] == 0

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "counts": self.counts, "ok": self.ok}, indent=2, sort_keys=True)

    def to_markdown(self) -> str:
        counts = self.counts
        verdict = "PASS" if self.ok else ("NO CLAUSE EXECUTED" if not counts["passed"] else "FAIL")
        lines = [
            f"# Conformance report: `{self.backend}`",
            "",
            f"**{verdict}**: " + ", ".join(f"{n} {outcome}" for outcome, n in counts.items()),
            "",
            f"- started: {self.started}",
            f"- environment: {', '.join(f'{k} {v}' for k, v in self.environment.items())}",
            f"- config: `{json.dumps(self.config, sort_keys=True)}`",
        ]
        if self.capabilities is not None:
            declared = [name for name, value in self.capabilities.items() if value not in (False, None)]
            lines.append(
                "- declared capabilities: "
                + ", ".join(f"{n}={self.capabilities[n]}" if self.capabilities[n] is not True else n for n in declared)
            )
        lines += ["", "| clause | outcome | detail |", "|---|---|---|"]
        for result in sorted(self.results, key=lambda r: r.clause):
            detail = result.detail.replace("|", "\\|").replace("\n", " ")[:300]
            lines.append(f"| `{result.clause}` | {result.outcome} | {detail} |")
        return "\n".join(lines) + "\n"


class ReportCollector:
    """pytest plugin object: records each clause's outcome and writes the report at the end."""

    def __init__(self, config: pytest.Config, stem: str) -> None:
        self.config = config
        self.stem = Path(stem)
        self.results: dict[str, ClauseResult] = {}
        self.started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        clause = report.nodeid.rsplit("::", 1)[-1]
        if report.when == "call" or report.outcome != "passed":
            if report.skipped:
                reason = _skip_reason(report)
                outcome = "unsupported" if reason.startswith("unsupported:") else "skipped"
                self.results[clause] = ClauseResult(clause, outcome, reason, report.duration)
            elif report.failed:
                outcome = "failed" if report.when == "call" else "error"
                message = getattr(report.longrepr, "reprcrash", None)
                detail = message.message if message is not None else str(report.longrepr)[-300:]
                untyped = dict(report.user_properties).get(UNTYPED_ERROR)
                if untyped:
                    detail = f"untyped error: the store raised {untyped}, not a StorageError: {detail}"
                self.results[clause] = ClauseResult(clause, outcome, detail, report.duration)
            elif clause not in self.results:
                self.results[clause] = ClauseResult(clause, "passed", "", report.duration)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        report = self.build()
        self.stem.parent.mkdir(parents=True, exist_ok=True)
        self.stem.parent.joinpath(f"{self.stem.name}.json").write_text(report.to_json())
        self.stem.parent.joinpath(f"{self.stem.name}.md").write_text(report.to_markdown())

    def build(self) -> Report:
        name = self.config.getoption("--hicache-backend") or "(unset)"
        config, capabilities = _describe_backend(name, self.config.getoption("--hicache-config"))
        layers = self.config.getoption("--hicache-layers")
        environment = {
            "python": platform.python_version(),
            "platform": platform.platform(terse=True),
            "hicache-storage": _version(),
        }
        if layers:
            environment["layers"] = layers
        return Report(name, config, capabilities, self.started, environment, list(self.results.values()))


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _describe_backend(name: str, raw_config: str | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The config with secrets masked, and the capabilities an instance with that config declares."""
    try:
        from hicache_storage.registry import create_backend

        connector = create_backend(name, raw_config)
        try:
            return connector.config.public_dict(), connector.capabilities.as_dict()
        finally:
            connector.close()
    except Exception as exc:  # the report must still be written when the backend cannot load
        return {"error": f"{type(exc).__name__}: {exc}"}, None


def _version() -> str:
    from hicache_storage import __version__

    return __version__
