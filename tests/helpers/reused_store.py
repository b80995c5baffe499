"""A conformance ``store`` kept open from one clause to the next, for clients slow to close.

A Mooncake client takes about a second to close (it joins its heartbeat thread holding the GIL):
once per clause, three minutes of every suite run over Mooncake. The clauses already keep out of
each other's way by namespace (each gets a fresh one, cleared afterwards), so the client a clause
used serves the next one *if that clause left it as a fresh client is*: not closed, no hook
replaced or added at any level of its stack, no memory registered (the client would go on
taking the range for registered after the clause freed it), and the clause passed. Any
other client is closed after its clause, as before, and the next clause gets a new one. Clauses
that open further instances (``open_backend``: persistence, other processes, a closed store)
still open and close their own.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from hicache_storage.store import Store
from hicache_storage.keys import KeyScope, Namespace

#: A namespace no clause writes: the warm-up read of a new store misses in it.
WARM_UP = KeyScope(Namespace(model=f"reused-store-warm-up-{uuid.uuid4().hex[:12]}", kv_dtype="bfloat16", page_size=64))


def _state(store: Store) -> list[tuple[Any, ...]]:
    """What a clause could change on a store and leave changed for the next one: per level of the
    stack, its attribute names, which callables (hooks) and capabilities it holds, and the memory
    ranges it has registered (a Mooncake connector keeps them in ``_registered``)."""
    state = []
    for level in store.levels():
        attributes = vars(level)
        bound = tuple(sorted((name, id(value)) for name, value in attributes.items() if callable(value)))
        registered = attributes.get("_registered")
        state.append((id(level), tuple(sorted(attributes)), bound, level.capabilities, repr(registered)))
    return state


class ReusedStore:
    """Mix into a ``ConformanceTests`` subclass (before it) to keep ``store`` open across clauses."""

    @pytest.fixture(scope="class")
    def idle_store(self) -> Iterator[list[Store]]:
        """At most one open store that a passing clause left untouched; closed with the class."""
        idle: list[Store] = []
        yield idle
        for store in idle:
            store.close()

    @pytest.fixture
    def store(
        self,
        request: pytest.FixtureRequest,
        idle_store: list[Store],
        backend_name: str,
        backend_config: dict[str, Any],
        backend_layers: list[dict[str, Any]] | None,
    ) -> Iterator[Store]:
        if idle_store:
            store = idle_store.pop()
        else:
            store = self.make_backend(backend_name, backend_config, backend_layers)  # type: ignore[attr-defined]
            # What a stack sets up lazily is set up now, before the baseline: integrity registers
            # its own trailer arena on the first read (memory that lives as long as the stack).
            assert store.get([WARM_UP.key("0" * 64)], 1) == [None]
        before, failures = _state(store), request.session.testsfailed
        yield store
        if not store.closed and request.session.testsfailed == failures and _state(store) == before:
            idle_store.append(store)
        else:
            store.close()
