"""Clauses that prove a declared capability, not only its type: each runs where it is declared.

Where a capability is not declared the clause is skipped with a reason starting ``unsupported:``.
Mixed into :class:`~hicache_storage.conformance.suite.ConformanceTests`.
"""

from __future__ import annotations

import json
import mmap
import random
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from hicache_storage.connector import Level
from hicache_storage.store import Store
from hicache_storage.conformance.clauses import Clauses
from hicache_storage.conformance.pages import check_page, key_digest, page_for, random_hash
from hicache_storage.keys import KeyScope, PageKey

#: Bytes of the page the zero-copy clauses move; a staged copy of it shows in the allocations.
ZERO_COPY_PAGE_BYTES = 8 * 2**20
#: Largest declared capacity the suite fills (it writes twice the capacity in one put).
MAX_TESTED_CAPACITY = 256 * 2**20
HOOKS = ("_exists", "_get_into", "_put_from", "_delete")




@dataclass(frozen=True)
class HookCall:
    level: int  # 0 is the top of the store's stack; the last level is the connector itself
    hook: str
    keys: int
    #: Keys of the call on the same backend this one was made from (``None``: made from above).
    within: int | None


@contextmanager
def hook_calls(store: Store) -> Iterator[list[HookCall]]:
    """Record every hook call at every level of the store's stack, and which call it was made from."""
    calls: list[HookCall] = []
    spied: list[tuple[Level, str]] = []
    for level, backend in enumerate(store.levels()):
        active = threading.local()
        for name in HOOKS:
            hook = getattr(backend, name)

            def spy(keys: list[PageKey], *rest: Any, _hook: Any = hook, _name: str = name, _level: int = level, _active: Any = active) -> Any:
                outer = getattr(_active, "keys", None)
                calls.append(HookCall(_level, _name, len(keys), outer))
                _active.keys = len(keys)
                try:
                    return _hook(keys, *rest)
                finally:
                    _active.keys = outer

            setattr(backend, name, spy)
            spied.append((backend, name))
    try:
        yield calls
    finally:
        for backend, name in spied:
            delattr(backend, name)


def peak_allocation(action: Callable[[], object]) -> tuple[object, int]:
    """Run ``action``; return its result and the peak of Python-allocated memory while it ran."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = action()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak


class PeerProcess:
    """The other process of the cross-process clauses (``python -m hicache_storage.conformance.peer``)."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.stderr = ""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hicache_storage.conformance.peer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()

    def answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None  # a pipe: opened in __init__
        line = self.process.stdout.readline()
        if not line:
            self.finish()
            raise AssertionError(f"the peer process failed:\n{self.stderr[-3000:]}")
        return json.loads(line)

    def finish(self) -> int:
        """Tell the peer to close its backend and exit; its exit status."""
        try:
            _, self.stderr = self.process.communicate("exit\n", timeout=180)
        except (BrokenPipeError, ValueError):
            self.stderr = self.process.stderr.read() if self.process.stderr else ""
            self.process.wait(timeout=180)
        return self.process.returncode


