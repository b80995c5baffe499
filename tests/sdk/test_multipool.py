"""Multi-pool storage: hit-policy arithmetic, validation, lookups against the memory connector,
and a store that fails (the only place a fault is injected: the memory connector itself is real)."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_storage.conformance.suite import ConformanceTests
from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.errors import (
    AuthenticationError,
    BackendUnavailableError,
    ErrorStatus,
    InvalidArgumentError,
    StorageError,
)
from hicache_storage.keys import KeyScope, Namespace, PageKey
from hicache_storage.multipool import HitPolicy, MultiPoolStore, PoolCuts, PoolSpec, common_cuts, longest_cut
from hicache_storage.store import Store

ALL, TRAILING = HitPolicy.ALL_PAGES, HitPolicy.TRAILING_PAGES
KV = PoolSpec("kv")
SWA = PoolSpec("swa", TRAILING, trailing_pages=3)
MAMBA = PoolSpec("mamba", TRAILING)
INDEXER = PoolSpec("indexer")


def brute_force_cut(pools: Sequence[PoolSpec], presence: dict[str, list[bool]]) -> int:
    """The definition, written out: the largest c whose needed pages are all present in every pool."""
    n = len(presence[pools[0].name])
    for c in range(n, -1, -1):
        needed = {
            spec.name: range(0, c) if spec.hit_policy is ALL else range(max(0, c - spec.trailing_pages), c) for spec in pools
        }
        if all(presence[name][i] for name, pages in needed.items() for i in pages):
            return c
    raise AssertionError("cut 0 needs nothing, so it is always accepted")


def hashes(n: int, salt: int = 0) -> list[str]:
    return ["%064x" % (salt * 1000 + i + 1) for i in range(n)]


@pytest.fixture
def scope() -> KeyScope:
    return KeyScope(Namespace(model="hybrid-test", kv_dtype="bfloat16", page_size=16))


@pytest.fixture
def backend() -> Store:
    return Store(MemoryBackend({}))


@pytest.fixture
def store(backend: Store, scope: KeyScope) -> MultiPoolStore:
    return MultiPoolStore(backend, scope, [KV, SWA, MAMBA])


def write(store: MultiPoolStore, presence: dict[str, list[bool]], chain: list[str]) -> None:
    for pool, present in presence.items():
        pages = [h for h, here in zip(chain, present) if here]
        assert store.put(pool, pages, [pool.encode() * 8] * len(pages)) == [True] * len(pages)


# --- policy arithmetic --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "present", "expected"),
    [
        (KV, [], [True]),
        (KV, [True, True, False, True], [True, True, True, False, False]),
        (KV, [False, True], [True, False, False]),
        (MAMBA, [False, True, False, True], [True, False, True, False, True]),
        (SWA, [True, True], [True, True, True]),  # the window is longer than the prefix: all of it
        (SWA, [False, True], [True, False, False]),
        (SWA, [False, True, True, True, False], [True, False, False, False, True, False]),
        (PoolSpec("w", TRAILING, trailing_pages=9), [True] * 4, [True] * 5),
    ],
    ids=["empty", "kv-hole", "kv-hole-at-head", "checkpoints", "window-longer-than-prefix", "window-head-missing",
         "window-slides", "huge-window"],
)
def test_accepted_cuts(spec: PoolSpec, present: list[bool], expected: list[bool]) -> None:
    assert spec.accepted_cuts(present) == expected


def test_cut_zero_is_always_accepted() -> None:
    for spec in (KV, SWA, MAMBA):
        assert spec.accepted_cuts([False] * 5)[0] is True
    assert longest_cut([KV, SWA], {"kv": [False] * 3, "swa": [False] * 3}) == 0
    assert longest_cut([KV, MAMBA], {"kv": [], "mamba": []}) == 0


def test_a_restorable_cut_need_not_be_contiguous_with_shorter_ones() -> None:
    """SWA/Mamba: cut 5 can be restorable while 4 and 3 are not (SGLang's restorable_prefix_pages)."""
    presence = {"kv": [True] * 6, "mamba": [False, False, True, False, True, False]}
    assert common_cuts([KV, MAMBA], presence) == [True, False, False, True, False, True, False]
    assert longest_cut([KV, MAMBA], presence) == 5


def test_policy_accepts_its_string_value() -> None:
    assert PoolSpec("swa", "trailing_pages", 2).hit_policy is TRAILING


pools_strategy = st.lists(
    st.one_of(st.just((ALL, 1)), st.tuples(st.just(TRAILING), st.integers(1, 6))), min_size=1, max_size=4
).map(lambda specs: [PoolSpec(f"p{i}", policy, window) for i, (policy, window) in enumerate(specs)])


@settings(max_examples=300, deadline=None)
@given(pools=pools_strategy, data=st.data())
def test_longest_cut_matches_brute_force(pools: list[PoolSpec], data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 12))
    presence = {spec.name: data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) for spec in pools}
    assert longest_cut(pools, presence) == brute_force_cut(pools, presence)
    accepted = common_cuts(pools, presence)
    assert accepted == [brute_force_cut(pools, {k: v[:c] for k, v in presence.items()}) == c for c in range(n + 1)]


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        ({"name": ""}, "key part"),
        ({"name": "swa", "hit_policy": "newest_page"}, "all_pages"),
        ({"name": "swa", "hit_policy": TRAILING, "trailing_pages": 0}, ">= 1"),
        ({"name": "swa", "hit_policy": TRAILING, "trailing_pages": True}, ">= 1"),
        ({"name": "kv", "trailing_pages": 4}, "TRAILING_PAGES"),
    ],
    ids=["empty-name", "unknown-policy", "zero-window", "bool-window", "window-on-all-pages"],
)
def test_pool_spec_validation_names_the_fix(kwargs: dict, fix: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fix):
        PoolSpec(**kwargs)


