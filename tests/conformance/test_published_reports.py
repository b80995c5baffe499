"""The published conformance reports (docs/reports/conformance/, written by
scripts/conformance_reports.py) are whole: one per reported configuration, each describing the
connector it ran (its config and declared capabilities, not an error from describing it), each
passing. A report whose description failed still lists its clauses, so only this test notices."""

import json
from pathlib import Path

import pytest

from hicache_storage.testing.connector_configs import REPORTED

REPORTS = Path(__file__).resolve().parents[2] / "docs" / "reports" / "conformance"


def test_every_reported_configuration_has_its_report():
    assert sorted(path.stem for path in REPORTS.glob("*.json")) == sorted(REPORTED)


@pytest.mark.parametrize("name", sorted(REPORTED))
def test_a_report_describes_the_connector_it_ran(name):
    report = json.loads((REPORTS / f"{name}.json").read_text())
    assert "error" not in report["config"], f"{name}.json: describing the connector failed: {report['config']['error']}"
    assert report["capabilities"], f"{name}.json declares no capabilities"
    assert report["ok"] and report["counts"]["passed"] > 0, f"{name}.json is not a passing run: {report['counts']}"
    assert (REPORTS / f"{name}.md").exists()
