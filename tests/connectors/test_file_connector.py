"""The file connector on the real local disk (ext4 under /tmp here): behaviour beyond the suite,
then the conformance suite in three configurations.

Faults the disk cannot be made to show on demand (a full disk, EACCES while running as root,
a filesystem refusing O_DIRECT) are injected by patching one ``os`` function; everything else
is the real filesystem.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import random
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from hicache_storage.conformance import ConformanceTests
from hicache_storage.connectors.file import temp as file_temp
from hicache_storage.connectors.file import FileBackend
from hicache_storage.errors import (
    BackendClosedError,
    ConfigError,
    InvalidKeyError,
    PermissionDeniedError,
    StorageError,
)
from hicache_storage.keys import KeyScope, Namespace, PageKey, Shard
from hicache_storage.store import Store

NAMESPACE = Namespace(model="file-test", kv_dtype="bfloat16", page_size=16)
SCOPE = KeyScope(NAMESPACE)


def key(i: int, scope: KeyScope = SCOPE) -> PageKey:
    return scope.key("%064x" % (i * 0x9E3779B97F4A7C15 % 2**256))


def page_files(root: Path) -> dict[str, int]:
    """Every page file under root (relative path -> size), read straight from the disk."""
    pages = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if path.is_file() and len(rel.parts) == 5 and rel.parts[0] != ".tmp":
            pages[str(rel)] = path.stat().st_size
    return pages


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "pages"


@pytest.fixture
def opened(root: Path):
    stores: list[Store] = []

    def open_store(**config: object) -> Store:
        store = Store(FileBackend({"root": str(root), **config}))
        stores.append(store)
        return store

    yield open_store
    for store in stores:
        store.close()


# --- round trips and misses ------------------------------------------------------------------


def test_multi_segment_round_trip(opened) -> None:
    store = opened()
    rng = random.Random(1)
    keys = [key(i) for i in range(8)]
    pages = [[rng.randbytes(n) for n in (1000, 0, 7000, 3)] for _ in keys]
    assert store.put_from(keys, pages) == [True] * 8
    targets = [[bytearray(4000), bytearray(3003), bytearray(0), bytearray(1000)] for _ in keys]
    assert store.get_into(keys, targets) == [True] * 8
    for page, target in zip(pages, targets):
        assert b"".join(target) == b"".join(page)


def test_page_is_one_file_at_its_key_path(opened, root: Path) -> None:
    store = opened()
    k = key(3)
    assert store.put([k], [b"x" * 100]) == [True]
    expected = root / NAMESPACE.fingerprint / Shard().token / "kv" / k.page_hash[:2] / k.page_hash
    assert expected.read_bytes() == b"x" * 100
    assert page_files(root) == {str(expected.relative_to(root)): 100}


@pytest.mark.parametrize("size", [4095, 4097, 0])
def test_size_mismatch_is_a_miss(opened, size: int) -> None:
    store = opened()
    assert store.put([key(1)], [b"v" * 4096]) == [True]
    target = bytearray(b"\x00" * size)
    assert store.get_into([key(1)], [target]) == [False]
    assert store.exists([key(1)]) == [True]
    assert store.get([key(1)], 4096) == [b"v" * 4096]


def test_zero_length_page(opened) -> None:
    store = opened()
    assert store.put([key(1)], [b""]) == [True]
    assert store.get([key(1)], 0) == [b""]
    assert store.get([key(1)], 1) == [None]


def test_delete_and_exists(opened) -> None:
    store = opened()
    store.put([key(1), key(2)], [b"a", b"b"])
    assert store.delete([key(1), key(3)]) == [True, False]
    assert store.exists([key(1), key(2), key(3)]) == [False, True, False]


# --- atomicity -------------------------------------------------------------------------------

_WRITER_SCRIPT = textwrap.dedent(
    """
    import sys
    from hicache_storage.connectors.file import FileBackend
    from hicache_storage.keys import KeyScope, Namespace
    from hicache_storage.store import Store
    root, page_hash, size, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    scope = KeyScope(Namespace(model="file-test", kv_dtype="bfloat16", page_size=16))
    with Store(FileBackend({"root": root})) as store:
        for i in range(rounds):
            fill = bytes([200 + i % 50]) * (size // 2)
            assert store.put_from([scope.key(page_hash)], [[fill, fill]]) == [True]
    """
)


@pytest.mark.slow
def test_same_key_writers_and_readers_never_see_a_torn_page(opened, root: Path) -> None:
    """Threads here and a writer process hammer one key; every hit is one writer's whole page."""
    store = opened(io_threads=4)
    size = 512 * 1024
    k = key(7)
    store.put([k], [bytes([1]) * size])
    other = subprocess.Popen([sys.executable, "-c", _WRITER_SCRIPT, str(root), k.page_hash, str(size), "60"])
    torn: list[str] = []
    hits = [0]
    done = threading.Event()

    def writer(seed: int) -> None:
        for i in range(60):
            fill = bytes([(seed * 40 + i) % 199 + 1]) * (size // 4)
            assert store.put_from([k], [[fill, fill, fill, fill]]) == [True]

    def reader() -> None:
        halves = [bytearray(size // 2), bytearray(size // 2)]
        while not done.is_set():
            if store.get_into([k], [halves]) == [True]:
                hits[0] += 1
                page = bytes(halves[0] + halves[1])
                if page.count(page[:1]) != size:
                    torn.append(f"torn page: first byte {page[0]}, {page.count(page[:1])} of {size} match")
                    return

    readers = [threading.Thread(target=reader) for _ in range(2)]
    writers = [threading.Thread(target=writer, args=(s,)) for s in range(3)]
    for thread in readers + writers:
        thread.start()
    for thread in writers:
        thread.join()
    assert other.wait(timeout=120) == 0
    done.set()
    for thread in readers:
        thread.join()
    assert torn == []
    assert hits[0] > 0
    assert list((root / ".tmp").iterdir()) == [], "a publication left its temp file behind"


# --- persistence and sharing -----------------------------------------------------------------


def test_persistence_across_instances(opened) -> None:
    first = opened()
    values = [os.urandom(5000) for _ in range(5)]
    first.put([key(i) for i in range(5)], values)
    first.close()
    second = opened()
    assert second.get([key(i) for i in range(5)], 5000) == values


_READER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from hicache_storage.connectors.file import FileBackend
    from hicache_storage.keys import KeyScope, Namespace
    from hicache_storage.store import Store
    root, page_hash, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    scope = KeyScope(Namespace(model="file-test", kv_dtype="bfloat16", page_size=16))
    with Store(FileBackend({"root": root})) as store:
        [page] = store.get([scope.key(page_hash)], size)
    print(json.dumps(page.hex() if page is not None else None))
    """
)


def test_another_process_reads_what_we_wrote(opened, root: Path) -> None:
    store = opened()
    value = os.urandom(12345)
    store.put([key(9)], [value])
    result = subprocess.run(
        [sys.executable, "-c", _READER_SCRIPT, str(root), key(9).page_hash, "12345"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == value.hex()


def test_capabilities_follow_the_config(opened) -> None:
    plain = opened().capabilities
    assert plain.persistent and plain.shared_across_processes and plain.outlives_writer and not plain.shared_across_hosts
    assert not plain.evicts and plain.max_value_size is None and plain.capacity_bytes is None
    assert plain.zero_copy_read and plain.zero_copy_write and plain.delete and plain.clear
    capped = opened(capacity_bytes=10_000, shared_mount=True).capabilities
    assert capped.evicts and capped.max_value_size == capped.capacity_bytes == 10_000 and capped.shared_across_hosts
    assert FileBackend.capabilities.evicts is False, "an instance must not change the class declaration"


# --- capacity and LRU eviction ---------------------------------------------------------------


def test_capacity_holds_under_sustained_writes(opened, root: Path) -> None:
    page = 8192
    capacity = 10 * page
    store = opened(capacity_bytes=capacity)
    for batch in range(30):
        keys = [key(batch * 7 + i) for i in range(7)]
        assert store.put(keys, [bytes([batch]) * page] * 7) == [True] * 7
        on_disk = page_files(root)
        assert sum(on_disk.values()) <= capacity
        assert store.stats()["stored_bytes"] == sum(on_disk.values())
    # Kept: the whole last batch, then the head of the one before (its tail is evicted first).
    survivors = [key(29 * 7 + i) for i in range(7)] + [key(28 * 7 + i) for i in range(3)]
    assert store.exists(survivors) == [True] * 10
    assert store.stats()["evictions"] == 30 * 7 - 10


def test_lru_order_across_calls(opened) -> None:
    store = opened(capacity_bytes=4 * 1000)
    for i in range(4):
        store.put([key(i)], [b"p" * 1000])
    assert store.get([key(0)], 1000) == [b"p" * 1000]  # 0 becomes the most recent
    store.put([key(4)], [b"q" * 1000])
    assert store.exists([key(i) for i in range(5)]) == [True, False, True, True, True]
    store.put([key(5)], [b"q" * 1000])
    assert store.exists([key(i) for i in range(6)]) == [True, False, False, True, True, True]


def test_within_a_call_the_prefix_tail_is_evicted_first(opened) -> None:
    store = opened(capacity_bytes=4 * 1000)
    store.put([key(i) for i in range(4)], [b"p" * 1000] * 4)
    store.put([key(4)], [b"q" * 1000])
    assert store.exists([key(i) for i in range(4)]) == [True, True, True, False]
    assert store.get([key(2), key(1)], 1000) == [b"p" * 1000] * 2  # now 2 is the most recent, then 1
    store.put([key(5)], [b"q" * 1000])
    store.put([key(6)], [b"q" * 1000])
    assert store.exists([key(i) for i in range(7)]) == [False, True, True, False, False, True, True]


def test_a_call_larger_than_the_capacity_keeps_the_head(opened, root: Path) -> None:
    """64 pages into a 32-page capacity: the first 32 are stored, the tail is refused unwritten."""
    store = opened(capacity_bytes=32 * 1000)
    older = [key(1000 + i) for i in range(8)]
    assert store.put(older, [b"o" * 1000] * 8) == [True] * 8
    keys = [key(i) for i in range(64)]
    values = [bytes([i]) * 1000 for i in range(64)]
    assert store.put(keys, values) == [True] * 32 + [False] * 32
    assert store.prefix_exists(keys) == 32
    assert store.get(keys[:32], 1000) == values[:32]
    assert store.exists(older) == [False] * 8  # least recently used, so evicted to make room
    assert sum(page_files(root).values()) == 32 * 1000
    stats = store.stats()
    assert (stats["puts_beyond_capacity"], stats["stored_bytes"], stats["evictions"]) == (32, 32 * 1000, 8)


def test_the_head_of_a_full_call_outlives_later_calls(opened) -> None:
    store = opened(capacity_bytes=32 * 1000)
    prompt = [key(i) for i in range(48)]
    store.put(prompt, [b"p" * 1000] * 48)
    store.put([key(100 + i) for i in range(8)], [b"q" * 1000] * 8)
    assert store.prefix_exists(prompt) == 24  # the later call evicted the stored prefix's tail


@pytest.mark.parametrize("threads", [1, 3])
def test_pages_on_disk_never_exceed_the_capacity(opened, root: Path, monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    """Measured at every publication (each os.replace of a page), not only after the calls."""
    capacity = 12 * 1000
    store = opened(capacity_bytes=capacity, io_threads=2)
    peaks: list[int] = []
    real_replace = os.replace

    def replace(source: str, target: str, *args: object, **kwargs: object) -> None:
        real_replace(source, target, *args, **kwargs)
        if "/.tmp/" not in str(target):
            peaks.append(sum(page_files(root).values()))

    monkeypatch.setattr(os, "replace", replace)

    def writer(worker: int) -> None:
        for call in range(6):
            keys = [key(10_000 * worker + 100 * call + i) for i in range(5 + 3 * call)]
            store.put(keys, [b"c" * 1000] * len(keys))

    pool = [threading.Thread(target=writer, args=(w,)) for w in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    assert peaks and max(peaks) <= capacity
    assert store.stats()["stored_bytes"] == sum(page_files(root).values()) <= capacity


@pytest.mark.parametrize("capacity", [None, 10 * 1000])
def test_duplicate_keys_in_one_call_the_last_write_wins(opened, capacity: int | None) -> None:
    store = opened(capacity_bytes=capacity)
    keys = [key(0), key(1), key(0), key(2), key(0)]
    assert store.put(keys, [b"a" * 1000, b"b" * 1000, b"c" * 1000, b"d" * 1000, b"e" * 1000]) == [True] * 5
    assert store.get([key(0), key(1), key(2)], 1000) == [b"e" * 1000, b"b" * 1000, b"d" * 1000]


def test_startup_index_is_ordered_by_mtime(opened, root: Path) -> None:
    first = opened()
    first.put([key(i) for i in range(4)], [b"m" * 1000] * 4)
    first.close()
    # Make the write order 2, 0, 3, 1 on disk.
    for age_rank, i in enumerate([2, 0, 3, 1]):
        path = next(root.rglob(key(i).page_hash))
        stamp = 1_700_000_000_000_000_000 + age_rank * 1_000_000_000
        os.utime(path, ns=(stamp, stamp))
    store = opened(capacity_bytes=4 * 1000)
    assert store.stats()["stored_bytes"] == 4000
    store.put([key(10)], [b"n" * 1000])
    assert store.exists([key(i) for i in range(4)]) == [True, True, False, True]
    store.put([key(11)], [b"n" * 1000])
    assert store.exists([key(i) for i in range(4)]) == [False, True, False, True]


def test_startup_evicts_a_root_already_over_capacity(opened, root: Path) -> None:
    opened().put([key(i) for i in range(6)], [b"o" * 1000] * 6)
    store = opened(capacity_bytes=3000)
    assert sum(page_files(root).values()) <= 3000
    assert store.stats()["evictions"] == 3


def test_unremovable_page_does_not_wedge_eviction(opened, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = opened(capacity_bytes=4 * 1000)
    for i in range(4):
        store.put([key(i)], [b"u" * 1000])
    # Page 0: really unremovable (a non-empty directory where the file was: unlink fails with
    # EISDIR, even for root). Page 1: already gone. Page 2: removal denied (injected).
    path0 = next(root.rglob(key(0).page_hash))
    path0.unlink()
    path0.mkdir()
    (path0 / "keep").write_bytes(b"x")
    next(root.rglob(key(1).page_hash)).unlink()
    path2 = str(next(root.rglob(key(2).page_hash)))
    real_unlink = os.unlink

    def unlink(path: str, *args: object, **kwargs: object) -> None:
        if str(path) == path2:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    for i in (10, 11, 12):
        assert store.put([key(i)], [b"w" * 1000]) == [True]
    stats = store.stats()
    assert (stats["evictions_failed"], stats["evictions_vanished"], stats["unremovable_bytes"]) == (2, 1, 2000)
    assert store.exists([key(3), key(10), key(11), key(12)]) == [True] * 4
    # Eviction goes on past them: the next writes evict 3, then 10.
    for i in (13, 14):
        assert store.put([key(i)], [b"w" * 1000]) == [True]
    assert store.exists([key(3), key(10), key(11), key(12), key(13), key(14)]) == [False, False, True, True, True, True]
    assert store.stats()["evictions"] == 2
    # The budget holds for what can be evicted; the denied page stays on disk outside it.
    assert store.stats()["stored_bytes"] == 4000
    assert sum(page_files(root).values()) == 4000 + 1000


# --- temp files ------------------------------------------------------------------------------


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_temp_files_are_removed_at_startup(opened, root: Path) -> None:
    opened().close()
    tmp = root / ".tmp"
    host = file_temp.host_tag()
    me = f"{host}.{os.getpid()}.{file_temp.process_start(os.getpid())}"
    dead = f"{host}.{_dead_pid()}.0"
    (tmp / f"{dead}.aaaa.tmp").write_bytes(b"half a page")
    (tmp / f"{dead}.bbbb.trash").mkdir()
    (tmp / f"{dead}.bbbb.trash" / "page").write_bytes(b"cleared")
    reused = f"{host}.{os.getpid()}.1"  # our pid, but another process's start time: a reused pid
    (tmp / f"{reused}.cccc.tmp").write_bytes(b"x")
    (tmp / f"{me}.dddd.tmp").write_bytes(b"in flight")  # a live writer (this process)
    (tmp / "otherhost.123.456.eeee.tmp").write_bytes(b"maybe in flight elsewhere")
    old = tmp / "otherhost.123.456.ffff.tmp"
    old.write_bytes(b"abandoned")
    os.utime(old, (0, 0))
    store = opened()
    assert {p.name for p in tmp.iterdir()} == {f"{me}.dddd.tmp", "otherhost.123.456.eeee.tmp"}
    assert store.stats()["stale_temp_removed"] == 4


def test_failed_write_leaves_no_temp_file(opened, root: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    store = opened()

    def full_disk(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full_disk)
    with caplog.at_level(logging.WARNING, logger="hicache_storage.connectors.file"):
        assert store.put([key(1), key(2)], [b"a" * 100, b"b" * 100]) == [False, False]
    assert "2 of 2 pages not stored: no space left" in caplog.text
    assert store.stats()["puts_no_space"] == 2
    assert list((root / ".tmp").iterdir()) == []
    monkeypatch.undo()
    assert store.exists([key(1)]) == [False]
    assert store.put([key(1)], [b"a" * 100]) == [True]


# --- error mapping ---------------------------------------------------------------------------


def test_permission_error_is_typed_with_context(opened, monkeypatch: pytest.MonkeyPatch) -> None:
    store = opened()
    store.put([key(1)], [b"a"])
    real_open = os.open

    def denied(path: str, flags: int, *args: object, **kwargs: object) -> int:
        if str(path).endswith(key(1).page_hash):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(PermissionDeniedError) as caught:
        store.get([key(1)], 1)
    assert caught.value.backend == "file" and caught.value.operation == "get" and caught.value.key == key(1)
    assert key(1).page_hash in str(caught.value)


def test_other_os_errors_are_storage_errors(opened, monkeypatch: pytest.MonkeyPatch) -> None:
    store = opened()

    def broken(*args: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pwritev", broken)
    with pytest.raises(StorageError) as caught:
        store.put([key(1)], [b"a"])
    assert type(caught.value) is StorageError and caught.value.operation == "put" and caught.value.key == key(1)
    assert "Input/output error" in str(caught.value)


# --- paths, symlinks, permissions ------------------------------------------------------------


def _tampered_hash(text: str) -> PageKey:
    k = key(1)
    object.__setattr__(k, "page_hash", text)  # bypasses PageKey's own check on purpose
    return k


def _tampered_scope(components: tuple[str, str, str]) -> PageKey:
    scope = KeyScope(NAMESPACE)
    scope.__dict__["components"] = components  # overrides the cached rendering on purpose
    return scope.key("%064x" % 1)


@pytest.mark.parametrize(
    "bad_key",
    [
        lambda: _tampered_hash("../../../../../etc/passwd"),
        lambda: _tampered_hash(".."),
        lambda: _tampered_hash("ab/cd"),
        lambda: _tampered_hash(""),
        lambda: _tampered_hash("ABCDEF01"),
        lambda: _tampered_hash("abc\x00def"),
        lambda: _tampered_scope(("..", "..", "..")),
        lambda: _tampered_scope((".tmp", "x", "y")),
        lambda: _tampered_scope(("/etc", "x", "y")),
        lambda: _tampered_scope(("ns", "", "kv")),
    ],
    ids=[
        *("dotdot-path", "dotdot", "slash", "empty", "uppercase", "nul"),
        *("scope-dotdot", "tmp-dir", "absolute", "empty-part"),
    ],
)
def test_path_escape_attempts_are_rejected(opened, tmp_path: Path, bad_key) -> None:
    store = opened()
    k = bad_key()
    for call in (
        lambda: store.put([k], [b"evil"]),
        lambda: store.get([k], 4),
        lambda: store.exists([k]),
        lambda: store.delete([k]),
    ):
        with pytest.raises(InvalidKeyError):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pages"]


def test_root_symlink_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ConfigError, match="symlink") as caught:
        FileBackend({"root": str(tmp_path / "link")})
    assert caught.value.field == "root"


def test_tmp_dir_symlink_is_refused(root: Path, tmp_path: Path) -> None:
    root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (root / ".tmp").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="real directory"):
        FileBackend({"root": str(root)})


def test_symlinked_subdirectory_leading_out_is_refused(opened, root: Path, tmp_path: Path) -> None:
    store = opened()
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / NAMESPACE.fingerprint).symlink_to(outside)
    for call in (lambda: store.put([key(1)], [b"x"]), lambda: store.get([key(1)], 1), lambda: store.exists([key(1)])):
        with pytest.raises(PermissionDeniedError, match="symlink"):
            call()
    assert list(outside.iterdir()) == []


def test_symlinked_page_file_is_a_miss(opened, root: Path, tmp_path: Path) -> None:
    store = opened()
    store.put([key(1)], [b"page"])
    secret = tmp_path / "secret"
    secret.write_bytes(b"sec!")
    page = next(root.rglob(key(1).page_hash))
    page.unlink()
    page.symlink_to(secret)
    assert store.get([key(1)], 4) == [None]
    assert store.exists([key(1)]) == [False]


def test_tree_is_owner_only(opened, root: Path) -> None:
    store = opened()
    store.put([key(1), key(2, KeyScope(NAMESPACE, part="v"))], [b"a", b"b"])
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}
    assert any(p.name == "namespace.json" for p in modes)
    for path, mode in modes.items():
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path} has mode {oct(mode)}"


def test_namespace_json_describes_the_namespace(opened, root: Path) -> None:
    opened().put([key(1)], [b"a"])
    described = json.loads((root / NAMESPACE.fingerprint / "namespace.json").read_text())
    assert described == json.loads(json.dumps(NAMESPACE.describe()))


# --- clear -----------------------------------------------------------------------------------


def test_clear_removes_only_its_namespace(opened, root: Path) -> None:
    store = opened(capacity_bytes=10**6)
    other_scope = KeyScope(Namespace(model="file-test", kv_dtype="float16", page_size=16))
    mine = [key(1), key(2, KeyScope(NAMESPACE, Shard(tp_rank=1, tp_size=2))), key(3, SCOPE.with_part("v"))]
    theirs = [key(1, other_scope), key(4, other_scope)]
    store.put(mine + theirs, [b"c" * 10] * 5)
    store.clear(NAMESPACE)
    assert store.exists(mine + theirs) == [False, False, False, True, True]
    assert not (root / NAMESPACE.fingerprint).exists()
    assert (root / other_scope.namespace.fingerprint / "namespace.json").exists()
    assert store.stats()["stored_bytes"] == 20
    assert list((root / ".tmp").iterdir()) == []
    store.clear(NAMESPACE)  # clearing an absent namespace is fine
    assert store.put([key(1)], [b"again"]) == [True]
    assert (root / NAMESPACE.fingerprint / "namespace.json").exists()


def test_write_after_another_process_cleared(opened) -> None:
    """A second instance clears the namespace whose directories the first has already checked."""
    first, second = opened(), opened()
    first.put([key(1)], [b"before"])
    second.clear(NAMESPACE)
    assert first.put([key(2)], [b"after"]) == [True]
    assert second.get([key(1), key(2)], 5) == [None, b"after"]


def test_clear_racing_writers_of_the_same_namespace(opened) -> None:
    """Writers keep storing while the namespace is cleared in a loop under them: no error, and
    every page is either stored whole or reported not stored."""
    store = opened(io_threads=2)
    errors: list[BaseException] = []
    results: list[bool] = []

    def writer(seed: int) -> None:
        try:
            for i in range(40):
                keys = [key(seed * 1000 + i * 2), key(seed * 1000 + i * 2 + 1)]
                results.extend(store.put(keys, [b"r" * 2048] * 2))
                for page in store.get(keys, 2048):
                    assert page in (None, b"r" * 2048)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in range(3)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        store.clear(NAMESPACE)
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(results) == 3 * 40 * 2 and results.count(True) > 0
    stats = store.stats()
    assert stats["put_stored"] + stats["puts_lost_to_clear"] == len(results)
    assert store.put([key(1)], [b"after"]) == [True]
    assert store.get([key(1)], 5) == [b"after"]


# --- O_DIRECT --------------------------------------------------------------------------------


def _aligned(size: int) -> memoryview:
    return memoryview(mmap.mmap(-1, size))


def test_direct_io_aligned_buffers_are_zero_copy(opened, root: Path) -> None:
    store = opened(direct_io=True)
    halves = [_aligned(8192), _aligned(4096)]
    halves[0][:] = os.urandom(8192)
    halves[1][:] = os.urandom(4096)
    assert store.put_from([key(1)], [halves]) == [True]
    target = [_aligned(4096), _aligned(8192)]
    assert store.get_into([key(1)], [target]) == [True]
    assert bytes(target[0]) + bytes(target[1]) == bytes(halves[0]) + bytes(halves[1])
    assert store.stats()["direct_bounce_ios"] == 0


def test_direct_io_unaligned_buffers_bounce(opened, root: Path) -> None:
    store = opened(direct_io=True)
    rng = random.Random(5)
    unaligned = _aligned(8192 + 1)[1:]  # right size, wrong address
    unaligned[:] = rng.randbytes(8192)
    pages = [[rng.randbytes(1000), rng.randbytes(3)], b"r" * 5000, unaligned]
    keys = [key(1), key(2), key(3)]
    assert store.put_from(keys, pages) == [True] * 3
    assert sorted(page_files(root).values()) == [1003, 5000, 8192], "padding for O_DIRECT must be truncated away"
    targets = [[bytearray(3), bytearray(1000)], bytearray(5000), _aligned(8192 + 7)[7:]]
    assert store.get_into(keys, targets) == [True] * 3
    assert b"".join(targets[0]) == b"".join(pages[0]) and targets[1] == pages[1] and targets[2] == unaligned
    assert store.stats()["direct_bounce_ios"] == 6
    buffered = opened()
    assert buffered.get(keys[1:2], 5000) == [b"r" * 5000], "direct and buffered instances share one format"
    assert store.get_into([key(2)], [bytearray(4096)]) == [False]


def test_direct_io_refused_by_the_filesystem(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def no_direct(path: str, flags: int, *args: object, **kwargs: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(ConfigError, match="refuses O_DIRECT") as caught:
        FileBackend({"root": str(root), "direct_io": True})
    assert caught.value.field == "direct_io"
    assert list((root / ".tmp").iterdir()) == []


# --- config and lifecycle --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "field"),
    [({"io_threads": 0}, "io_threads"), ({"capacity_bytes": 0}, "capacity_bytes"), ({"nvme": True}, "nvme")],
)
def test_bad_config_names_the_field(root: Path, config: dict, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        FileBackend({"root": str(root), **config})
    assert caught.value.field == field


def test_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a directory"):
        FileBackend({"root": str(tmp_path / "file")})


def test_close_stops_the_pool(root: Path) -> None:
    before = set(threading.enumerate())
    store = Store(FileBackend({"root": str(root), "io_threads": 3}))
    store.put([key(i) for i in range(6)], [b"z"] * 6)
    workers = [t for t in set(threading.enumerate()) - before if t.name.startswith("hicache-file-io")]
    assert workers
    store.close()
    assert not any(t.is_alive() for t in workers)
    with pytest.raises(BackendClosedError):
        store.exists([key(1)])


# --- the conformance suite -------------------------------------------------------------------


class TestFileConformance(ConformanceTests):
    backend = "file"

    @pytest.fixture
    def backend_config(self, tmp_path: Path) -> dict:
        return {"root": str(tmp_path / "pages")}


class TestFileDirectIOConformance(ConformanceTests):
    backend = "file"

    @pytest.fixture
    def backend_config(self, tmp_path: Path) -> dict:
        return {"root": str(tmp_path / "pages"), "direct_io": True, "fsync": True}


class TestFileWithCapacityConformance(ConformanceTests):
    backend = "file"

    @pytest.fixture
    def backend_config(self, tmp_path: Path) -> dict:
        return {"root": str(tmp_path / "pages"), "capacity_bytes": 64 * 2**20, "io_threads": 2}
