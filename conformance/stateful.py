"""A Hypothesis state machine that drives a backend and a dict model with the same operations.

The model is the truth: every read must return the model's bytes or, for a backend that declares
``evicts``, a miss. Never other bytes.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache_storage.backend import StorageBackend
from hicache_storage.keys import KeyScope, PageKey

SIZES = (16, 1024, 4096)


def make_machine(store: StorageBackend, scope: KeyScope) -> type[RuleBasedStateMachine]:
    """A state machine class bound to one open backend and a fresh key scope."""
    keys = [scope.key("%064x" % (i + 1)) for i in range(8)]
    key_st = st.sampled_from(keys)
    may_evict = store.capabilities.evicts

    class BackendMatchesDict(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.model: dict[PageKey, bytes] = {}
            if store.capabilities.delete:
                store.delete(keys)
            elif store.capabilities.clear:
                store.clear(scope.namespace)

        @rule(batch=st.lists(st.tuples(key_st, st.sampled_from(SIZES), st.integers(0, 255)), min_size=1, max_size=4))
        def put(self, batch: list[tuple[PageKey, int, int]]) -> None:
            unique = {key: bytes([fill]) * size for key, size, fill in batch}
            assert store.put(list(unique), list(unique.values())) == [True] * len(unique)
            self.model.update(unique)

        @rule(batch=st.lists(key_st, max_size=6))
        def get(self, batch: list[PageKey]) -> None:
            for key in batch:
                expected = self.model.get(key)
                size = len(expected) if expected is not None else 16
                [got] = store.get([key], size)
                if expected is None or (got is None and may_evict):
                    assert got is None or may_evict
                    assert got is None or got == expected
                else:
                    assert got == expected, f"read of {key.page_hash[:12]} returned other bytes"

        @rule(batch=st.lists(key_st, max_size=6))
        def exists(self, batch: list[PageKey]) -> None:
            results = store.exists(batch)
            for key, found in zip(batch, results):
                if key not in self.model:
                    assert not found, "exists() reported a page that was never written or was deleted"
                elif not may_evict:
                    assert found

        @rule(batch=st.lists(key_st, max_size=6))
        def prefix(self, batch: list[PageKey]) -> None:
            length = store.prefix_exists(batch)
            expected = 0
            for key in batch:
                if key not in self.model:
                    break
                expected += 1
            assert length <= expected if may_evict else length == expected

        @precondition(lambda self: store.capabilities.delete)
        @rule(batch=st.lists(key_st, max_size=3, unique=True))
        def delete(self, batch: list[PageKey]) -> None:
            results = store.delete(batch)
            for key, removed in zip(batch, results):
                if not may_evict:
                    assert removed == (key in self.model)
                self.model.pop(key, None)

        @invariant()
        def result_counts_match(self) -> None:
            assert len(store.exists(keys)) == len(keys)

    return BackendMatchesDict
