"""The hf3fs connector on a local directory standing in for a 3FS mount (no 3FS cluster here).

The slot index is tested both in-process and in a real Redis server (``redis_server``).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_storage.conformance import ConformanceTests
from hicache_storage.connectors.hf3fs import HF3FSBackend, usrbio_available
from hicache_storage.errors import BackendUnavailableError, ConfigError, MissingDependencyError, ValueTooLargeError
from hicache_storage.keys import KeyScope, Namespace, Shard
from hicache_storage.store import Store

SLOT = 4096


def conformance_config(root: Path) -> dict[str, Any]:
    # 512 sparse slots of 1 MiB: room for the suite's largest pages and its 300-page batch.
    return {"root": str(root), "file_size": 256 * 2**20, "numjobs": 2, "page_size_bytes": 2**20}


class TestHF3FSConformance(ConformanceTests):
    backend = "hf3fs"

    @pytest.fixture
    def backend_config(self, tmp_path: Path) -> dict[str, Any]:
        return conformance_config(tmp_path / "mount")


@pytest.mark.services
class TestHF3FSRedisIndexConformance(ConformanceTests):
    backend = "hf3fs"

    @pytest.fixture
    def backend_config(self, tmp_path: Path, redis_server: Any) -> dict[str, Any]:
        return {
            **conformance_config(tmp_path / "mount"),
            "metadata_url": redis_server.url,
            "metadata_prefix": f"test:{tmp_path.name}:",
        }


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.services)])
def index_config(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """Config keys choosing the slot index: in-process, or in the session's real Redis."""
    if request.param == "local":
        return {}
    server = request.getfixturevalue("redis_server")
    return {"metadata_url": server.url, "metadata_prefix": f"test:{tmp_path.name}:"}


@pytest.fixture
def scope() -> KeyScope:
    return KeyScope(Namespace(model=f"hf3fs-test-{random.getrandbits(48):012x}", kv_dtype="bfloat16", page_size=16))


def small_store(root: Path, index_config: dict[str, Any], slots: int, **extra: Any) -> Store:
    """A store with exactly ``slots`` slots of 4 KiB (one file)."""
    config = {"root": str(root), "file_size": slots * SLOT, "numjobs": 1, "page_size_bytes": SLOT}
    return Store(HF3FSBackend({**config, **index_config, **extra}))


def page(key_number: int, size: int = SLOT) -> bytes:
    """A page whose every byte names the key that owns it, so foreign bytes are recognizable."""
    return bytes([key_number % 251 + 1]) * size


