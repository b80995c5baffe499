"""Every relative link in the repository's Markdown (README, CHANGELOG, docs/ and its reports,
tests/README.md) reaches a file or folder that exists, so moving a guide or a report cannot leave
a link behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "tests" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:|#", target):  # a URL or an anchor on the same page
            continue
        if not (page.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to paths that do not exist: {broken}"


def test_the_pages_have_links() -> None:
    """The pattern reads real links (a pattern that matched nothing would pass every page)."""
    assert "docs/writing-a-connector.md" in LINK.findall((ROOT / "README.md").read_text())
