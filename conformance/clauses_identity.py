"""Clauses on identity: an operation touches exactly the key it names.

Keys whose rendering is a prefix of another's (page hashes of 8 to 128 hex digits), identities
that differ in one field only or only in letter case, and the same key twice in one batch (the
last write wins). Mixed into :class:`~hicache_storage.conformance.suite.ConformanceTests`.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from hicache_storage.store import Store
from hicache_storage.conformance.clauses import Clauses
from hicache_storage.conformance.pages import check_page, key_digest, page_for, random_hash
from hicache_storage.keys import KeyScope, Namespace, PageKey, Shard

#: Hash lengths whose renderings are prefixes of one another (PageKey allows 8 to 128 digits).
PREFIX_LENGTHS = (8, 12, 16, 32, 63, 64, 65, 127, 128)
PAGE = 1024


def _base_namespace() -> Namespace:
    return Namespace(
        model=f"conformance-{uuid.uuid4().hex[:12]}", kv_dtype="bfloat16", page_size=64, revision="rev-a", tenant="tenant-a"
    )


def _ns(**changes: Any) -> Callable[[Namespace], tuple[Namespace, Namespace]]:
    return lambda base: (base, replace(base, **changes))


def _ns_pair(mine: dict[str, Any], theirs: dict[str, Any]) -> Callable[[Namespace], tuple[Namespace, Namespace]]:
    return lambda base: (replace(base, **mine), replace(base, **theirs))


def _capitalized(field: str) -> Callable[[Namespace], tuple[Namespace, Namespace]]:
    def pair(base: Namespace) -> tuple[Namespace, Namespace]:
        changes: dict[str, Any] = {field: str(getattr(base, field)).capitalize()}
        return base, replace(base, **changes)

    return pair


# Identities that differ from a base in one field only, slightly: letter case, one more
# character (so one rendering may be a prefix of the other), absent vs empty, off by one.
NEAR_NAMESPACES: dict[str, Callable[[Namespace], tuple[Namespace, Namespace]]] = {
    "model-case": _capitalized("model"),
    "model-suffix": lambda base: (base, replace(base, model=base.model + "0")),
    "revision-case": _capitalized("revision"),
    "revision-absent": _ns(revision=None),
    "revision-empty": _ns_pair({"revision": None}, {"revision": ""}),
    "kv_dtype-case": lambda base: (base, replace(base, kv_dtype="BFloat16")),
    "page_size": _ns(page_size=65),
    "layout": _ns_pair({"layout": "page_first"}, {"layout": "page_first_direct"}),
    "tenant-case": _capitalized("tenant"),
    "tenant-suffix": _ns(tenant="tenant-a0"),
    "tenant-absent": _ns(tenant=None),
    "tenant-empty": _ns_pair({"tenant": None}, {"tenant": ""}),
    "format_version": _ns(format_version=2),
}
#: One shard field changed at a time (also the whole-value isolation clause's shard variants).
SHARD_VARIANTS: dict[str, Shard] = {
    "tp_rank": Shard(tp_rank=1, tp_size=2),
    "tp_size": Shard(tp_rank=0, tp_size=2),
    "pp_rank": Shard(pp_rank=1, pp_size=2),
    "pp_size": Shard(pp_rank=0, pp_size=2),
    "cp_rank": Shard(cp_rank=1, cp_size=2),
    "cp_size": Shard(cp_rank=0, cp_size=2),
    "replicated": Shard(replicated=True),
}
NEAR_IDENTITIES = [*NEAR_NAMESPACES, *SHARD_VARIANTS, "part-prefix"]
OPERATIONS = ("get", "exists", "delete", "clear")


def near_scopes(variant: str) -> tuple[KeyScope, KeyScope]:
    """Two scopes that differ only in what ``variant`` names."""
    base = _base_namespace()
    if variant in NEAR_NAMESPACES:
        mine, theirs = NEAR_NAMESPACES[variant](base)
        return KeyScope(mine), KeyScope(theirs)
    if variant in SHARD_VARIANTS:
        return KeyScope(base), KeyScope(base, SHARD_VARIANTS[variant])
    return KeyScope(base, part="kv"), KeyScope(base, part="k")


class IdentityClauses(Clauses):
    """Operations touch exactly the key they name; duplicates in a batch resolve to the last write."""

    def require_operation(self, store: Store, operation: str) -> None:
        if operation in ("delete", "clear"):
            self.require(store, operation)

    @staticmethod
    def clear_quietly(store: Store, *namespaces: Namespace) -> None:
        if store.capabilities.clear:
            for namespace in dict.fromkeys(namespaces):
                store.clear(namespace)

    # --- keys whose rendering is a prefix of another's ------------------------------------------

    @pytest.mark.parametrize("operation", OPERATIONS)
    def test_keys_that_prefix_each_other_are_distinct(
        self, store: Store, scope: KeyScope, rng: random.Random, operation: str
    ) -> None:
        """Hashes of 8..128 digits where each is a prefix of the next: each names its own page."""
        self.require_operation(store, operation)
        base = random_hash(rng, 128)
        keys = [scope.key(base[:length]) for length in PREFIX_LENGTHS]
        known = {key_digest(k): k for k in keys}
        lone = len(keys) // 2
        assert store.put([keys[lone]], [page_for(keys[lone], PAGE)]) == [True]
        if operation == "exists":
            expected = [i == lone for i in range(len(keys))]
            assert store.exists(keys) == expected, f"exists with only the {PREFIX_LENGTHS[lone]}-digit hash stored"
            assert store.prefix_exists(keys[lone:]) == 1
            return
        if operation == "get":
            got = store.get(keys, PAGE)
            wrong = [PREFIX_LENGTHS[i] for i, value in enumerate(got) if (value is not None) != (i == lone)]
            assert not wrong, f"get of the {wrong}-digit hashes with only the {PREFIX_LENGTHS[lone]}-digit one stored"
        assert store.put(keys, [page_for(k, PAGE) for k in keys]) == [True] * len(keys)
        if operation == "get":
            for key, value in zip(keys, store.get(keys, PAGE)):
                assert value is not None, f"the {len(key.page_hash)}-digit hash read as a miss"
                check_page(value, key, known=known)
        elif operation == "delete":
            assert store.delete([keys[lone]]) == [True]
            assert store.exists(keys) == [i != lone for i in range(len(keys))], "delete removed a key its hash prefixes"
            assert store.delete([scope.key(base[:20])]) == [False], "delete of a never-stored hash that prefixes stored ones"
            assert store.exists(keys) == [i != lone for i in range(len(keys))], "delete of an absent key removed a key it prefixes"
            for key, value in zip(keys, store.get(keys, PAGE)):
                if key is not keys[lone]:
                    check_page(value, key, known=known)
        else:
            other = KeyScope(replace(scope.namespace, model=scope.namespace.model + "0"))
            theirs = [other.key(k.page_hash) for k in keys]
            try:
                assert store.put(theirs, [page_for(k, PAGE) for k in theirs]) == [True] * len(theirs)
                store.clear(scope.namespace)
                assert store.exists(keys) == [False] * len(keys), "clear left pages of its namespace"
                assert store.exists(theirs) == [True] * len(theirs), "clear removed pages of a namespace whose model extends its own"
            finally:
                self.clear_quietly(store, other.namespace)

    # --- identities that differ in one field, slightly --------------------------------------------

    @pytest.mark.parametrize("operation", OPERATIONS)
    @pytest.mark.parametrize("variant", NEAR_IDENTITIES)
    def test_near_identities_are_distinct(self, store: Store, rng: random.Random, variant: str, operation: str) -> None:
        """Two identities differing in one field only (or only in letter case) never share a page."""
        self.require_operation(store, operation)
        mine_scope, theirs_scope = near_scopes(variant)
        page_hash = random_hash(rng)
        mine, theirs = mine_scope.key(page_hash), theirs_scope.key(page_hash)
        known = {key_digest(mine): mine, key_digest(theirs): theirs}
        try:
            assert store.put([mine], [page_for(mine, PAGE)]) == [True]
            if operation == "exists":
                assert store.exists([theirs, mine]) == [False, True], f"exists sees {variant}'s twin"
                return
            if operation == "get":
                assert store.get([theirs], PAGE) == [None], f"get of {variant}'s twin returned a page"
            assert store.put([theirs], [page_for(theirs, PAGE)]) == [True]
            if operation == "get":
                got = store.get([mine, theirs], PAGE)
                for key, value in zip((mine, theirs), got):
                    assert value is not None, f"{variant}: a page read as a miss after its twin was written"
                    check_page(value, key, known=known)
            elif operation == "delete":
                assert store.delete([mine]) == [True]
                assert store.exists([mine, theirs]) == [False, True], f"delete of one {variant} twin touched the other"
                [value] = store.get([theirs], PAGE)
                check_page(value, theirs, known=known)
            else:
                store.clear(mine.scope.namespace)
                same = mine.scope.namespace == theirs.scope.namespace
                assert store.exists([mine]) == [False], "clear left a page of its namespace"
                if same:
                    assert store.exists([theirs]) == [False], f"clear left the {variant} twin, which is in its namespace"
                else:
                    [value] = store.get([theirs], PAGE)
                    assert value is not None, f"clear removed the {variant} twin, another namespace's page"
                    check_page(value, theirs, known=known)
        finally:
            self.clear_quietly(store, mine.scope.namespace, theirs.scope.namespace)

    # --- duplicates in one batch ----------------------------------------------------------------

    def test_duplicate_keys_last_write_wins(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """The same key several times in one put: every position reports stored, the last value stays."""
        a, b = scope.key(random_hash(rng)), scope.key(random_hash(rng))
        batch = [a, b, a, a, b, a]
        values = [page_for(k, PAGE, version) for version, k in enumerate(batch)]
        assert store.put(batch, values) == [True] * len(batch)
        got = store.get([a, b], PAGE)
        assert check_page(got[0], a, versions=range(len(batch))) == 5, "the last write of a duplicate key must win"
        assert check_page(got[1], b, versions=range(len(batch))) == 4, "the last write of a duplicate key must win"

    def test_duplicate_keys_across_batches_last_write_wins(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """A batch split to max_batch still ends with the value of the key's last position."""
        key = scope.key(random_hash(rng))
        count = 2 * (store.capabilities.max_batch or 20) + 1
        values = [page_for(key, PAGE, version) for version in range(count)]
        assert store.put([key] * count, values) == [True] * count
        [got] = store.get([key], PAGE)
        assert check_page(got, key, versions=range(count)) == count - 1, "the last write of a duplicate key must win"

    def test_duplicate_keys_in_one_get_fill_every_target(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        a, missing = scope.key(random_hash(rng)), scope.key(random_hash(rng))
        assert store.put([a], [page_for(a, PAGE)]) == [True]
        targets = [bytearray(PAGE) for _ in range(4)]
        assert store.get_into([a, a, missing, a], targets) == [True, True, False, True]
        for position in (0, 1, 3):
            check_page(targets[position], a)
        assert store.exists([a, missing, a]) == [True, False, True]