def hashes(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["%064x" % rng.getrandbits(256) for _ in range(n)]


# --- slot reuse ---------------------------------------------------------------------------------


def test_full_store_reuses_the_least_recently_used_slots(tmp_path: Path, index_config: dict[str, Any], scope: KeyScope) -> None:
    with small_store(tmp_path / "mount", index_config, slots=4) as store:
        keys = scope.keys(hashes(7, 1))
        assert store.put(keys[:4], [page(i) for i in range(4)]) == [True] * 4
        assert store.get(keys[:1], SLOT) == [page(0)]  # key 0 is now the most recently used
        assert store.put(keys[4:7], [page(i) for i in range(4, 7)]) == [True] * 3
        assert store.exists(keys) == [True, False, False, False, True, True, True]
        assert store.get(keys, SLOT) == [page(0), None, None, None, page(4), page(5), page(6)]
        files = list((tmp_path / "mount").glob("rank0.*.data"))
        assert [f.stat().st_size for f in files] == [4 * SLOT], "the data file must stay pre-sized, never grow"


def test_a_later_call_evicts_the_tail_of_a_stored_prefix_first(tmp_path: Path, index_config: dict[str, Any], scope: KeyScope) -> None:
    """Within one call the first pages count as the most recent: a prefix keeps its head."""
    with small_store(tmp_path / "mount", index_config, slots=8) as store:
        prompt = scope.keys(hashes(8, 3))
        assert store.put(prompt, [page(i) for i in range(8)]) == [True] * 8
        later = scope.keys(hashes(2, 4))
        assert store.put(later, [page(20), page(21)]) == [True] * 2
        assert store.exists(prompt) == [True] * 6 + [False] * 2
        assert store.prefix_exists(prompt) == 6


def test_a_call_larger_than_the_store_keeps_its_head(tmp_path: Path, index_config: dict[str, Any], scope: KeyScope) -> None:
    with small_store(tmp_path / "mount", index_config, slots=8) as store:
        prompt = scope.keys(hashes(12, 5))
        assert store.put(prompt, [page(i) for i in range(12)]) == [True] * 8 + [False] * 4
        assert store.prefix_exists(prompt) == 8
        assert store.get(prompt[:8], SLOT) == [page(i) for i in range(8)]


def test_overwrite_takes_a_new_slot_and_frees_the_old(tmp_path: Path, index_config: dict[str, Any], scope: KeyScope) -> None:
    with small_store(tmp_path / "mount", index_config, slots=2) as store:
        a, b = scope.keys(hashes(2, 2))
        for round_ in range(5):  # overwriting in a two-slot store must never run out of slots
            assert store.put([a], [page(round_)]) == [True]
        assert store.put([b], [page(9)]) == [True]
        assert store.get([a, b], SLOT) == [page(4), page(9)]


def test_reader_sees_a_miss_when_its_slot_is_reused_mid_read(
    tmp_path: Path, index_config: dict[str, Any], scope: KeyScope
) -> None:
    """Fault injection: another writer takes the slot between the reader's lookup and its read."""
    with small_store(tmp_path / "mount", index_config, slots=1) as store:
        victim, intruder = scope.keys(hashes(2, 3))
        assert store.put([victim], [page(1)]) == [True]
        files = store.top._files
        real_read = files.read

        def read_after_reuse(loc: Any, target: Any) -> bool:
            files.read = real_read  # once
            assert store.put([intruder], [page(2)]) == [True]  # evicts the victim, reuses its slot
            return real_read(loc, target)

        files.read = read_after_reuse  # type: ignore[method-assign]
        target = bytearray(SLOT)
        assert store.get_into([victim], [target]) == [False], "a read of a reused slot must be a miss"
        assert bytes(target) == page(2), "the injected reuse did not happen; the test proves nothing"
        assert store.get([victim, intruder], SLOT) == [None, page(2)]


@pytest.mark.slow
def test_concurrent_readers_during_reuse_never_see_foreign_bytes(
    tmp_path: Path, index_config: dict[str, Any], scope: KeyScope
) -> None:
    with small_store(tmp_path / "mount", index_config, slots=3, numjobs=1) as store:
        keys = scope.keys(hashes(40, 4))
        problems: list[str] = []
        hits = [0]
        stop = threading.Event()

        def writer() -> None:
            # at least 15 rounds, and on until the readers have hit 50 times (bounded, not timed)
            round_ = 0
            while round_ < 15 or (hits[0] < 50 and round_ < 5000 and not problems):
                for i, key in enumerate(keys):
                    store.put([key], [page(i)])
                round_ += 1
            stop.set()

        def reader() -> None:
            target = bytearray(SLOT)
            while not stop.is_set():
                for i, key in enumerate(keys):
                    if store.get_into([key], [target]) == [True]:
                        hits[0] += 1
                        if bytes(target) != page(i):
                            problems.append(f"key {i} returned bytes {target[0]} (torn or another key's)")
                            return

        threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert not any(t.is_alive() for t in threads)
        assert problems == []
        assert hits[0] > 0, "no read ever hit; the race was not exercised"


# --- sharing ------------------------------------------------------------------------------------


@pytest.mark.services
def test_two_ranks_share_pages_through_redis(tmp_path: Path, redis_server: Any, scope: KeyScope) -> None:
    """MLA: rank 0 writes replicated pages into its files, rank 1 reads them through the shared index."""
    common = {"root": str(tmp_path / "mount"), "file_size": 16 * SLOT, "numjobs": 2, "page_size_bytes": SLOT}
    common |= {"metadata_url": redis_server.url, "metadata_prefix": f"test:{tmp_path.name}:"}
    mla = KeyScope(scope.namespace, Shard(tp_rank=0, tp_size=2, replicated=True))
    with Store(HF3FSBackend({**common, "rank": 0})) as rank0, Store(HF3FSBackend({**common, "rank": 1})) as rank1:
        keys = mla.keys(hashes(3, 5))
        assert rank0.put(keys, [page(i) for i in range(3)]) == [True] * 3
        assert rank1.exists(keys) == [True] * 3
        assert rank1.get(keys, SLOT) == [page(i) for i in range(3)]
        own = scope.keys(hashes(1, 6))
        assert rank1.put(own, [page(7)]) == [True]
        assert rank0.get(own, SLOT) == [page(7)]
        assert sorted(p.name for p in (tmp_path / "mount").glob("*.data")) == [
            "rank0.0.data",
            "rank0.1.data",
            "rank1.0.data",
            "rank1.1.data",
        ]


def test_in_process_index_keeps_other_processes_off_the_rank(tmp_path: Path, scope: KeyScope) -> None:
    config = {"root": str(tmp_path / "mount"), "file_size": 4 * SLOT, "numjobs": 1, "page_size_bytes": SLOT}
    child = textwrap.dedent(
        """
        import json, sys
        from hicache_storage.connectors.hf3fs import HF3FSBackend
        from hicache_storage.errors import ConfigError
        config = json.loads(sys.argv[1])
        try:
            HF3FSBackend(config).close()
        except ConfigError as exc:
            print("refused:", exc)
        else:
            print("opened")
        """
    )
    with Store(HF3FSBackend(config)):
        taken = subprocess.run([sys.executable, "-c", child, json.dumps(config)], capture_output=True, text=True, timeout=60)
        other_rank = subprocess.run(
            [sys.executable, "-c", child, json.dumps({**config, "rank": 1})], capture_output=True, text=True, timeout=60
        )
    assert taken.stdout.startswith("refused:") and "metadata_url" in taken.stdout, taken.stdout + taken.stderr
    assert other_rank.stdout.strip() == "opened", other_rank.stdout + other_rank.stderr


def test_instances_in_one_process_share_the_in_process_index(tmp_path: Path, scope: KeyScope) -> None:
    config = {"root": str(tmp_path / "mount"), "file_size": 4 * SLOT, "numjobs": 1, "page_size_bytes": SLOT}
    with Store(HF3FSBackend(config)) as first, Store(HF3FSBackend(config)) as second:
        keys = scope.keys(hashes(2, 7))
        assert first.put(keys, [page(1), page(2)]) == [True, True]
        assert second.get(keys, SLOT) == [page(1), page(2)]


# --- configuration and faults -------------------------------------------------------------------


def test_page_size_is_fixed_by_the_first_write(tmp_path: Path, index_config: dict[str, Any], scope: KeyScope) -> None:
    config = {"root": str(tmp_path / "mount"), "file_size": 64 * SLOT, "numjobs": 2, **index_config}
    with Store(HF3FSBackend(config)) as store:
        assert store.capabilities.max_value_size is None
        keys = scope.keys(hashes(3, 8))
        assert store.put(keys[:1], [b"x" * 5000]) == [True]
        assert store.capabilities.max_value_size == 2 * SLOT  # rounded up to 4 KiB
        assert store.put(keys[1:2], [b"y" * 100]) == [True]
        assert store.get(keys[:2], 5000) == [b"x" * 5000, None]
        assert store.get(keys[1:2], 100) == [b"y" * 100]
        with pytest.raises(ValueTooLargeError):
            store.put(keys[2:], [bytes(2 * SLOT + 1)])


def test_hooks_take_empty_calls_before_the_slot_size_is_known(tmp_path: Path, index_config: dict[str, Any]) -> None:
    """The facade never passes an empty call down, but the hooks called directly take one too, and
    an empty put fixes no slot size (it once raised a bare ValueError from max() of nothing)."""
    config = {"root": str(tmp_path / "mount"), "file_size": 64 * SLOT, "numjobs": 2, **index_config}
    with Store(HF3FSBackend(config)) as store:
        connector = store.top
        assert connector.hook_put_from([], []) == []
        assert connector.hook_exists([]) == [] and connector.hook_get_into([], []) == [] and connector.hook_delete([]) == []
        assert connector.capabilities.max_value_size is None, "an empty put must not fix the slot size"


def test_a_first_put_of_zero_byte_pages_fixes_one_aligned_slot(tmp_path: Path, index_config: dict[str, Any], scope: KeyScope) -> None:
    config = {"root": str(tmp_path / "mount"), "file_size": 64 * SLOT, "numjobs": 2, **index_config}
    with Store(HF3FSBackend(config)) as store:
        keys = scope.keys(hashes(2, 9))
        assert len(store.put(keys[:1], [b""])) == 1
        assert store.capabilities.max_value_size == SLOT
        assert store.put(keys[1:], [page(2)]) == [True]
        assert store.get(keys[1:], SLOT) == [page(2)]


def test_a_put_beside_the_first_one_waits_for_no_capacity(tmp_path: Path, index_config: dict[str, Any], scope: KeyScope) -> None:
    """Two first puts at once: the second comes in just after the first fixed the index's slot
    size and before it set the capacity. It must still find slots (it once reserved from a
    capacity of 0 and raised CapacityError, as the conformance suite's concurrent clause once
    did on the minimal config)."""
    config = {"root": str(tmp_path / "mount"), "file_size": 64 * SLOT, "numjobs": 2, **index_config}
    with Store(HF3FSBackend(config)) as store:
        connector = store.top
        index = connector._index
        fixed, second_done = threading.Event(), threading.Event()
        original = index.fix_page_size

        def fix_then_hold(size: int) -> int:
            result = original(size)
            if not fixed.is_set():  # the first put: let the second run before the capacity is set
                fixed.set()
                assert second_done.wait(30), "the second put did not finish"
            return result

        index.fix_page_size = fix_then_hold
        keys = scope.keys(hashes(2, 11))
        outcomes: dict[str, object] = {}

        def first() -> None:
            outcomes["first"] = store.put(keys[:1], [page(1)])

        def second() -> None:
            assert fixed.wait(30)
            try:
                outcomes["second"] = store.put(keys[1:], [page(2)])
            except Exception as exc:  # reported below, not lost in the thread
                outcomes["second"] = exc
            finally:
                second_done.set()

        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert outcomes == {"first": [True], "second": [True]}
        assert store.get(keys, SLOT) == [page(1), page(2)]


@pytest.mark.services
def test_shared_index_rejects_another_page_size(tmp_path: Path, redis_server: Any) -> None:
    common = {"root": str(tmp_path / "mount"), "file_size": 16 * SLOT, "metadata_url": redis_server.url}
    common["metadata_prefix"] = f"test:{tmp_path.name}:"
    with Store(HF3FSBackend({**common, "page_size_bytes": SLOT})):
        with pytest.raises(ConfigError, match="page_size_bytes"):
            HF3FSBackend({**common, "page_size_bytes": 2 * SLOT, "rank": 1})


def test_unreachable_redis_is_named_without_the_password(tmp_path: Path) -> None:
    from hicache_storage.testing.process import free_port

    port = free_port()
    with pytest.raises(BackendUnavailableError, match=f"127.0.0.1:{port}") as caught:
        HF3FSBackend({"root": str(tmp_path), "metadata_url": f"redis://:hunter2@127.0.0.1:{port}/0"})
    assert "hunter2" not in str(caught.value)


@pytest.mark.services
def test_slot_index_lost_mid_run_is_a_typed_error(tmp_path: Path, scope: KeyScope) -> None:
    from hicache_storage.testing.redis_server import RedisServer

    server = RedisServer()
    server.start()
    try:
        store = small_store(tmp_path / "mount", {"metadata_url": server.url, "metadata_prefix": "t:"}, slots=4)
        keys = scope.keys(hashes(1, 9))
        assert store.put(keys, [page(1)]) == [True]
        server.kill()
        with pytest.raises(BackendUnavailableError):
            store.get(keys, SLOT)
        server.restart()
        # Redis kept nothing (no persistence): the page is a miss, and writes work again
        assert store.get(keys, SLOT) == [None]
        assert store.put(keys, [page(2)]) == [True]
        assert store.get(keys, SLOT) == [page(2)]
        store.close()
    finally:
        server.stop()


@pytest.mark.skipif(usrbio_available(), reason="the usrbio binding is installed here")
def test_usrbio_without_the_binding_is_a_missing_dependency(tmp_path: Path) -> None:
    with pytest.raises(MissingDependencyError, match="hf3fs_fuse"):
        HF3FSBackend({"root": str(tmp_path), "io": "usrbio", "page_size_bytes": SLOT})


def test_posix_path_declares_zero_copy(tmp_path: Path) -> None:
    with Store(HF3FSBackend({"root": str(tmp_path), "file_size": 4 * SLOT, "io": "posix"})) as store:
        assert store.capabilities.zero_copy_read and store.capabilities.zero_copy_write


def test_root_that_cannot_be_created_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="root"):
        HF3FSBackend({"root": str(blocker / "mount")})


