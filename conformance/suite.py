"""The conformance suite: behaviour every connector must show, as one pytest base class.

Use it from your own tests::

    from hicache_storage.conformance import ConformanceTests

    class TestMyStore(ConformanceTests):
        backend = "mystore"                  # registry name or "package.module:Class"

        @pytest.fixture
        def backend_config(self, my_server):  # a JSON-serializable config
            return {"url": my_server.url}

or from the command line: ``hicache-storage conformance NAME --config JSON``.

Clauses that need a capability the backend does not declare are skipped with a reason starting
``unsupported:``; the suite then checks that the operation raises ``UnsupportedOperationError``
instead. Every test uses a fresh random namespace, so runs against a shared server never
interfere, and clears it afterwards where the backend can.

Optional fixtures a connector's test class may override: ``backdoor`` (an independent read/write
path into the store, :mod:`~hicache_storage.conformance.backdoor`) and ``ttl_backend_config``
(a config under which pages expire, for a backend that declares ``ttl``). The clauses live in
one mixin per concept: this module's core, ``clauses_identity``, ``clauses_bytes``,
``clauses_capabilities`` and ``clauses_concurrency``; ``clauses`` holds their base (the page size
``page_size_bytes`` and the helpers ``require`` and ``write``).
"""

from __future__ import annotations

import ctypes
import random
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, ClassVar

import pytest

from hicache_storage.buffers import RawBuffer
from hicache_storage.capabilities import Capabilities
from hicache_storage.compat import conformance_layers_by_old_names
from hicache_storage.conformance.backdoor import Backdoor, builtin_backdoor
from hicache_storage.conformance.clauses import Clauses
from hicache_storage.conformance.clauses_bytes import ByteClauses
from hicache_storage.conformance.clauses_capabilities import CapabilityClauses
from hicache_storage.conformance.clauses_concurrency import ConcurrencyClauses
from hicache_storage.conformance.clauses_identity import SHARD_VARIANTS, IdentityClauses
from hicache_storage.conformance.pages import assert_same_bytes, random_hash
from hicache_storage.errors import (
    BackendClosedError,
    InvalidArgumentError,
    InvalidKeyError,
    StorageError,
    UnsupportedOperationError,
    ValueTooLargeError,
)
from hicache_storage.keys import KeyScope, Namespace, PageKey, Shard
from hicache_storage.multipool import HitPolicy, MultiPoolStore, PoolSpec
from hicache_storage.spec import open_store, store_spec
from hicache_storage.store import Store

#: Largest ``max_value_size`` the suite writes in full to prove the limit is honest.
MAX_TESTED_VALUE_SIZE = 64 * 2**20

# Every field of the identity, and a changed value for it: pages must never cross any of them.
NAMESPACE_VARIANTS: dict[str, Any] = {
    "model": "other-model",
    "revision": "rev-2",
    "kv_dtype": "float8_e4m3fn",
    "page_size": 32,
    "layout": "layer_first",
    "tenant": "tenant-b",
    "format_version": 2,
}


# A hybrid model's pools: full-attention KV and an indexer need every page before the cut, a
# sliding window its last 2 pages, a recurrent checkpoint its last page.
HYBRID_POOLS = (
    PoolSpec("kv"),
    PoolSpec("indexer"),
    PoolSpec("swa", HitPolicy.TRAILING_PAGES, trailing_pages=2),
    PoolSpec("mamba", HitPolicy.TRAILING_PAGES, trailing_pages=1),
)
#: Bytes of one page of one pool in the multi-pool clauses (small: they write many pages).
POOL_PAGE_BYTES = 256


def restorable_cut(pools: tuple[PoolSpec, ...], presence: dict[str, list[bool]]) -> int:
    """The suite's own model of the longest cut: the largest c whose needed pages every pool holds."""
    pages = len(presence[pools[0].name])
    for cut in range(pages, -1, -1):
        first = {spec.name: 0 if spec.hit_policy is HitPolicy.ALL_PAGES else max(0, cut - spec.trailing_pages) for spec in pools}
        if all(all(presence[name][first[name] : cut]) for name in first):
            return cut
    raise AssertionError("cut 0 needs no page, so some cut is always restorable")


