"""A backdoor belongs to the class that declares it, and a subclass that names its pages otherwise passes.

The backdoors themselves (hicache_storage.conformance.backdoor) run in every connector's
conformance classes (their backdoor clauses, e.g. ``-k backdoor`` on tests/connectors/test_redis_connector.py)
and in the published reports; tests/conformance/test_conformance_detects_broken.py shows each catches a
connector with a server that is wrong both ways. Here: the lookup by exact class, and a correct
subclass of the file connector, which the file connector's backdoor used to fail.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from broken_backends import ReversedHashes
from hicache_storage.conformance import ConformanceTests
from hicache_storage.conformance.backdoor import (
    BUILTIN_BACKDOORS,
    MemoryBackdoor,
    backdoor_for,
    builtin_backdoor,
    declared_backdoor,
    register_backdoor,
)
from hicache_storage.connectors.file import FileBackend
from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.keys import KeyScope, Namespace
from hicache_storage.registry import resolve
from hicache_storage.spec import open_store, store_spec

#: What another process needs to import this module: its folder, and the helpers it imports.
IMPORT_PATH = [Path(__file__).resolve().parent, Path(__file__).resolve().parents[1] / "helpers"]


class FileUnderOtherNames(ReversedHashes, FileBackend):
    """A correct file connector that keeps each page in the file of its hash reversed."""


class MemoryKeptAsItsParentDoes(MemoryBackend):
    """A subclass that stores pages as the memory connector does, and says so."""


register_backdoor(MemoryKeptAsItsParentDoes, MemoryBackdoor)


@pytest.mark.parametrize("name", sorted(BUILTIN_BACKDOORS))
def test_a_built_in_backdoor_is_its_connectors_alone(name: str) -> None:
    connector_class = resolve(name)
    assert declared_backdoor(connector_class) is BUILTIN_BACKDOORS[name]
    assert declared_backdoor(type("Subclass", (connector_class,), {})) is None


def test_a_subclass_has_the_backdoor_it_declares() -> None:
    assert backdoor_for(MemoryBackend()) is not None
    assert backdoor_for(type("Subclass", (MemoryBackend,), {})()) is None
    with open_store(store_spec(f"{__name__}:MemoryKeptAsItsParentDoes", {})) as store:
        key = KeyScope(Namespace(model="m", kv_dtype="bfloat16", page_size=64)).key("ab" * 32)
        assert store.put([key], [b"page"]) == [True]
        backdoor = builtin_backdoor(store)
        assert isinstance(backdoor, MemoryBackdoor) and backdoor.get(key) == b"page"


def test_a_store_with_layers_has_none() -> None:
    with open_store(store_spec("memory", {}, [{"kind": "metrics"}])) as store:
        assert builtin_backdoor(store) is None


class TestFileUnderOtherNamesConformance(ConformanceTests):
    """The whole suite: a subclass declares no backdoor, so its backdoor clauses are skipped as
    "no backdoor" (the file connector's, applied to it, failed all five that read one)."""

    backend = f"{__name__}:FileUnderOtherNames"

    @pytest.fixture(autouse=True)
    def _importable_by_other_processes(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [*map(str, IMPORT_PATH), os.environ.get("PYTHONPATH")])))

    @pytest.fixture
    def backend_config(self, tmp_path: Path) -> dict[str, Any]:
        return {"root": str(tmp_path / "pages")}

    def test_it_has_no_backdoor(self, backdoor: object) -> None:
        assert backdoor is None