@pytest.fixture(autouse=True)
def _no_leftover_local_indexes() -> Iterator[None]:
    from hicache_storage.connectors.hf3fs import index as _hf3fs_index

    yield
    assert not _hf3fs_index._LOCAL_INDEXES, "a test left an hf3fs instance open"


# --- the usrbio glue ----------------------------------------------------------------------------

STAND_IN_BINDING = '''
"""A stand-in for 3FS's hf3fs_fuse.io, with the calls the connector makes, doing plain file I/O.

It checks how the connector drives the API (registered fds, ring direction, batch sizes); it
says nothing about 3FS itself.
"""
import os

registered = set()
calls = {"prepare": 0, "submit": 0}


def extract_mount_point(path):
    return "/"


def register_fd(fd):
    registered.add(fd)


def deregister_fd(fd):
    registered.discard(fd)


class _IoVec:
    def __init__(self, shm):
        self.buf = shm.buf

    def __getitem__(self, span):
        return self.buf[span]


def make_iovec(shm, mount_point, block_size=0, numa=-1):
    return _IoVec(shm)


class _Result:
    def __init__(self, result):
        self.result = result


class _Ring:
    def __init__(self, entries, for_read):
        self.entries, self.for_read, self.pending = entries, for_read, []

    def prepare(self, iov, read, fd, offset, userdata=None):
        assert read == self.for_read, "an I/O was prepared on the ring of the other direction"
        assert fd in registered, "an I/O was prepared on an fd that was not registered"
        assert len(self.pending) < self.entries, "more I/Os prepared than the ring has entries"
        calls["prepare"] += 1
        self.pending.append((iov, fd, offset))

    def submit(self):
        calls["submit"] += 1
        return self

    def wait(self, min_results, timeout):
        assert min_results == len(self.pending)
        move = os.preadv if self.for_read else os.pwritev
        done = [_Result(move(fd, [iov], offset)) for iov, fd, offset in self.pending]
        self.pending = []
        return done


def make_ioring(mount_point, entries, for_read, timeout, numa):
    return _Ring(entries, for_read)
'''