@pytest.mark.parametrize(
    ("pools", "fix"),
    [
        ([KV, PoolSpec("kv")], "unique.*rename"),
        ([SWA, MAMBA], "at least one pool must use HitPolicy.ALL_PAGES"),
        ([], "at least one pool"),
        ([PoolSpec("KV")], r"not a valid key part.*\[a-z\]"),
        ([KV, "swa"], "PoolSpec objects"),
    ],
    ids=["duplicate", "no-voting-pool", "no-pools", "bad-part", "not-a-spec"],
)
def test_store_validation_names_the_fix(backend: Store, scope: KeyScope, pools: list, fix: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fix):
        MultiPoolStore(backend, scope, pools)


def test_store_refuses_what_is_not_a_backend_or_scope(backend: Store, scope: KeyScope) -> None:
    with pytest.raises(InvalidArgumentError, match="must be a Store"):
        MultiPoolStore({}, scope, [KV])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"or Store\(connector\)\); got MemoryBackend"):
        MultiPoolStore(MemoryBackend({}), scope, [KV])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="KeyScope"):
        MultiPoolStore(backend, "scope", [KV])  # type: ignore[arg-type]


def test_longest_cut_validation_names_the_fix() -> None:
    with pytest.raises(InvalidArgumentError, match="no entry for pool.*'swa'"):
        longest_cut([KV, SWA], {"kv": [True]})
    with pytest.raises(InvalidArgumentError, match="same pages"):
        longest_cut([KV, SWA], {"kv": [True], "swa": [True, True]})
    with pytest.raises(InvalidArgumentError, match="at least the KV pool"):
        longest_cut([], {})


def test_unknown_pool_and_bare_hash_are_refused(store: MultiPoolStore) -> None:
    with pytest.raises(InvalidArgumentError, match="unknown pool 'draft'.*'kv', 'swa', 'mamba'"):
        store.keys("draft", hashes(1))
    with pytest.raises(InvalidArgumentError, match="wrap a single hash"):
        store.usable_pages(hashes(1)[0])
    with pytest.raises(InvalidArgumentError, match="wrap a single hash"):
        store.put("kv", hashes(1)[0], [b"x"])