class CapabilityClauses(Clauses):
    """Every declared capability is shown to hold."""

    # --- ttl ------------------------------------------------------------------------------------

    @pytest.fixture
    def ttl_backend_config(self, store: Store, backend_config: dict[str, Any]) -> tuple[dict[str, Any], float] | None:
        """A config under which pages expire, and their time to live in seconds.

        Default: the connector's ``ttl_seconds`` config field set to 1. Override it for a
        connector whose expiry is configured otherwise; ``None`` means it cannot be configured.
        """
        connector = store.levels()[-1]
        if "ttl_seconds" in getattr(type(connector).Config, "model_fields", {}):
            return {**backend_config, "ttl_seconds": 1}, 1.0
        return None

    @pytest.mark.slow
    def test_ttl_expires_pages(
        self,
        store: Store,
        open_backend: Callable[..., Store],
        ttl_backend_config: tuple[dict[str, Any], float] | None,
        scope: KeyScope,
        rng: random.Random,
    ) -> None:
        """A backend that declares ttl lets a page expire: it becomes a miss, never other bytes."""
        self.require(store, "ttl")
        if ttl_backend_config is None:
            pytest.fail(
                "the backend declares ttl, but the suite cannot configure an expiry: override the "
                "`ttl_backend_config` fixture to return (config, seconds)",
                pytrace=False,
            )
        config, seconds = ttl_backend_config
        expiring = open_backend(config)
        key = scope.key(random_hash(rng))
        written = time.monotonic()
        assert expiring.put([key], [page_for(key, 4096)]) == [True]
        [value] = expiring.get([key], 4096)
        if time.monotonic() - written < seconds:
            assert value is not None, "a page read back before its time to live ran out was a miss"
        if value is not None:
            check_page(value, key)
        deadline = written + 5 * seconds + 5
        while expiring.exists([key]) == [True] and time.monotonic() < deadline:
            time.sleep(seconds / 4)
        assert expiring.exists([key]) == [False], f"a page with a {seconds} s time to live still exists {5 * seconds + 5} s later"
        assert expiring.get([key], 4096) == [None]

    # --- zero copy ------------------------------------------------------------------------------

    def test_zero_copy_read_fills_the_target_itself(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """A zero-copy read lands in the caller's (page-aligned) buffer with no page-sized copy in Python."""
        self.require(store, "zero_copy_read")
        size = min(ZERO_COPY_PAGE_BYTES, store.capabilities.max_value_size or ZERO_COPY_PAGE_BYTES)
        key = scope.key(random_hash(rng))
        assert store.put([key], [page_for(key, size)]) == [True]
        target = mmap.mmap(-1, size)
        try:
            hits, peak = peak_allocation(lambda: store.get_into([key], [memoryview(target)]))
            assert hits == [True]
            check_page(target[:], key)
        finally:
            target.close()
        assert peak < size // 2, f"a zero-copy read of a {size}-byte page allocated {peak} bytes in Python: a staged copy"

    def test_zero_copy_write_takes_the_source_itself(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """A zero-copy write reads the caller's (page-aligned) buffer with no page-sized copy in Python."""
        self.require(store, "zero_copy_write")
        size = min(ZERO_COPY_PAGE_BYTES, store.capabilities.max_value_size or ZERO_COPY_PAGE_BYTES)
        key = scope.key(random_hash(rng))
        source = mmap.mmap(-1, size)
        try:
            source[:] = page_for(key, size)
            stored, peak = peak_allocation(lambda: store.put_from([key], [memoryview(source)]))
        finally:
            source.close()
        assert stored == [True]
        assert peak < size // 2, f"a zero-copy write of a {size}-byte page allocated {peak} bytes in Python: a staged copy"
        [value] = store.get([key], size)
        check_page(value, key)

    # --- batching -------------------------------------------------------------------------------

    def test_native_batch_exists_is_one_call_per_batch(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """The connector answers exists for a batch in one call: it never splits the batch into
        smaller calls of its own hooks (key by key). Spies on every hook of the connector."""
        self.require(store, "native_batch_exists")
        step = store.capabilities.max_batch or 24
        if step == 1:
            pytest.skip("unsupported: max_batch is 1, so every exists call is one key")
        keys = [scope.key(random_hash(rng)) for _ in range(min(24, 2 * step))]
        stored = keys[::2]
        assert store.put(stored, [page_for(k, 256) for k in stored]) == [True] * len(stored)
        connector = len(store.levels()) - 1
        with hook_calls(store) as calls:
            assert store.exists(keys) == [i % 2 == 0 for i in range(len(keys))]
        answered = [c for c in calls if c.level == connector and c.within is None]
        split = [c for c in calls if c.level == connector and c.within is not None and c.keys < c.within]
        assert answered, "exists never reached the connector's hooks"
        assert not split, (
            f"the connector answered exists of {answered[0].keys} keys with {len(split)} smaller calls of its own hooks "
            f"({split[0].hook} of {split[0].keys} keys first): not one round trip per batch"
        )

    def test_max_batch_full_batches_round_trip(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """Batches of exactly max_batch keys, and one more, work for every operation (the limit is honest)."""
        limit = store.capabilities.max_batch
        if limit is None:
            pytest.skip("unsupported: no max_batch declared")
        keys = [scope.key(random_hash(rng)) for _ in range(limit + 1)]
        known = {key_digest(k): k for k in keys}
        with hook_calls(store) as calls:
            assert store.put(keys, [page_for(k, 128) for k in keys]) == [True] * len(keys)
            assert store.exists(keys) == [True] * len(keys)
            for key, value in zip(keys, store.get(keys, 128)):
                check_page(value, key, known=known)
            if store.capabilities.delete:
                assert store.delete(keys) == [True] * len(keys)
                assert store.exists(keys) == [False] * len(keys)
        assert max(c.keys for c in calls if c.level == 0) == limit

    # --- persistence and processes ----------------------------------------------------------------

    def peer_request(self, backend_name: str, backend_config: dict[str, Any], backend_layers: Any, scope: KeyScope) -> dict[str, Any]:
        return {"backend": backend_name, "config": backend_config, "layers": backend_layers, "namespace": scope.namespace.describe()}

    @pytest.mark.slow
    def test_visible_across_processes(
        self,
        store: Store,
        backend_name: str,
        backend_config: dict[str, Any],
        backend_layers: list[dict[str, Any]] | None,
        scope: KeyScope,
        rng: random.Random,
    ) -> None:
        """shared_across_processes: another live process reads this one's page, and this one reads
        the page the other wrote while the other still runs."""
        self.require(store, "shared_across_processes")
        ours, theirs = scope.key(random_hash(rng)), scope.key(random_hash(rng))
        assert store.put([ours], [page_for(ours, 4096)]) == [True]
        request = self.peer_request(backend_name, backend_config, backend_layers, scope)
        peer = PeerProcess({**request, "read": ours.page_hash, "write": theirs.page_hash, "size": 4096, "stay": True})
        try:
            answer = peer.answer()
            assert answer["read"] == page_for(ours, 4096).hex(), "the other process did not read what this one wrote"
            [value] = store.get([theirs], 4096)
            assert value is not None, "this process did not see the page the other (still running) process wrote"
            check_page(value, theirs)
        finally:
            code = peer.finish()
        assert code == 0, f"the peer process failed:\n{peer.stderr[-3000:]}"

    @pytest.mark.slow
    def test_pages_outlive_their_writer_process(
        self,
        store: Store,
        open_backend: Callable[..., Store],
        backend_name: str,
        backend_config: dict[str, Any],
        backend_layers: list[dict[str, Any]] | None,
        scope: KeyScope,
        rng: random.Random,
    ) -> None:
        """outlives_writer: pages another process wrote stay readable after that process exits."""
        self.require(store, "outlives_writer")
        theirs = scope.key(random_hash(rng))
        request = self.peer_request(backend_name, backend_config, backend_layers, scope)
        peer = PeerProcess({**request, "read": theirs.page_hash, "write": theirs.page_hash, "size": 4096, "stay": False})
        answer = peer.answer()
        code = peer.finish()
        assert code == 0, f"the peer process failed:\n{peer.stderr[-3000:]}"
        assert answer["wrote"] == page_for(theirs, 4096).hex()
        for reader, label in ((store, "an instance open while it ran"), (open_backend(), "a new instance")):
            [value] = reader.get([theirs], 4096)
            assert value is not None, f"a page another process wrote was gone for {label} after the writer exited"
            check_page(value, theirs)

    def test_persistence_across_instances(
        self, store: Store, open_backend: Callable[..., Store], scope: KeyScope, rng: random.Random
    ) -> None:
        """persistent: a new instance sees the last version of each page, and not the deleted ones."""
        self.require(store, "persistent")
        keys = [scope.key(random_hash(rng)) for _ in range(3)]
        assert store.put(keys, [page_for(k, 4096, 0) for k in keys]) == [True] * 3
        assert store.put(keys[1:2], [page_for(keys[1], 4096, 1)]) == [True]
        if store.capabilities.delete:
            assert store.delete(keys[2:]) == [True]
        store.close()
        reopened = open_backend()
        got = reopened.get(keys, 4096)
        check_page(got[0], keys[0], versions=(0,))
        check_page(got[1], keys[1], versions=(1,))
        if reopened.capabilities.delete:
            assert got[2] is None, "a deleted page came back in a new instance"
        if reopened.capabilities.clear:
            reopened.clear(scope.namespace)

    # --- capacity -------------------------------------------------------------------------------

    def test_capacity_is_kept_and_a_prefix_keeps_its_head(self, store: Store, scope: KeyScope, rng: random.Random) -> None:
        """capacity_bytes: one put of twice the capacity leaves at most the capacity stored, and what
        stays is the head of the batch (a prefix is useless without its first pages)."""
        capacity = store.capabilities.capacity_bytes
        if capacity is None:
            pytest.skip("unsupported: no capacity_bytes declared")
        if capacity > MAX_TESTED_CAPACITY:
            pytest.skip(f"capacity_bytes {capacity} is above the {MAX_TESTED_CAPACITY} bytes the suite fills")
        pages = 64
        size = max(1, min(capacity // (pages // 2), store.capabilities.max_value_size or capacity))
        for round_ in range(2):
            keys = [scope.key(random_hash(rng)) for _ in range(pages)]
            known = {key_digest(k): k for k in keys}
            store.put(keys, [page_for(k, size) for k in keys])
            present = store.exists(keys)
            kept = sum(present)
            assert kept * size <= capacity, f"{kept} pages of {size} bytes stored under a capacity of {capacity} bytes"
            head = store.prefix_exists(keys)
            assert head > 0, f"put {round_ + 1}: the head of the prefix was evicted (kept pages {_runs(present)})"
            assert head == kept, f"put {round_ + 1}: kept pages {_runs(present)} are not the head of the prefix"
            for key, value in zip(keys[:head], store.get(keys[:head], size)):
                assert value is not None, "a page the store reported present read as a miss"
                check_page(value, key, known=known)


def _runs(flags: list[bool]) -> str:
    """Indices of the True flags as ranges, e.g. ``0-29, 40``."""
    spans: list[str] = []
    start = None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            spans.append(f"{start}-{i - 1}" if i - 1 > start else str(start))
            start = None
    return ", ".join(spans) or "none"

