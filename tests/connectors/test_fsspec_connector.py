"""The fsspec connector over memory://, file:// and s3:// (s3fs against a real SeaweedFS)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_storage import (
    AuthenticationError,
    BackendUnavailableError,
    ConfigError,
    KeyScope,
    Namespace,
    StorageTimeoutError,
    Store,
    create_backend,
)
from hicache_storage.conformance import ConformanceTests
from hicache_storage.testing.process import free_port


def s3_config(server, path: str | None = None, **client_overrides) -> dict:
    """fsspec config for s3fs against the test server, under a fresh path."""
    path = path or f"fsspec-{uuid.uuid4().hex[:10]}"
    client_kwargs = {"endpoint_url": server.endpoint_url, "region_name": server.region, **client_overrides}
    return {
        "url": f"s3://{server.bucket}/{path}",
        "storage_options": {
            "key": server.access_key,
            "client_kwargs": client_kwargs,
            "config_kwargs": {
                "s3": {"addressing_style": "path"},
                "connect_timeout": 2,
                "read_timeout": 10,
                "retries": {"max_attempts": 1},
            },
        },
        "secret_storage_options": {"secret": server.secret_key},
    }


@pytest.fixture
def scope() -> KeyScope:
    return KeyScope(Namespace(model=f"fsspec-test-{uuid.uuid4().hex[:8]}", kv_dtype="bfloat16", page_size=64))


def page_hash(i: int) -> str:
    return f"{i:064x}"


@pytest.fixture(params=["memory", "file"])
def local_store(request, tmp_path) -> Iterator[object]:
    url = f"memory://fsspec-test-{uuid.uuid4().hex[:8]}" if request.param == "memory" else f"file://{tmp_path}/kv"
    store = Store(create_backend("fsspec", {"url": url}))
    yield store
    store.close()


# --- memory:// and file:// ------------------------------------------------------------------------


def test_round_trip_and_segments(local_store, scope):
    keys = scope.keys([page_hash(i) for i in range(5)])
    values = [os.urandom(70_000) for _ in keys]
    assert local_store.put_from(keys, [[v[:123], v[123:]] for v in values]) == [True] * 5
    targets = [[bytearray(50_000), bytearray(20_000)] for _ in keys]
    assert local_store.get_into(keys, targets) == [True] * 5
    assert [b"".join(t) for t in targets] == values


def test_length_mismatch_and_missing_key_are_misses(local_store, scope):
    key = scope.key(page_hash(1))
    assert local_store.put([key], [b"x" * 4096]) == [True]
    assert local_store.get_into([key], [bytearray(4095)]) == [False]
    assert local_store.get_into([key], [bytearray(4097)]) == [False]
    assert local_store.get([scope.key(page_hash(2))], 4096) == [None]
    assert local_store.exists([key, scope.key(page_hash(2))]) == [True, False]


def test_delete_and_clear(local_store, scope):
    keys = scope.keys([page_hash(i) for i in range(3)])
    other = KeyScope(Namespace(model="fsspec-other", kv_dtype="bfloat16", page_size=64)).key(page_hash(1))
    assert local_store.put(keys + [other], [b"d" * 10] * 4) == [True] * 4
    assert local_store.delete([keys[0]]) == [True]
    assert local_store.delete([keys[0]]) == [False]
    local_store.clear(scope.namespace)
    assert local_store.exists(keys) == [False] * 3
    assert local_store.exists([other]) == [True]
    local_store.clear(scope.namespace)  # clearing an empty namespace is fine
    local_store.clear(other.scope.namespace)


def test_capabilities_follow_the_protocol(tmp_path):
    memory = create_backend("fsspec", {"url": "memory://caps"})
    local = create_backend("fsspec", {"url": str(tmp_path / "plain-path")})
    try:
        assert not memory.capabilities.persistent and not memory.capabilities.shared_across_processes
        assert local.capabilities.persistent and local.capabilities.shared_across_processes
        assert not local.capabilities.shared_across_hosts
        assert (tmp_path / "plain-path").is_dir(), "a local root is created at construction"
    finally:
        memory.close()
        local.close()


def test_local_writes_publish_by_rename_and_leave_no_temporaries(tmp_path, scope):
    store = Store(create_backend("fsspec", {"url": f"file://{tmp_path}/kv"}))
    try:
        keys = scope.keys([page_hash(i) for i in range(20)])
        for round_ in range(3):
            assert store.put(keys, [bytes([round_]) * 1000] * 20) == [True] * 20
        files = [p for p in (tmp_path / "kv").rglob("*") if p.is_file()]
        assert sorted(p.name for p in files) == sorted(k.page_hash for k in keys)
        assert all(p.read_bytes() == b"\x02" * 1000 for p in files)
    finally:
        store.close()


def test_a_page_replaced_during_a_read_is_read_whole(tmp_path, scope, monkeypatch):
    """The read holds its open file: a rename over the page cannot mix two versions."""
    store = Store(create_backend("fsspec", {"url": f"file://{tmp_path}/kv"}))
    try:
        key = scope.key(page_hash(1))
        assert store.put([key], [b"\x01" * 8192]) == [True]
        original_open = store.top._fs.open

        def open_then_replace(path, mode="rb", **kwargs):
            handle = original_open(path, mode, **kwargs)
            if mode == "rb":  # another writer publishes a new version right after our open
                Path(path + ".new").write_bytes(b"\x02" * 8192)
                os.replace(path + ".new", path)
            return handle

        monkeypatch.setattr(store.top._fs, "open", open_then_replace)
        first, second = bytearray(4096), bytearray(4096)
        assert store.get_into([key], [[first, second]]) == [True]
        assert bytes(first + second) == b"\x01" * 8192
        monkeypatch.undo()
        assert store.get([key], 8192) == [b"\x02" * 8192]
    finally:
        store.close()


def test_unknown_protocol_is_a_config_error():
    with pytest.raises(ConfigError, match="no-such-proto"):
        create_backend("fsspec", {"url": "no-such-proto://x"})


def test_module_imports_without_fsspec_and_names_missing_s3fs():
    code = (
        "import sys; sys.modules['fsspec'] = None\n"
        "import hicache_storage.connectors.fsspec as m\n"
        "from hicache_storage.errors import MissingDependencyError\n"
        "try:\n    m.FsspecBackend({'url': 'memory://x'})\nexcept MissingDependencyError as e:\n    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "hicache-storage[fsspec]" in result.stdout
    code = (
        "import sys; sys.modules['s3fs'] = None\n"
        "from hicache_storage import create_backend\n"
        "create_backend('fsspec', {'url': 's3://bucket/x'})\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "MissingDependencyError" in result.stderr and "s3fs" in result.stderr


# --- s3:// through s3fs against SeaweedFS ---------------------------------------------------------


@pytest.mark.services
def test_s3_round_trip_is_one_object_per_page(seaweedfs, scope):
    config = s3_config(seaweedfs)
    store = Store(create_backend("fsspec", config))
    try:
        assert store.capabilities.persistent and store.capabilities.shared_across_hosts
        keys = scope.keys([page_hash(i) for i in range(4)])
        values = [os.urandom(100_000) for _ in keys]
        assert store.put_from(keys, [[v[:10], v[10:]] for v in values]) == [True] * 4
        assert store.get(keys, 100_000) == values
        object_key = config["url"].split("/", 3)[3] + "/" + keys[2].render("/")
        body = seaweedfs.client().get_object(Bucket=seaweedfs.bucket, Key=object_key)["Body"].read()
        assert body == values[2], "an independent boto3 read sees the page under its rendered key"
        assert store.delete([keys[0]]) == [True]
        assert store.delete([keys[0]]) == [False]
        store.clear(scope.namespace)
        assert store.exists(keys) == [False] * 4
    finally:
        store.close()


@pytest.mark.services
def test_s3_pages_written_elsewhere_are_seen(seaweedfs, scope):
    """No stale listing cache: a page another client writes after a listing is found."""
    config = s3_config(seaweedfs)
    reader, writer = Store(create_backend("fsspec", config)), Store(create_backend("fsspec", config))
    try:
        key = scope.key(page_hash(1))
        reader.clear(scope.namespace)  # lists the namespace (and finds nothing)
        assert reader.exists([key]) == [False]
        prefix = config["url"].split("/", 3)[3]
        seaweedfs.client().put_object(Bucket=seaweedfs.bucket, Key=f"{prefix}/{key.render('/')}", Body=b"w" * 64)
        assert reader.exists([key]) == [True]
        assert reader.get([key], 64) == [b"w" * 64]
    finally:
        reader.close()
        writer.close()


@pytest.mark.services
def test_s3_wrong_secret_is_an_authentication_error_without_the_secret(seaweedfs):
    config = s3_config(seaweedfs)
    wrong = "wrong-" + uuid.uuid4().hex
    config["secret_storage_options"] = {"secret": wrong}
    with pytest.raises(AuthenticationError) as caught:
        create_backend("fsspec", config)
    assert wrong not in str(caught.value) and seaweedfs.secret_key not in str(caught.value)


@pytest.mark.services
def test_s3_missing_bucket_is_a_config_error(seaweedfs):
    config = s3_config(seaweedfs)
    config["url"] = "s3://no-such-bucket-for-fsspec/x"
    with pytest.raises(ConfigError, match="no-such-bucket-for-fsspec"):
        create_backend("fsspec", config)


@pytest.mark.services
def test_s3_unreachable_endpoint_names_the_url(seaweedfs):
    config = s3_config(seaweedfs, endpoint_url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(BackendUnavailableError, match=f"s3://{seaweedfs.bucket}/"):
        create_backend("fsspec", config)


@pytest.mark.services
def test_s3_secret_not_in_repr_or_config(seaweedfs):
    store = create_backend("fsspec", s3_config(seaweedfs))
    try:
        secret = seaweedfs.secret_key
        assert secret not in repr(store) and secret not in str(store.config) and secret not in repr(store.config)
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.services
def test_s3_kill_and_restart(scope):
    """SIGKILL the store mid-run: typed errors or misses, then the same backend works again."""
    from hicache_storage.testing.seaweedfs import SeaweedFS

    server = SeaweedFS()
    server.start()
    try:
        store = Store(create_backend("fsspec", s3_config(server)))
        keys = scope.keys([page_hash(i) for i in range(4)])
        values = [os.urandom(2000) for _ in keys]
        assert store.put(keys, values) == [True] * 4
        server.kill()
        for call in (
            lambda: store.exists(keys),
            lambda: store.get(keys, 2000),
            lambda: store.put(keys[:1], values[:1]),
            lambda: store.delete(keys[:1]),
        ):
            try:
                results = call()
            except (BackendUnavailableError, StorageTimeoutError) as exc:
                assert f"s3://{server.bucket}/" in str(exc)
            else:
                assert not any(results), "a dead store cannot report a hit"
        server.restart()
        assert store.get(keys, 2000) == values
        store.close()
    finally:
        server.kill()
        server.stop()


# --- the shared suite -----------------------------------------------------------------------------


class TestFsspecMemoryConformance(ConformanceTests):
    backend = "fsspec"

    @pytest.fixture
    def backend_config(self) -> dict:
        return {"url": "memory://conformance"}


class TestFsspecFileConformance(ConformanceTests):
    backend = "fsspec"

    @pytest.fixture
    def backend_config(self, tmp_path) -> dict:
        return {"url": f"file://{tmp_path}/kv"}


@pytest.mark.services
class TestFsspecS3Conformance(ConformanceTests):
    backend = "fsspec"

    @pytest.fixture
    def backend_config(self, seaweedfs) -> dict:
        return s3_config(seaweedfs, path="conformance-fsspec")