# --- keys and values ----------------------------------------------------------------------------


def test_keys_are_the_scope_with_the_pool_as_part(store: MultiPoolStore, scope: KeyScope) -> None:
    chain = hashes(3)
    for pool in ("kv", "swa", "mamba"):
        assert store.keys(pool, chain) == [PageKey(scope.with_part(pool), h) for h in chain]
    assert store.pools == {"kv": KV, "swa": SWA, "mamba": MAMBA}


def test_same_hash_in_two_pools_is_two_values(store: MultiPoolStore) -> None:
    chain = hashes(2)
    store.put("kv", chain, [b"K" * 32, b"k" * 32])
    store.put("swa", chain, [b"S" * 32, b"s" * 32])
    out = [bytearray(32) for _ in range(4)]
    assert store.get_into("kv", chain, out[:2]) == [True, True]
    assert store.get_into("swa", chain, out[2:]) == [True, True]
    assert [bytes(b) for b in out] == [b"K" * 32, b"k" * 32, b"S" * 32, b"s" * 32]
    assert store.get_into("mamba", chain, [bytearray(32), bytearray(32)]) == [False, False]


def test_sidecar_segments_travel_with_their_source(store: MultiPoolStore) -> None:
    """A KV page whose value is K, V and the draft model's K, V round-trips as one value; a reader
    without room for the draft segments gets a miss, never the target's KV alone."""
    chain = hashes(2)
    k, v, draft_k, draft_v = b"k" * 96, b"v" * 96, b"d" * 24, b"e" * 24
    assert store.put("kv", chain, [[k, v, draft_k, draft_v]] * 2) == [True, True]
    targets = [[bytearray(96), bytearray(96), bytearray(24), bytearray(24)] for _ in chain]
    assert store.get_into("kv", chain, targets) == [True, True]
    assert all([bytes(s) for s in t] == [k, v, draft_k, draft_v] for t in targets)
    assert store.get_into("kv", chain, [[bytearray(96), bytearray(96)] for _ in chain]) == [False, False]


# --- lookups ------------------------------------------------------------------------------------


def test_checkpoint_at_cut_c_is_stored_under_page_c_minus_1(store: MultiPoolStore) -> None:
    chain = hashes(8)
    write(store, {"kv": [True] * 8, "swa": [True] * 8}, chain)
    assert store.usable_pages(chain) == 0
    store.put("mamba", [chain[4]], [b"state"])  # the state after pages 0..4: valid at cut 5
    assert store.usable_pages(chain) == 5
    store.put("mamba", [chain[7]], [b"state"])
    assert store.usable_pages(chain) == 8


def test_usable_pages_asks_side_pools_only_within_the_kv_prefix(backend: Store, store: MultiPoolStore) -> None:
    chain = hashes(10)
    write(store, {"kv": [True] * 4, "swa": [True] * 10, "mamba": [True] * 10}, chain)
    before = backend.stats()["exists_keys"]
    assert store.usable_pages(chain) == 4
    # One kv batch of 10, then each side pool only for its window before cut 4 (swa 3, mamba 1).
    assert backend.stats()["exists_keys"] - before == 10 + SWA.trailing_pages + MAMBA.trailing_pages


def test_a_later_pool_is_asked_only_up_to_the_cut_left_by_earlier_ones(backend: Store, scope: KeyScope) -> None:
    store = MultiPoolStore(backend, scope, [KV, INDEXER, MAMBA, SWA])
    chain = hashes(10)
    write(store, {"kv": [True] * 10, "indexer": [True] * 10, "mamba": [i == 5 for i in range(10)], "swa": [True] * 10}, chain)
    before = backend.stats()["exists_keys"]
    assert store.usable_pages(chain) == 6
    # kv and indexer: 10 each; mamba's window before cut 10 (1 page) is missing, so the full
    # lookup follows: mamba 10, then swa only up to cut 6, which mamba left.
    assert backend.stats()["exists_keys"] - before == 10 + 10 + 1 + 10 + 6


