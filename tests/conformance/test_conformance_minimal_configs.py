"""Every built-in connector through the conformance suite with the least config it takes.

The connector tests run the suite with tuned configurations (page geometry set, small segments,
key prefixes); a new user starts from the least config instead (README.md, "The least each
connector needs"), and that path once failed where the tuned ones passed: 3FS without
``page_size_bytes`` raised a bare ``ValueError`` on an empty first put. The configurations are
:data:`hicache_storage.testing.connector_configs.MINIMAL`; a test here holds README's table to it.

Cost: the clauses marked slow (concurrency, other processes, the state machine) are left to the
tuned runs, which cover them; Mooncake keeps one client across clauses, as its own run does
(closing a client takes a second or two).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from hicache_storage.conformance import ConformanceTests
from hicache_storage.registry import BUILTINS
from hicache_storage.testing.connector_configs import MINIMAL
from reused_store import ReusedStore

README = Path(__file__).resolve().parents[2] / "README.md"


class MinimalConfig(ConformanceTests):
    """The suite with ``MINIMAL[backend]``, its servers from the session fixtures."""

    @pytest.fixture
    def backend_config(self, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
        entry = MINIMAL[self.backend]
        servers = {name: request.getfixturevalue(name) for name in entry.servers}
        return entry.config(servers, tmp_path, tmp_path.name)

    @pytest.fixture(autouse=True)
    def _fast_clauses_only(self, request: pytest.FixtureRequest) -> None:
        if request.node.get_closest_marker("slow"):
            pytest.skip("slow clause: the connector's tuned configuration runs it")


class TestMemoryMinimal(MinimalConfig):
    backend = "memory"


class TestFileMinimal(MinimalConfig):
    backend = "file"


class TestHF3FSMinimal(MinimalConfig):
    backend = "hf3fs"


class TestFsspecMinimal(MinimalConfig):
    backend = "fsspec"


@pytest.mark.services
class TestRedisMinimal(MinimalConfig):
    backend = "redis"


@pytest.mark.services
class TestS3Minimal(MinimalConfig):
    backend = "s3"


@pytest.mark.services
class TestMooncakeMinimal(ReusedStore, MinimalConfig):
    backend = "mooncake"

    @pytest.fixture(autouse=True)
    def _needs_the_client(self) -> None:
        pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine(-non-cuda)")


def test_every_builtin_connector_has_a_minimal_run() -> None:
    classes = [cls for cls in globals().values() if isinstance(cls, type) and issubclass(cls, MinimalConfig) and cls.backend]
    assert sorted(cls.backend for cls in classes) == sorted(MINIMAL)
    # sglang:file is SGLang's own HiCacheFile, run through the suite for findings about SGLang
    assert sorted(MINIMAL) == sorted(name for name in BUILTINS if not name.startswith("sglang:"))


def test_readme_shows_each_minimal_config() -> None:
    """README's table names, for each connector, exactly the keys its minimal run sets."""
    text = README.read_text()
    section = text.split("The least each connector needs", 1)[1].split("\n\n", 2)[1]
    rows = dict(re.findall(r"^\| `([\w:]+)` \| `(\{.*\})` \|", section, flags=re.MULTILINE))
    assert sorted(rows) == sorted(MINIMAL), section
    for name, shown in rows.items():
        scratch = Path("/tmp/scratch")
        servers = {server: _ANY_SERVER for server in MINIMAL[name].servers}
        run = set(MINIMAL[name].config(servers, scratch, "x")) - set(MINIMAL[name].server_settings)
        assert sorted(json.loads(shown)) == sorted(run), name


class _AnyServer:
    """Stands in for a started server: every attribute a config reads is a placeholder."""

    lease_ttl_ms = 300

    def __getattr__(self, name: str) -> str:
        return f"<{name}>"


_ANY_SERVER = _AnyServer()
