"""A Hypothesis state machine that drives a backend and a dict model with the same operations.

The model is the truth: every read must return the model's bytes or, for a backend that declares
``evicts``, a miss. Never other bytes.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache_storage.store import Store
from hicache_storage.conformance.pages import assert_same_bytes
from hicache_storage.keys import KeyScope, PageKey

SIZES = (16, 1024, 4096)


def make_machine(store: Store, scope: KeyScope) -> type[RuleBasedStateMachine]:
    """A state machine class bound to one open backend; each run gets keys of its own.

    Rules draw key *indices*; each machine instance maps them into a fresh page-hash range, so a
    store that can neither delete nor clear still starts every example empty.
    """
    index_st = st.integers(0, 7)
    may_evict = store.capabilities.evicts
    runs = iter(range(1, 1 << 30))

    class BackendMatchesDict(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.model: dict[PageKey, bytes] = {}
            run = next(runs)
            self.keys = [scope.key("%032x%032x" % (run, i + 1)) for i in range(8)]

        @rule(batch=st.lists(st.tuples(index_st, st.sampled_from(SIZES), st.integers(0, 255)), min_size=1, max_size=4))
        def put(self, batch: list[tuple[int, int, int]]) -> None:
            unique = {self.keys[i]: bytes([fill]) * size for i, size, fill in batch}
            assert store.put(list(unique), list(unique.values())) == [True] * len(unique)
            self.model.update(unique)

        @rule(batch=st.lists(index_st, max_size=6))
        def get(self, batch: list[int]) -> None:
            for key in (self.keys[i] for i in batch):
                expected = self.model.get(key)
                size = len(expected) if expected is not None else 16
                [got] = store.get([key], size)
                if expected is None or (got is None and may_evict):
                    assert got is None or may_evict
                    if got is not None:
                        assert_same_bytes(got, expected, f"read of {key.page_hash[:12]} returned other bytes")
                else:
                    assert_same_bytes(got, expected, f"read of {key.page_hash[:12]} returned other bytes")

        @rule(batch=st.lists(index_st, max_size=6))
        def exists(self, batch: list[int]) -> None:
            keys = [self.keys[i] for i in batch]
            for key, found in zip(keys, store.exists(keys)):
                if key not in self.model:
                    assert not found, "exists() reported a page that was never written or was deleted"
                elif not may_evict:
                    assert found

        @rule(batch=st.lists(index_st, max_size=6))
        def prefix(self, batch: list[int]) -> None:
            keys = [self.keys[i] for i in batch]
            length = store.prefix_exists(keys)
            expected = 0
            for key in keys:
                if key not in self.model:
                    break
                expected += 1
            assert length <= expected if may_evict else length == expected

        @precondition(lambda self: store.capabilities.delete)
        @rule(batch=st.lists(index_st, max_size=3, unique=True))
        def delete(self, batch: list[int]) -> None:
            keys = [self.keys[i] for i in batch]
            for key, removed in zip(keys, store.delete(keys)):
                if not may_evict:
                    assert removed == (key in self.model)
                self.model.pop(key, None)

        @invariant()
        def result_counts_match(self) -> None:
            assert len(store.exists(self.keys)) == len(self.keys)

    return BackendMatchesDict