class TestHF3FSUsrbioGlue(ConformanceTests):
    """The connector's usrbio code path, run against a stand-in binding that does plain file I/O.

    No 3FS client exists here, so this exercises only the connector's side of the usrbio API
    (shared-memory staging, ring batching, fd registration). It does not show that 3FS works.
    """

    backend = "hf3fs"

    @pytest.fixture(autouse=True)
    def stand_in_binding(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
        package = tmp_path / "binding" / "hf3fs_fuse"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "io.py").write_text(STAND_IN_BINDING)
        monkeypatch.syspath_prepend(str(package.parent))
        for name in ("hf3fs_fuse", "hf3fs_fuse.io"):
            monkeypatch.delitem(sys.modules, name, raising=False)
        import hf3fs_fuse.io as binding

        yield binding
        for name in ("hf3fs_fuse", "hf3fs_fuse.io"):
            sys.modules.pop(name, None)

    @pytest.fixture
    def backend_config(self, tmp_path: Path) -> dict[str, Any]:
        return {**conformance_config(tmp_path / "mount"), "io": "usrbio", "usrbio_entries": 8}

    def test_usrbio_path_is_the_one_used(self, store: Store, scope: KeyScope, stand_in_binding: Any) -> None:
        from hicache_storage.connectors.hf3fs import UsrbioFiles

        assert isinstance(store.top._files, UsrbioFiles)
        assert not store.capabilities.zero_copy_read and not store.capabilities.zero_copy_write
        keys = scope.keys(hashes(20, 11))
        assert store.put(keys, [page(i) for i in range(20)]) == [True] * 20
        assert store.get(keys, SLOT) == [page(i) for i in range(20)]
        assert stand_in_binding.calls["prepare"] == 40
        assert stand_in_binding.calls["submit"] == 6  # 20 pages in rings of 8 entries: 3 per direction