def test_when_every_pool_holds_the_prefix_trailing_pools_are_asked_only_for_their_windows(
    backend: Store, scope: KeyScope
) -> None:
    store = MultiPoolStore(backend, scope, [KV, MAMBA, SWA])
    chain = hashes(40)
    write(store, {name: [True] * 40 for name in store.pools}, chain)
    before = backend.stats()["exists_keys"]
    assert store.restorable_pages(chain, held=4) == 40
    assert backend.stats()["exists_keys"] - before == 36 + MAMBA.trailing_pages + SWA.trailing_pages
    assert store.lookup(chain, held=4).longest == 40


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_usable_pages_is_the_longest_cut_of_what_is_stored(data: st.DataObject) -> None:
    pools = data.draw(pools_strategy.filter(lambda ps: any(p.hit_policy is ALL for p in ps)))
    n = data.draw(st.integers(0, 10))
    presence = {spec.name: data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) for spec in pools}
    store = MultiPoolStore(Store(MemoryBackend({})), KeyScope(Namespace("m", "bfloat16", 4)), pools)
    chain = hashes(n)
    write(store, presence, chain)
    assert store.presence(chain) == presence
    assert store.usable_pages(chain) == brute_force_cut(pools, presence)
    held = data.draw(st.integers(0, n))
    assert store.restorable_pages(chain, held) == store.lookup(chain, held).longest
    found = store.lookup(chain)
    assert found.cuts == tuple(c for c, ok in enumerate(common_cuts(pools, presence)) if ok and c > 0)
    first = next(spec.name for spec in pools if spec.hit_policy is ALL)
    assert (first in found.pool_hits) == (n > 0), "the first ALL_PAGES pool is asked whenever there is a page"
    bound = found.pool_hits.get(first, 0)  # its prefix: every pool with a verdict was asked up to it
    for name, hit in found.pool_hits.items():
        own = store.pools[name].accepted_cuts(presence[name])
        assert hit == max(c for c in range(bound + 1) if own[c]), f"{name}'s verdict is not its own longest cut"


@pytest.mark.parametrize("pool", ["swa", "mamba", "indexer"])
def test_removing_any_one_side_page_the_full_cut_needs_shortens_the_hit(backend: Store, scope: KeyScope, pool: str) -> None:
    store = MultiPoolStore(backend, scope, [KV, SWA, MAMBA, INDEXER])
    n = 8
    chain = hashes(n)
    write(store, {name: [True] * n for name in store.pools}, chain)
    assert store.usable_pages(chain) == n
    spec = store.pools[pool]
    needed = range(n) if spec.hit_policy is ALL else range(n - spec.trailing_pages, n)
    for page in needed:
        assert backend.delete(store.keys(pool, [chain[page]])) == [True]
        presence = store.presence(chain)
        usable = store.usable_pages(chain)
        assert usable < n, f"a full hit with {pool} page {page} missing"
        assert usable == brute_force_cut(list(store.pools.values()), presence)
        store.put(pool, [chain[page]], [pool.encode() * 8])
    assert store.usable_pages(chain) == n


# --- lookup: every common cut and each pool's own ---------------------------------------------


def test_lookup_lists_cut_5_when_a_trailing_pool_rejects_4(backend: Store, scope: KeyScope) -> None:
    store = MultiPoolStore(backend, scope, [KV, MAMBA, SWA])
    chain = hashes(7)
    write(store, {"kv": [True] * 7, "mamba": [i in (1, 4) for i in range(7)], "swa": [True] * 7}, chain)
    found = store.lookup(chain)
    assert found == PoolCuts(0, (2, 5), {"kv": 7, "mamba": 5})
    assert found.longest == store.restorable_pages(chain) == 5
    # swa was asked only up to cut 5 (mamba ruled 6 and 7 out), so its own longest cut is unknown.
    assert "swa" not in found.pool_hits
    assert store.lookup(chain, held=3) == PoolCuts(3, (5,), {"kv": 7, "mamba": 5})


