"""Clauses on the stored bytes: realistic page sizes, the caller's buffers, an independent read path.

Mixed into :class:`~hicache_storage.conformance.suite.ConformanceTests`.
"""

from __future__ import annotations

import random

import pytest

from hicache_storage.store import Store
from hicache_storage.conformance.backdoor import Backdoor
from hicache_storage.conformance.clauses import Clauses
from hicache_storage.conformance.pages import assert_same_bytes, check_page, key_digest, page_for, random_hash
from hicache_storage.keys import KeyScope

MiB = 2**20
#: Page sizes of real models: 64 tokens of a 70B model (80 layers x 8 KV heads x 128 x K+V x
#: bf16) is 20 MiB; an odd size catches chunking that drops or pads a partial last chunk.
REALISTIC_PAGE_SIZES = {"3MiB+7": 3 * MiB + 7, "20MiB": 20 * MiB}
NO_BACKDOOR = (
    "no backdoor: this configuration's conformance fixture gives no independent read/write path "
    "(override the `backdoor` fixture; see hicache_storage.conformance.backdoor)"
)


class ByteClauses(Clauses):
    """Stored bytes are exactly the caller's, at every size, seen through an independent path too."""

    @staticmethod
    def require_backdoor(backdoor: Backdoor | None) -> Backdoor:
        if backdoor is None:
            pytest.skip(NO_BACKDOOR)
        return backdoor

    # --- realistic page sizes -------------------------------------------------------------------

    @pytest.mark.parametrize("size", list(REALISTIC_PAGE_SIZES.values()), ids=list(REALISTIC_PAGE_SIZES))
    def test_roundtrip_realistic_page_size(
        self, store: Store, scope: KeyScope, rng: random.Random, backdoor: Backdoor | None, size: int
    ) -> None:
        """Pages as large as a real model's round-trip whole, with or without a declared max_value_size."""
        limit = store.capabilities.max_value_size
        if limit is not None and size > limit:
            pytest.skip(f"unsupported: a {size}-byte page is above the declared max_value_size of {limit}")
        keys = [scope.key(random_hash(rng)) for _ in range(2)]
        known = {key_digest(k): k for k in keys}
        pages = [page_for(k, size) for k in keys]
        assert store.put(keys, pages) == [True, True], f"put of two {size}-byte pages"
        assert store.exists(keys) == [True, True]
        targets = [bytearray(size) for _ in keys]
        assert store.get_into(keys, targets) == [True, True], f"a stored {size}-byte page read as a miss"
        for key, target in zip(keys, targets):
            check_page(target, key, known=known)
        assert store.get(keys[:1], size - 1) == [None], "a read one byte shorter than the page must be a miss"
        if backdoor is not None:
            for key, page in zip(keys, pages):
                assert_same_bytes(backdoor.get(key), page, f"the {size}-byte page is stored as other bytes (seen through the backdoor)")

    # --- the caller's buffers -------------------------------------------------------------------

    def test_put_keeps_no_reference_to_the_callers_buffer(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """A host pool reuses a page's memory as soon as put returns: the stored page must not follow it."""
        size = self.page_size_bytes
        keys = [scope.key(random_hash(rng)) for _ in range(3)]
        pool = bytearray(len(keys) * size)
        view = memoryview(pool)
        for i, key in enumerate(keys):
            view[i * size : (i + 1) * size] = page_for(key, size)
        halves = [[view[i * size : i * size + size // 2], view[i * size + size // 2 : (i + 1) * size]] for i in (1, 2)]
        assert store.put_from(keys, [view[:size], *halves]) == [True] * 3
        pool[:] = bytes(len(pool))
        for key, value in zip(keys, store.get(keys, size)):
            assert value is not None, "a stored page read as a miss"
            check_page(value, key)

    def test_get_leaves_the_target_alone_once_it_returns(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """A target is the caller's again when get returns: later writes of its key do not reach it."""
        size = self.page_size_bytes
        key = scope.key(random_hash(rng))
        assert store.put([key], [page_for(key, size, 0)]) == [True]
        target = bytearray(size)
        assert store.get_into([key], [target]) == [True]
        assert store.put([key], [page_for(key, size, 1)]) == [True]
        assert_same_bytes(store.get([key], size), [page_for(key, size, 1)], "the rewritten page")
        check_page(target, key, versions=(0,))

    # --- the independent read/write path (backdoor) ---------------------------------------------

    def test_backdoor_sees_what_put_stored(
        self, store: Store, scope: KeyScope, rng: random.Random, backdoor: Backdoor | None
    ) -> None:
        """What put stored is the caller's bytes under the caller's key, read without the connector."""
        backdoor = self.require_backdoor(backdoor)
        sizes, digits = (1, 4096, 65543), (8, 128, 64)
        keys = [scope.key(random_hash(rng, n)) for n in digits]
        pages = [page_for(k, size) for k, size in zip(keys, sizes)]
        segmented = [[page[: len(page) // 3], page[len(page) // 3 :]] for page in pages]
        assert store.put_from(keys, segmented) == [True] * len(keys)
        for key, page in zip(keys, pages):
            assert_same_bytes(backdoor.get(key), page, f"the {len(page)}-byte page is stored as other bytes")
        assert backdoor.get(scope.key(random_hash(rng))) is None

    def test_get_and_exists_serve_what_the_backdoor_stored(
        self, store: Store, scope: KeyScope, rng: random.Random, backdoor: Backdoor | None
    ) -> None:
        """Reads are checked against bytes the connector did not write itself."""
        backdoor = self.require_backdoor(backdoor)
        size = self.page_size_bytes
        keys = [scope.key(random_hash(rng)) for _ in range(3)]
        for key in keys[:2]:
            backdoor.set(key, page_for(key, size))
        assert store.exists(keys) == [True, True, False]
        got = store.get(keys, size)
        assert got[2] is None
        for key, value in zip(keys[:2], got):
            assert value is not None, "a page stored through the backdoor read as a miss"
            check_page(value, key)

    def test_delete_removes_what_the_backdoor_sees(
        self, store: Store, scope: KeyScope, rng: random.Random, backdoor: Backdoor | None
    ) -> None:
        self.require(store, "delete")
        backdoor = self.require_backdoor(backdoor)
        keep, gone = scope.key(random_hash(rng)), scope.key(random_hash(rng))
        assert store.put([keep, gone], [page_for(keep, 512), page_for(gone, 512)]) == [True, True]
        assert store.delete([gone]) == [True]
        assert backdoor.get(gone) is None, "delete reported success, but the page is still stored"
        assert_same_bytes(backdoor.get(keep), page_for(keep, 512), "delete of one key changed another")
