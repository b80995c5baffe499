"""tests/README.md maps the tests: each Python file under tests/ is listed under its folder's
heading, once, and every file listed exists, so the map cannot lose a file or keep a stale one.

A file is listed by its name on a ``- `name`:`` line under the heading ``## `folder/`...``
(``## `tests/` itself`` for the files at the top). Files of the outside connector package are
covered by its folder's own line; caches and build output are not source.
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
README = TESTS / "README.md"
#: Folders listed as one entry: a package the tests install, not tests of their own.
LISTED_AS_A_FOLDER = {"conformance/outside_connector"}


def source_files() -> set[str]:
    """Every Python file under tests/, as its path from tests/ (folders listed as one entry once)."""
    found = set()
    for path in TESTS.rglob("*.py"):
        relative = path.relative_to(TESTS)
        if "__pycache__" in relative.parts or "build" in relative.parts:
            continue
        folder = next((f for f in LISTED_AS_A_FOLDER if relative.as_posix().startswith(f + "/")), None)
        found.add(f"{folder}/" if folder else relative.as_posix())
    return found


def mapped_files() -> list[str]:
    """Every entry of the README, as its path from tests/, in the order listed."""
    entries: list[str] = []
    folder: str | None = None
    for line in README.read_text().splitlines():
        if line.startswith("## "):
            heading = re.match(r"## `([^`]+)`", line)
            folder = None if heading is None else "" if heading.group(1) == "tests/" else heading.group(1)
            continue
        entry = re.match(r"- `([^`]+)`:", line)
        if entry and folder is not None:
            entries.append(folder + entry.group(1))
    return entries


def test_the_readme_lists_every_test_file_once() -> None:
    listed = mapped_files()
    doubled = sorted({entry for entry in listed if listed.count(entry) > 1})
    assert not doubled, f"tests/README.md lists these more than once: {doubled}"
    missing = sorted(source_files() - set(listed))
    assert not missing, f"tests/README.md does not say what these prove; add a line for each under its folder: {missing}"


def test_every_file_the_readme_lists_exists() -> None:
    stale = sorted(entry for entry in mapped_files() if not (TESTS / entry).exists())
    assert not stale, f"tests/README.md lists files that are gone (remove or rename their lines): {stale}"


def test_the_map_is_read() -> None:
    """The parser finds entries in every folder (an unread README would miss nothing either)."""
    folders = {entry.rpartition("/")[0] for entry in mapped_files()}
    assert {"", "sdk", "layers", "connectors", "conformance", "core", "helpers"} <= folders
    assert "sdk/test_tests_readme.py" in mapped_files()