def test_lookup_keys_a_pool_with_its_own_scope(backend: Store, scope: KeyScope) -> None:
    half = KeyScope(Namespace(model="hybrid-test", kv_dtype="float16", page_size=16))
    swa = PoolSpec("swa", TRAILING, trailing_pages=2, scope=half)
    store = MultiPoolStore(backend, scope, [KV, swa])
    assert store.keys("swa", hashes(1))[0].scope == half.with_part("swa")
    chain = hashes(4)
    write(store, {"kv": [True] * 4, "swa": [False, True, True, False]}, chain)
    assert store.lookup(chain) == PoolCuts(0, (3,), {"kv": 4, "swa": 3})
    # The same pages under the store's own scope (another dtype) are not this pool's.
    default_scope = MultiPoolStore(backend, scope, [KV, PoolSpec("swa", TRAILING, trailing_pages=2)])
    assert default_scope.lookup(chain) == PoolCuts(0, (), {"kv": 4, "swa": 0})
    write(default_scope, {"swa": [True] * 4}, chain)
    assert store.lookup(chain).cuts == (3,)


def test_lookup_with_no_hit_asks_only_the_first_pool(backend: Store, store: MultiPoolStore) -> None:
    before = backend.stats()["exists_keys"]
    found = store.lookup(hashes(5))
    assert found == PoolCuts(0, (), {"kv": 0}) and found.longest == 0
    assert backend.stats()["exists_keys"] - before == 5
    assert store.lookup([]) == PoolCuts(0, (), {}), "no page, nothing asked, no verdict"


def test_lookup_degrades_a_retryable_error_to_that_pools_miss(scope: KeyScope, caplog: pytest.LogCaptureFixture) -> None:
    backend = FailingExists({})
    store = MultiPoolStore(Store(backend), scope, [KV, MAMBA, SWA])
    chain = hashes(4)
    write(store, {"kv": [True] * 4, "swa": [True] * 4, "mamba": [True] * 4}, chain)
    backend.failing_parts = frozenset({"mamba"})
    with pytest.raises(BackendUnavailableError):
        store.lookup(chain)
    with caplog.at_level(logging.WARNING, logger="hicache_storage.multipool"):
        assert store.lookup(chain, degrade=True) == PoolCuts(0, (), {"kv": 4, "mamba": 0})
    assert "pool mamba" in caplog.text and "connection reset by peer (injected)" in caplog.text
    permanent = FailingExistsWith({})
    permanent.error = AuthenticationError("wrong password")
    with pytest.raises(AuthenticationError):
        MultiPoolStore(Store(permanent), scope, [KV]).lookup(chain, degrade=True)


# --- a failing store ----------------------------------------------------------------------------


class FailingExists(MemoryBackend):
    """A memory store whose exists fails for the named key parts, as a dropped connection would."""

    failing_parts: frozenset[str] = frozenset()

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        if any(key.scope.part in self.failing_parts for key in keys):
            raise BackendUnavailableError("connection reset by peer (injected)")
        return super()._exists(keys)


@pytest.mark.parametrize("failing", [{"kv"}, {"swa"}, {"mamba"}], ids=lambda parts: "-".join(sorted(parts)))
def test_a_store_failing_with_a_retryable_error_reports_no_hit(
    scope: KeyScope, caplog: pytest.LogCaptureFixture, failing: set[str]
) -> None:
    backend = FailingExists({})
    store = MultiPoolStore(Store(backend), scope, [KV, SWA, MAMBA])
    chain = hashes(4)
    write(store, {"kv": [True] * 4, "swa": [True] * 4, "mamba": [True] * 4}, chain)
    assert store.usable_pages(chain) == 4
    backend.failing_parts = frozenset(failing)
    with caplog.at_level(logging.WARNING, logger="hicache_storage.multipool"):
        assert store.usable_pages(chain) == 0
    assert "connection reset by peer (injected)" in caplog.text and "reporting no hit" in caplog.text
    with pytest.raises(BackendUnavailableError):
        store.presence(chain)


