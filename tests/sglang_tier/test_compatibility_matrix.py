"""docs/sglang.md's compatibility matrix names a test for every cell that says "works": each of
those tests must exist in this tier and be collected in this run, so the table cannot claim what
no test proves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "sglang.md"


def matrix_rows() -> list[tuple[str, list[str]]]:
    text = DOC.read_text()
    start = text.index("| model family", text.index("### Compatibility with SGLang"))
    table = text[start : text.index("\n\n", start)]
    rows = []
    for line in table.splitlines()[2:]:
        status = line.rstrip("|").split("|")[-1].strip()
        rows.append((status, re.findall(r"`(test_\w+\.py::test_\w+)`", status)))
    return rows


def test_every_works_cell_names_a_test_of_this_tier(request: pytest.FixtureRequest) -> None:
    rows = matrix_rows()
    assert len(rows) >= 10, "the matrix lost rows"
    collected = {f"{Path(item.fspath).name}::{item.originalname}" for item in request.session.items}
    for status, tests in rows:
        if status.startswith("works"):
            assert tests, f"a 'works' cell names no test: {status}"
            missing = [name for name in tests if name not in collected]
            assert not missing, f"docs/sglang.md names tests this run did not collect: {missing}"
        else:
            assert status.startswith(("refused by SGLang", "not yet proven here", "not supported")), status
