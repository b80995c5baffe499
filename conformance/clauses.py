"""The base of every group of clauses: the page size most clauses use and the helpers they call.

:class:`~hicache_storage.conformance.suite.ConformanceTests` inherits it through its groups, so a
connector's test class that sets ``page_size_bytes`` sets it for every group.
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from hicache_storage.keys import PageKey
from hicache_storage.store import Store


class Clauses:
    """What a group of clauses may read and call on the test class it is mixed into."""

    #: Page size used by most clauses, in bytes.
    page_size_bytes: ClassVar[int] = 4096

    @staticmethod
    def require(store: Store, capability: str) -> None:
        if not getattr(store.capabilities, capability):
            pytest.skip(f"unsupported: the backend does not declare {capability}")

    def write(self, store: Store, keys: list[PageKey], values: list[bytes]) -> None:
        assert store.put(keys, values) == [True] * len(keys), "put did not store every page"