class FailingExistsWith(MemoryBackend):
    """A memory store whose exists raises ``error``."""

    error: Exception = RuntimeError()

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        raise self.error


def test_the_status_decides_whether_a_lookup_error_is_no_hit_or_raised(scope: KeyScope) -> None:
    backend = FailingExistsWith({})
    store = MultiPoolStore(Store(backend), scope, [KV, SWA, MAMBA])
    backend.error = StorageError("EIO on a flaky mount", status=ErrorStatus.TEMPORARY)
    assert store.usable_pages(hashes(4)) == 0
    backend.error = BackendUnavailableError("down after 3 tries", status=ErrorStatus.PERSISTENT)
    assert store.usable_pages(hashes(4)) == 0
    backend.error = AuthenticationError("wrong password")
    with pytest.raises(AuthenticationError):
        store.usable_pages(hashes(4))


# --- the conformance clauses fail stores that break the multi-pool contract ---------------------


class IgnoresPart(MemoryBackend):
    """Files every pool's page under the KV key: side state and KV overwrite each other."""

    @staticmethod
    def _kv(keys: list[PageKey]) -> list[PageKey]:
        return [PageKey(key.scope.with_part("kv"), key.page_hash) for key in keys]

    def _exists(self, keys):
        return super()._exists(self._kv(keys))

    def _get_into(self, keys, targets):
        return super()._get_into(self._kv(keys), targets)

    def _put_from(self, keys, sources):
        return super()._put_from(self._kv(keys), sources)


class DeleteKeepsPages(MemoryBackend):
    """Reports pages deleted and keeps them (a delete acknowledged before it is applied, then lost)."""

    def _delete(self, keys):
        return super()._exists(keys)


class KeepsFirstTwoSegments(MemoryBackend):
    """Stores only the K and V segments of a page and pads the rest: the draft model's KV is lost."""

    def _put_from(self, keys, sources):
        return super()._put_from(keys, [[*s[:2], memoryview(bytes(sum(v.nbytes for v in s[2:])))] for s in sources])


class SidePoolsAlwaysPresent(MemoryBackend):
    """Answers 'present' for every side-pool page, as a cache that only tracks the KV would."""

    def _exists(self, keys):
        return [key.scope.part != "kv" or hit for key, hit in zip(keys, super()._exists(keys))]


@pytest.mark.parametrize(
    ("broken", "clause"),
    [
        (IgnoresPart, "test_multipool_pools_are_isolated"),
        (IgnoresPart, "test_multipool_delete_in_one_pool_leaves_the_others"),
        (DeleteKeepsPages, "test_multipool_removing_any_side_page_shortens_the_hit"),
        (SidePoolsAlwaysPresent, "test_multipool_removing_any_side_page_shortens_the_hit"),
        (SidePoolsAlwaysPresent, "test_multipool_usable_pages_is_the_longest_cut"),
        (SidePoolsAlwaysPresent, "test_multipool_checkpoint_is_stored_under_its_last_page"),
        (KeepsFirstTwoSegments, "test_multipool_sidecar_segments_round_trip"),
    ],
)
def test_the_suite_fails_a_broken_store(broken: type[MemoryBackend], clause: str) -> None:
    scope = KeyScope(Namespace(model=f"broken-{broken.__name__.lower()}", kv_dtype="bfloat16", page_size=16))
    with pytest.raises(AssertionError):
        getattr(ConformanceTests(), clause)(Store(broken({})), scope, random.Random(clause))


MULTIPOOL_CLAUSES = sorted(name for name in dir(ConformanceTests) if name.startswith("test_multipool_"))


@pytest.mark.parametrize("clause", MULTIPOOL_CLAUSES)
def test_the_suite_passes_the_reference_store(clause: str) -> None:
    """The same clauses called the same way pass on the memory connector, so the failures above are the breakage."""
    scope = KeyScope(Namespace(model="reference", kv_dtype="bfloat16", page_size=16))
    getattr(ConformanceTests(), clause)(Store(MemoryBackend({})), scope, random.Random(clause))