def page_bytes(rng: random.Random, size: int, pattern: str = "random") -> bytes:
    if pattern == "zeros":
        return bytes(size)
    if pattern == "ones":
        return b"\xff" * size
    if pattern == "counter":
        return bytes(i % 251 for i in range(size))
    return rng.randbytes(size)


class CoreClauses(Clauses):
    """Round trips, per-key results, batches, prefix semantics, overwrite, delete, clear, isolation,
    exact bytes, declared limits, bad input, the model-based test and multi-pool storage."""

    # --- round trips --------------------------------------------------------------------------

    @pytest.mark.parametrize("size", [1, 4095, 4096, 65543, 2**20])
    @pytest.mark.parametrize("pattern", ["zeros", "ones", "counter", "random"])
    def test_roundtrip(self, store: Store, scope: KeyScope, rng: random.Random, size: int, pattern: str) -> None:
        keys = [scope.key(random_hash(rng)) for _ in range(3)]
        values = [page_bytes(rng, size, pattern) for _ in keys]
        self.write(store, keys, values)
        assert_same_bytes(store.get(keys, size), values, f"{size}-byte {pattern} pages read back")

    def test_roundtrip_segments(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """A page written as K and V halves reads back into any other split of the same bytes."""
        key = scope.key(random_hash(rng))
        k_half, v_half = rng.randbytes(3000), rng.randbytes(5192)
        assert store.put_from([key], [[k_half, memoryview(v_half)]]) == [True]
        first, second, third = bytearray(100), bytearray(7000), bytearray(1092)
        assert store.get_into([key], [[first, second, third]]) == [True]
        assert bytes(first + second + third) == k_half + v_half

    def test_raw_buffer_roundtrip(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """Pages given as (address, size), as SGLang's host pool hands them out."""
        key = scope.key(random_hash(rng))
        data = rng.randbytes(self.page_size_bytes)
        source = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
        target = (ctypes.c_ubyte * len(data))()
        assert store.put_from([key], [RawBuffer(ctypes.addressof(source), len(data))]) == [True]
        assert store.get_into([key], [RawBuffer(ctypes.addressof(target), len(data))]) == [True]
        assert_same_bytes(bytes(target), data, "the page read into the raw buffer")

    def test_registered_buffer_roundtrip(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """I/O from and into memory announced with register_buffer (a host pool) is exact."""
        pool = bytearray(8 * self.page_size_bytes)
        store.register_buffer(pool)
        view = memoryview(pool)
        keys = [scope.key(random_hash(rng)) for _ in range(4)]
        values = [rng.randbytes(self.page_size_bytes) for _ in keys]
        size = self.page_size_bytes
        for i, value in enumerate(values):
            view[i * size : (i + 1) * size] = value
        assert store.put_from(keys, [view[i * size : (i + 1) * size] for i in range(4)]) == [True] * 4
        assert store.get_into(keys, [view[(4 + i) * size : (5 + i) * size] for i in range(4)]) == [True] * 4
        assert_same_bytes([view[(4 + i) * size : (5 + i) * size] for i in range(4)], values, "pages read into the registered buffer")

    # --- per-key results ----------------------------------------------------------------------

    def test_misses_are_per_key(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        keys = [scope.key(random_hash(rng)) for _ in range(6)]
        written = {0, 2, 3}
        values = {i: rng.randbytes(self.page_size_bytes) for i in written}
        self.write(store, [keys[i] for i in sorted(written)], [values[i] for i in sorted(written)])
        expected = [i in written for i in range(6)]
        assert store.exists(keys) == expected
        assert_same_bytes(store.get(keys, self.page_size_bytes), [values.get(i) for i in range(6)], "pages and misses read back")

    def test_batch_order(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        keys = [scope.key(random_hash(rng)) for _ in range(40)]
        values = [rng.randbytes(512) for _ in keys]
        self.write(store, keys, values)
        order = list(range(40))
        rng.shuffle(order)
        assert store.get([keys[i] for i in order], 512) == [values[i] for i in order]

    def test_duplicate_keys_in_batch(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        a, b = scope.key(random_hash(rng)), scope.key(random_hash(rng))
        value_a = rng.randbytes(1024)
        assert store.put([a, a], [value_a, value_a]) == [True, True]
        assert store.exists([a, b, a]) == [True, False, True]
        assert store.get([a, b, a], 1024) == [value_a, None, value_a]

    def test_empty_batches(self, store: Store) -> None:
        assert store.put_from([], []) == []
        assert store.exists([]) == []
        assert store.get_into([], []) == []
        assert store.prefix_exists([]) == 0
        if store.capabilities.delete:
            assert store.delete([]) == []

    def test_result_count_equals_request_count(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """300 pages: more than any sensible max_batch, so the SDK's batch splitting is exercised too."""
        keys = [scope.key(random_hash(rng)) for _ in range(300)]
        values = [rng.randbytes(64) for _ in keys]
        assert len(store.put(keys, values)) == 300
        assert len(store.exists(keys)) == 300
        assert store.get(keys, 64) == values

    def test_hooks_never_see_more_than_max_batch(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        limit = store.capabilities.max_batch
        if limit is None:
            pytest.skip("unsupported: no max_batch declared, so any batch size is allowed")
        seen: list[int] = []
        top = store.top  # the store splits batches before it calls the top of its stack
        for hook_name in ("_exists", "_get_into", "_put_from"):
            hook = getattr(top, hook_name)

            def spy(keys: list[PageKey], *rest: Any, _hook: Any = hook) -> list[bool]:
                seen.append(len(keys))
                return _hook(keys, *rest)

            setattr(top, hook_name, spy)
        keys = [scope.key(random_hash(rng)) for _ in range(2 * limit + 3)]
        store.put(keys, [b"x" * 16] * len(keys))
        store.exists(keys)
        store.get(keys, 16)
        assert seen and max(seen) <= limit

    # --- SGLang's prefix semantics ------------------------------------------------------------

    @pytest.mark.parametrize(
        ("missing", "expected"),
        [((), 10), ((0,), 0), ((4,), 4), ((9,), 9), ((4, 7), 4), (tuple(range(10)), 0)],
        ids=["no-hole", "hole-at-head", "hole-in-middle", "hole-at-tail", "two-holes", "all-missing"],
    )
    def test_prefix_exists(
        self, store: Store, scope: KeyScope, rng: random.Random, missing: tuple[int, ...], expected: int
    ) -> None:
        keys = [scope.key(random_hash(rng)) for _ in range(10)]
        present = [k for i, k in enumerate(keys) if i not in missing]
        if present:
            self.write(store, present, [b"p" * 128] * len(present))
        assert store.prefix_exists(keys) == expected

    # --- overwrite, delete, clear -------------------------------------------------------------

    def test_overwrite(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        key = scope.key(random_hash(rng))
        old, new = rng.randbytes(4096), rng.randbytes(4096)
        self.write(store, [key], [old])
        self.write(store, [key], [new])
        assert store.get([key], 4096) == [new]

    def test_overwrite_with_other_length(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        key = scope.key(random_hash(rng))
        self.write(store, [key], [rng.randbytes(4096)])
        new = rng.randbytes(1000)
        self.write(store, [key], [new])
        assert store.get([key], 1000) == [new]
        assert store.get([key], 4096) == [None]

    def test_delete(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        if not store.capabilities.delete:
            with pytest.raises(UnsupportedOperationError):
                store.delete([scope.key(random_hash(rng))])
            pytest.skip("unsupported: delete (checked that it raises UnsupportedOperationError)")
        keep, gone = scope.key(random_hash(rng)), scope.key(random_hash(rng))
        self.write(store, [keep, gone], [b"k" * 256, b"g" * 256])
        assert store.delete([gone]) == [True]
        assert store.delete([gone]) == [False], "a second delete of the same key must report it absent"
        assert store.exists([keep, gone]) == [True, False]
        assert store.get([gone], 256) == [None]

    def test_clear_is_scoped_to_its_namespace(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        other = KeyScope(Namespace(model=f"conformance-{uuid.uuid4().hex[:12]}", kv_dtype="bfloat16", page_size=64))
        if not store.capabilities.clear:
            with pytest.raises(UnsupportedOperationError):
                store.clear(scope.namespace)
            pytest.skip("unsupported: clear (checked that it raises UnsupportedOperationError)")
        try:
            mine = [scope.key(random_hash(rng)), scope.with_part("v").key(random_hash(rng))]
            mine.append(KeyScope(scope.namespace, Shard(tp_rank=1, tp_size=2)).key(random_hash(rng)))
            theirs = [other.key(random_hash(rng))]
            self.write(store, mine + theirs, [b"c" * 300] * 4)
            store.clear(scope.namespace)
            assert store.exists(mine) == [False, False, False], "clear must remove every shard and part of its namespace"
            assert store.get(theirs, 300) == [b"c" * 300], "clear removed another namespace's page"
        finally:
            store.clear(other.namespace)

    # --- isolation ----------------------------------------------------------------------------

    @pytest.mark.parametrize("field", [*NAMESPACE_VARIANTS, *SHARD_VARIANTS, "part"])
    def test_isolation(self, store: Store, scope: KeyScope, rng: random.Random, field: str) -> None:
        """The same page hash under an identity that differs in one field is another page."""
        if field in NAMESPACE_VARIANTS:
            other = KeyScope(replace(scope.namespace, **{field: NAMESPACE_VARIANTS[field]}), scope.shard, scope.part)
        elif field in SHARD_VARIANTS:
            other = KeyScope(scope.namespace, SHARD_VARIANTS[field], scope.part)
        else:
            other = scope.with_part("v")
        page_hash = random_hash(rng)
        mine, theirs = scope.key(page_hash), other.key(page_hash)
        try:
            self.write(store, [mine], [b"A" * 1024])
            assert store.exists([theirs]) == [False]
            assert store.get([theirs], 1024) == [None]
            self.write(store, [theirs], [b"B" * 1024])
            assert store.get([mine, theirs], 1024) == [b"A" * 1024, b"B" * 1024]
        finally:
            if store.capabilities.clear and other.namespace != scope.namespace:
                store.clear(other.namespace)

    # --- exact bytes --------------------------------------------------------------------------

    def test_read_writes_exactly_the_target(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """Zero-copy reads fill the target and not one byte around it, on hits and on misses."""
        hit, miss = scope.key(random_hash(rng)), scope.key(random_hash(rng))
        value = rng.randbytes(4096)
        self.write(store, [hit], [value])
        arena = bytearray(b"\xa5" * (3 * 4096))
        view = memoryview(arena)
        assert store.get_into([hit, miss], [view[1000:5096], view[6000:10096]]) == [True, False]
        assert arena[1000:5096] == value
        assert arena[:1000] == b"\xa5" * 1000
        assert arena[5096:6000] == b"\xa5" * 904
        assert arena[10096:] == b"\xa5" * (len(arena) - 10096)

    @pytest.mark.parametrize("delta", [-1, 1])
    def test_length_mismatch_is_a_miss(self, store: Store, scope: KeyScope, rng: random.Random, delta: int) -> None:
        key = scope.key(random_hash(rng))
        self.write(store, [key], [rng.randbytes(4096)])
        assert store.get_into([key], [bytearray(4096 + delta)]) == [False]

    # --- declared capabilities ----------------------------------------------------------------

    def test_capabilities_are_declared(self, store: Store) -> None:
        assert isinstance(store.capabilities, Capabilities)

    def test_max_value_size_is_honest(self, store: Store, scope: KeyScope) -> None:
        limit = store.capabilities.max_value_size
        if limit is None:
            pytest.skip("unsupported: no max_value_size declared")
        key = scope.key("%064x" % 1)
        # The SDK refuses by size before reading a byte, so a view that claims limit + 1 bytes over
        # a small real buffer proves the refusal without allocating a limit-sized page.
        small = (ctypes.c_ubyte * 1)()
        with pytest.raises(ValueTooLargeError):
            store.put_from([key], [RawBuffer(ctypes.addressof(small), limit + 1)])
        assert store.exists([key]) == [False]
        if limit > MAX_TESTED_VALUE_SIZE:
            pytest.skip(f"max_value_size {limit} is above the {MAX_TESTED_VALUE_SIZE} bytes the suite writes in full")
        assert store.put([key], [bytes(limit)]) == [True]
        assert store.exists([key]) == [True]

    # --- bad input ----------------------------------------------------------------------------

    def test_rejects_non_key(self, store: Store) -> None:
        with pytest.raises(InvalidKeyError):
            store.exists(["not-a-key"])  # type: ignore[list-item]  # a str on purpose: the store must refuse it

    def test_rejects_mismatched_buffers(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        keys = [scope.key(random_hash(rng)) for _ in range(2)]
        with pytest.raises(InvalidArgumentError):
            store.put(keys, [b"x"])
        with pytest.raises(InvalidArgumentError):
            store.get_into(keys, [bytearray(1)])

    def test_rejects_read_only_target(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        with pytest.raises(InvalidArgumentError):
            store.get_into([scope.key(random_hash(rng))], [b"read-only bytes"])

    # --- the error contract -------------------------------------------------------------------

    def test_only_storage_errors_escape(self, open_backend: Callable[..., Store], scope: KeyScope, rng: random.Random) -> None:
        """Every failure is a ``StorageError`` with a status (:mod:`hicache_storage.errors`), never a
        bare Python exception. Calls at the edges, on a store that saw nothing before them (a
        connector may size itself from its first put), either return or raise one; a ``ValueError``
        or ``ZeroDivisionError`` from a connector fails this clause by name."""
        store = open_backend()
        first, second, absent = (scope.key(random_hash(rng)) for _ in range(3))
        page = self.page_size_bytes
        calls: list[tuple[str, Callable[[], object]]] = [
            ("an empty put as the store's first call", lambda: store.put_from([], [])),
            ("an empty exists", lambda: store.exists([])),
            ("an empty get", lambda: store.get_into([], [])),
            ("an empty prefix_exists", lambda: store.prefix_exists([])),
            ("an empty delete", lambda: store.delete([])),
            ("a zero-byte page as the first page put", lambda: store.put([first], [b""])),
            ("a zero-byte read of it", lambda: store.get_into([first], [bytearray(0)])),
            ("an exists of it", lambda: store.exists([first])),
            # Off the declared types on purpose (they say Sequence): a caller's iterators must be taken or refused with a StorageError.
            ("keys and pages given as one-shot iterators", lambda: store.put_from(iter([second]), iter([bytes(page)]))),  # type: ignore[arg-type]  # iterators on purpose
            ("a read into one-shot iterators", lambda: store.get_into(iter([second]), iter([bytearray(page)]))),  # type: ignore[arg-type]  # iterators on purpose
            ("a miss read into an empty target", lambda: store.get_into([absent], [bytearray(0)])),
            ("a miss read into a page", lambda: store.get_into([absent], [bytearray(page)])),
        ]
        untyped = []
        for what, call in calls:
            try:
                call()
            except StorageError:
                pass  # a typed refusal (unsupported, too large, ...) keeps the contract
            except Exception as exc:
                untyped.append(f"{what}: {type(exc).__name__}: {exc}")
        assert not untyped, (
            "untyped errors escaped the connector, not StorageErrors (raise a class of hicache_storage.errors, "
            "which carries a status): " + "; ".join(untyped)
        )

    def test_closed_backend_refuses_calls(self, open_backend: Callable[..., Store], scope: KeyScope, rng: random.Random) -> None:
        store = open_backend()
        store.close()
        store.close()  # idempotent
        with pytest.raises(BackendClosedError):
            store.exists([scope.key(random_hash(rng))])

    # --- model-based --------------------------------------------------------------------------

    @pytest.mark.slow
    def test_state_machine_matches_dict_model(self, store: Store, scope: KeyScope) -> None:
        from hypothesis import HealthCheck, settings
        from hypothesis.stateful import run_state_machine_as_test

        from hicache_storage.conformance.stateful import make_machine

        run_state_machine_as_test(
            make_machine(store, scope),
            settings=settings(
                max_examples=25,
                stateful_step_count=20,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            ),
        )

    # --- multi-pool storage (hybrid models: KV plus side pools) --------------------------------

    def hybrid_store(self, store: Store, scope: KeyScope) -> MultiPoolStore:
        return MultiPoolStore(store, scope, HYBRID_POOLS)

    def write_pools(self, pools: MultiPoolStore, chain: list[str], presence: dict[str, list[bool]]) -> None:
        for name, present in presence.items():
            pages = [h for h, here in zip(chain, present) if here]
            values = [(name.encode() + bytes.fromhex(h)).ljust(POOL_PAGE_BYTES, b"\0") for h in pages]
            assert pools.put(name, pages, values) == [True] * len(pages), f"put did not store every page of pool {name!r}"

    def test_multipool_pools_are_isolated(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """The same page hash in two pools names two values: each reads back its own bytes."""
        pools = self.hybrid_store(store, scope)
        page_hash = random_hash(rng)
        kv_value, swa_value = rng.randbytes(POOL_PAGE_BYTES), rng.randbytes(POOL_PAGE_BYTES)
        assert pools.put("kv", [page_hash], [kv_value]) == [True]
        assert pools.presence([page_hash]) == {"kv": [True], "indexer": [False], "swa": [False], "mamba": [False]}
        assert pools.put("swa", [page_hash], [swa_value]) == [True]
        targets = [bytearray(POOL_PAGE_BYTES) for _ in range(3)]
        assert pools.get_into("kv", [page_hash], targets[:1]) == [True]
        assert pools.get_into("swa", [page_hash], targets[1:2]) == [True]
        assert pools.get_into("mamba", [page_hash], targets[2:]) == [False]
        assert_same_bytes(targets[:2], [kv_value, swa_value], "the kv and swa pages of one hash")

    def test_multipool_delete_in_one_pool_leaves_the_others(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        self.require(store, "delete")
        pools = self.hybrid_store(store, scope)
        page_hash = random_hash(rng)
        values = {name: rng.randbytes(POOL_PAGE_BYTES) for name in pools.pools}
        for name, value in values.items():
            assert pools.put(name, [page_hash], [value]) == [True]
        assert store.delete(pools.keys("swa", [page_hash])) == [True]
        assert pools.presence([page_hash]) == {"kv": [True], "indexer": [True], "swa": [False], "mamba": [True]}
        for name in ("kv", "indexer", "mamba"):
            target = bytearray(POOL_PAGE_BYTES)
            assert pools.get_into(name, [page_hash], [target]) == [True]
            assert_same_bytes(target, values[name], f"deleting a swa page changed the {name} page")

    def test_multipool_checkpoint_is_stored_under_its_last_page(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """A recurrent checkpoint valid at cut c lives under page c - 1's hash: the prefix ends at the
        last cut with a checkpoint, even where later KV is stored."""
        pools = self.hybrid_store(store, scope)
        chain = [random_hash(rng) for _ in range(6)]
        full = [True] * 6
        self.write_pools(pools, chain, {"kv": full, "indexer": full, "swa": full, "mamba": [i in (1, 4) for i in range(6)]})
        assert pools.usable_pages(chain) == 5
        assert pools.usable_pages(chain[:4]) == 2

    def test_multipool_usable_pages_is_the_longest_cut(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """Random presence in every pool: the lookup equals the model's longest cut every pool accepts."""
        pools = self.hybrid_store(store, scope)
        for _ in range(4):
            chain = [random_hash(rng) for _ in range(8)]
            presence = {spec.name: [rng.random() < 0.85 for _ in chain] for spec in HYBRID_POOLS}
            self.write_pools(pools, chain, presence)
            assert pools.presence(chain) == presence
            assert pools.usable_pages(chain) == restorable_cut(HYBRID_POOLS, presence), presence

    def test_multipool_removing_any_side_page_shortens_the_hit(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """Delete any one page a side pool needs at the full cut: never a full hit with missing state."""
        self.require(store, "delete")
        pools = self.hybrid_store(store, scope)
        chain = [random_hash(rng) for _ in range(6)]
        full = {spec.name: [True] * len(chain) for spec in HYBRID_POOLS}
        self.write_pools(pools, chain, full)
        assert pools.usable_pages(chain) == len(chain)
        for spec in HYBRID_POOLS[1:]:
            needed = range(len(chain)) if spec.hit_policy is HitPolicy.ALL_PAGES else range(len(chain) - spec.trailing_pages, len(chain))
            for page in needed:
                assert store.delete(pools.keys(spec.name, [chain[page]])) == [True]
                presence = {**full, spec.name: [i != page for i in range(len(chain))]}
                usable = pools.usable_pages(chain)
                assert usable < len(chain), f"a full hit with page {page} of pool {spec.name!r} missing"
                assert usable == restorable_cut(HYBRID_POOLS, presence)
                self.write_pools(pools, chain, {spec.name: [i == page for i in range(len(chain))]})
        assert pools.usable_pages(chain) == len(chain)

    def test_multipool_sidecar_segments_round_trip(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """A draft model's KV rides as extra segments of the KV page: one value, saved and restored together."""
        pools = self.hybrid_store(store, scope)
        chain = [random_hash(rng) for _ in range(3)]
        pages = [[rng.randbytes(POOL_PAGE_BYTES), rng.randbytes(POOL_PAGE_BYTES), rng.randbytes(64), rng.randbytes(64)] for _ in chain]
        assert pools.put("kv", chain, pages) == [True] * 3
        targets = [[bytearray(len(segment)) for segment in page] for page in pages]
        assert pools.get_into("kv", chain, targets) == [True] * 3
        for index, (page, target_page) in enumerate(zip(pages, targets)):
            assert_same_bytes(target_page, page, f"the segments of page {index}")


class ConformanceTests(ConcurrencyClauses, CapabilityClauses, ByteClauses, IdentityClauses, CoreClauses):
    """Subclass with ``backend`` set and a ``backend_config`` fixture; pytest collects the rest.

    The clauses come from one mixin per concept; pytest runs them cheapest first (core, identity,
    bytes, capabilities, concurrency), so a run with ``-x`` stops early on a plain bug.
    """

    #: Registry name or ``package.module:Class`` of the backend under test.
    backend: ClassVar[str] = ""
    #: Layer specs the backend is opened under, innermost first (see ``hicache_storage.layers.stack_layers``).
    layers: ClassVar[list[dict[str, Any]] | None] = None
    #: Capability fields to override for this run: declare an emulator's gaps here, never as
    #: ``if emulator:`` in a test.
    capability_overrides: ClassVar[dict[str, Any]] = {}

    # --- fixtures -----------------------------------------------------------------------------

    @pytest.fixture
    def backend_name(self) -> str:
        """The backend under test; defaults to the ``backend`` class attribute."""
        if not self.backend:
            pytest.fail(f"{type(self).__name__}.backend is not set: name the backend under test", pytrace=False)
        return self.backend

    @pytest.fixture
    def backend_config(self) -> dict[str, Any]:
        """Override to give the backend's config (JSON-serializable: it is also sent to subprocesses)."""
        return {}

    @pytest.fixture
    def backend_layers(self, request: pytest.FixtureRequest) -> list[dict[str, Any]] | None:
        """Layer specs the backend is opened under; defaults to the ``layers`` class attribute.

        A test class written before layers had their name (a ``backend_wrappers`` fixture or a
        ``wrappers`` class attribute) still works, with a deprecation warning."""
        return conformance_layers_by_old_names(self, request) if self.layers is None else self.layers

    @pytest.fixture
    def open_backend(
        self, backend_name: str, backend_config: dict[str, Any], backend_layers: list[dict[str, Any]] | None
    ) -> Iterator[Callable[..., Store]]:
        """A factory of stores with the configuration under test (or the config it is given);
        each is closed afterwards."""
        opened: list[Store] = []

        def factory(config: dict[str, Any] | None = None) -> Store:
            store = self.make_backend(backend_name, backend_config if config is None else config, backend_layers)
            opened.append(store)
            return store

        yield factory
        for store in opened:
            store.close()

    @pytest.fixture
    def store(self, open_backend: Callable[..., Store]) -> Store:
        return open_backend()

    @pytest.fixture
    def backdoor(self, store: Store) -> Backdoor | None:
        """An independent read/write path into the store (see :mod:`~hicache_storage.conformance.backdoor`),
        or ``None``. Default: the one declared for the exact class of a store's connector when the
        store has no layers (every built-in connector has one; ``register_backdoor`` declares
        another). Override it to give your connector's (a raw client reading and writing the
        stored value)."""
        return builtin_backdoor(store)

    @pytest.fixture
    def rng(self, request: pytest.FixtureRequest) -> random.Random:
        return random.Random(request.node.nodeid)

    @pytest.fixture
    def namespace(self, store: Store) -> Iterator[Namespace]:
        namespace = Namespace(model=f"conformance-{uuid.uuid4().hex[:12]}", kv_dtype="bfloat16", page_size=64)
        yield namespace
        if store.capabilities.clear and not store.closed:
            store.clear(namespace)

    @pytest.fixture
    def scope(self, namespace: Namespace) -> KeyScope:
        return KeyScope(namespace)

    # --- helpers ------------------------------------------------------------------------------

    def make_backend(self, name: str, config: dict[str, Any], layers: list[dict[str, Any]] | None) -> Store:
        """The store under test: ``name`` with ``config`` under ``layers``, with this class's
        ``capability_overrides`` set on the connector (so every layer above sees them)."""
        return open_store(store_spec(name, config, layers, capability_overrides=self.capability_overrides))


