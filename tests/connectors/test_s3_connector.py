"""The s3 connector against a real SeaweedFS S3 gateway with SigV4 credentials.

botocore's Stubber appears only where a test injects an error the real server cannot be made to
send on demand (SlowDown, AccessDenied, a corrupted checksum); every behaviour is proven against
SeaweedFS.
"""

from __future__ import annotations

import base64
import logging
import os
import subprocess
import sys
import threading
import uuid
import zlib
from collections.abc import Iterator

import pytest

from hicache_storage import (
    AuthenticationError,
    BackendUnavailableError,
    ConfigError,
    ErrorStatus,
    KeyScope,
    MissingDependencyError,
    Namespace,
    PermissionDeniedError,
    Shard,
    StorageError,
    StorageTimeoutError,
    ThrottledError,
    Store,
    create_backend,
)
from hicache_storage.conformance import ConformanceTests
from hicache_storage.connectors.s3 import S3Backend
from hicache_storage.testing.process import free_port

pytestmark = pytest.mark.services

MiB = 1 << 20


def s3_config(server, **overrides) -> dict:
    """Config for the test server, under a fresh prefix so tests never see each other's objects."""
    config = {
        "bucket": server.bucket,
        "endpoint_url": server.endpoint_url,
        "region": server.region,
        "access_key_id": server.access_key,
        "secret_access_key": server.secret_key,
        "prefix": f"test-{uuid.uuid4().hex[:10]}/",
        "max_attempts": 1,
        "connect_timeout": 2,
        "read_timeout": 10,
    }
    config.update(overrides)
    return config


@pytest.fixture
def s3(seaweedfs) -> Iterator[object]:
    store = Store(create_backend("s3", s3_config(seaweedfs)))
    yield store
    store.close()


@pytest.fixture
def scope() -> KeyScope:
    return KeyScope(Namespace(model=f"s3-test-{uuid.uuid4().hex[:8]}", kv_dtype="bfloat16", page_size=64))


def page_hash(i: int) -> str:
    return f"{i:064x}"


def raw_get(server, store, key) -> bytes:
    """The stored object read with a separate boto3 client: an oracle independent of the connector."""
    response = server.client().get_object(Bucket=server.bucket, Key=store.top.config.prefix + key.render("/"))
    return response["Body"].read()


# --- round trips ----------------------------------------------------------------------------------


def test_round_trip_is_exact_and_readable_by_plain_boto3(s3, seaweedfs, scope):
    keys = scope.keys([page_hash(i) for i in range(12)])
    values = [os.urandom(64 * 1024) for _ in keys]
    assert s3.put(keys, values) == [True] * 12
    assert s3.exists(keys) == [True] * 12
    assert s3.get(keys, 64 * 1024) == values
    assert raw_get(seaweedfs, s3, keys[5]) == values[5]


def test_objects_are_named_prefix_slash_rendered_key(seaweedfs, scope):
    store = Store(create_backend("s3", s3_config(seaweedfs, prefix="/no-trailing-slash")))
    try:
        key = scope.key(page_hash(11))
        assert store.put([key], [b"named"]) == [True]
        listed = seaweedfs.client().list_objects_v2(Bucket=seaweedfs.bucket, Prefix="no-trailing-slash/")
        assert [item["Key"] for item in listed["Contents"]] == ["no-trailing-slash/" + key.render("/")]
        store.clear(scope.namespace)
    finally:
        store.close()


def test_reads_stream_into_multi_segment_targets(s3, scope):
    key = scope.key(page_hash(1))
    k_half, v_half = os.urandom(700_001), os.urandom(300_000)
    assert s3.put_from([key], [[k_half, bytearray(v_half)]]) == [True]
    sizes = [1, 65_535, 500_000, 434_465]
    targets = [bytearray(n) for n in sizes]
    assert s3.get_into([key], [targets]) == [True]
    assert b"".join(targets) == k_half + v_half


def test_multipart_upload_for_pages_above_the_threshold(seaweedfs, scope):
    store = Store(create_backend("s3", s3_config(seaweedfs, multipart_threshold=5 * MiB, multipart_part_size=5 * MiB)))
    try:
        key = scope.key(page_hash(2))
        value = os.urandom(12 * MiB + 17)
        # three segments whose boundaries do not line up with the 5 MiB parts
        segments = [value[: 3 * MiB], value[3 * MiB : 9 * MiB + 5], value[9 * MiB + 5 :]]
        assert store.put_from([key], [segments]) == [True]
        head = seaweedfs.client().head_object(
            Bucket=seaweedfs.bucket, Key=store.top.config.prefix + key.render("/"), ChecksumMode="ENABLED"
        )
        assert head["ETag"].endswith('-3"'), "a 12 MiB page in 5 MiB parts is a three-part upload"
        assert head["ChecksumCRC32"] == base64.b64encode(zlib.crc32(value).to_bytes(4, "big")).decode()
        target = [bytearray(4 * MiB), bytearray(len(value) - 4 * MiB)]
        assert store.get_into([key], [target]) == [True]
        assert b"".join(target) == value
        assert raw_get(seaweedfs, store, key) == value
    finally:
        store.close()


def test_small_pages_are_single_puts_with_a_checksum_the_store_verified(s3, seaweedfs, scope):
    key = scope.key(page_hash(3))
    value = os.urandom(100_000)
    assert s3.put([key], [value]) == [True]
    head = seaweedfs.client().head_object(
        Bucket=seaweedfs.bucket, Key=s3.top.config.prefix + key.render("/"), ChecksumMode="ENABLED"
    )
    assert "-" not in head["ETag"]
    assert head["ChecksumCRC32"] == base64.b64encode(zlib.crc32(value).to_bytes(4, "big")).decode()


def test_checksums_can_be_turned_off(seaweedfs, scope):
    store = Store(create_backend("s3", s3_config(seaweedfs, checksum_algorithm=None)))
    try:
        key = scope.key(page_hash(4))
        value = os.urandom(10_000)
        assert store.put([key], [value]) == [True]
        head = seaweedfs.client().head_object(
            Bucket=seaweedfs.bucket, Key=store.top.config.prefix + key.render("/"), ChecksumMode="ENABLED"
        )
        assert "ChecksumCRC32" not in head
        assert store.get([key], 10_000) == [value]
    finally:
        store.close()


def test_crc32c_needs_awscrt(seaweedfs, scope):
    try:
        import awscrt  # noqa: F401
    except ImportError:
        with pytest.raises(MissingDependencyError, match="awscrt"):
            create_backend("s3", s3_config(seaweedfs, checksum_algorithm="CRC32C"))
        return
    store = Store(create_backend("s3", s3_config(seaweedfs, checksum_algorithm="CRC32C")))
    try:
        key = scope.key(page_hash(5))
        assert store.put([key], [b"x" * 5000]) == [True]
        assert store.get([key], 5000) == [b"x" * 5000]
    finally:
        store.close()


def test_a_checksum_mismatch_is_a_miss(s3, scope):
    """The store's checksum is replaced in flight (fault injection): the page must read as a miss."""
    key = scope.key(page_hash(6))
    assert s3.put([key], [b"\x07" * 4096]) == [True]

    def corrupt_checksum(parsed, **_):
        if "ChecksumCRC32" in parsed:
            parsed["ChecksumCRC32"] = base64.b64encode(b"\x00\x00\x00\x01").decode()

    s3.top._client.meta.events.register("after-call.s3.GetObject", corrupt_checksum)
    assert s3.get([key], 4096) == [None]
    s3.top._client.meta.events.unregister("after-call.s3.GetObject", corrupt_checksum)
    assert s3.get([key], 4096) == [b"\x07" * 4096]


# --- misses, delete, clear ------------------------------------------------------------------------


@pytest.mark.parametrize("delta", [-1, 1, -4095])
def test_length_mismatch_is_a_miss(s3, scope, delta):
    key = scope.key(page_hash(7))
    assert s3.put([key], [os.urandom(4096)]) == [True]
    assert s3.get_into([key], [bytearray(4096 + delta)]) == [False]


def test_missing_keys_are_misses(s3, scope):
    keys = scope.keys([page_hash(i) for i in range(3)])
    assert s3.put([keys[1]], [b"m" * 100]) == [True]
    assert s3.exists(keys) == [False, True, False]
    assert s3.get(keys, 100) == [None, b"m" * 100, None]
    assert s3.prefix_exists(keys) == 0


def test_delete_reports_what_was_there(s3, scope):
    keep, gone = scope.keys([page_hash(1), page_hash(2)])
    assert s3.put([keep, gone], [b"k" * 10, b"g" * 10]) == [True, True]
    assert s3.delete([gone, scope.key(page_hash(3))]) == [True, False]
    assert s3.exists([keep, gone]) == [True, False]


def test_clear_removes_one_namespace_across_many_delete_calls(s3, seaweedfs, scope, monkeypatch):
    import hicache_storage.connectors.s3 as s3_module

    monkeypatch.setattr(s3_module, "_DELETE_BATCH", 4)  # 11 pages: three DeleteObjects calls
    mine = [scope.key(page_hash(i)) for i in range(5)]
    mine += [scope.with_part("v").key(page_hash(i)) for i in range(3)]
    mine += [KeyScope(scope.namespace, Shard(tp_rank=1, tp_size=2)).key(page_hash(i)) for i in range(3)]
    other = KeyScope(Namespace(model="s3-test-other", kv_dtype="bfloat16", page_size=64)).key(page_hash(1))
    assert s3.put(mine + [other], [b"c" * 50] * 12) == [True] * 12
    # the same namespace under another prefix belongs to another deployment: untouched
    neighbour = Store(create_backend("s3", s3_config(seaweedfs)))
    try:
        assert neighbour.put([mine[0]], [b"n" * 50]) == [True]
        s3.clear(scope.namespace)
        assert s3.exists(mine) == [False] * 11
        assert s3.get([other], 50) == [b"c" * 50]
        assert neighbour.get([mine[0]], 50) == [b"n" * 50]
    finally:
        neighbour.clear(scope.namespace)
        neighbour.close()
        s3.clear(other.scope.namespace)


# --- configuration, credentials, errors -----------------------------------------------------------


def test_credentials_from_the_aws_environment(seaweedfs, scope, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret_key)
    config = s3_config(seaweedfs)
    del config["access_key_id"], config["secret_access_key"]
    store = Store(create_backend("s3", config))
    try:
        key = scope.key(page_hash(8))
        assert store.put([key], [b"env" * 10]) == [True]
        assert store.get([key], 30) == [b"env" * 10]
    finally:
        store.close()


def test_wrong_secret_is_an_authentication_error_without_the_secret(seaweedfs):
    wrong = "wrong-" + uuid.uuid4().hex
    with pytest.raises(AuthenticationError) as caught:
        create_backend("s3", s3_config(seaweedfs, secret_access_key=wrong))
    text = str(caught.value) + repr(caught.value) + repr(caught.value.__cause__) + repr(caught.value.__context__)
    assert "SignatureDoesNotMatch" in text
    assert wrong not in text and seaweedfs.secret_key not in text


def test_unknown_access_key_is_an_authentication_error(seaweedfs):
    with pytest.raises(AuthenticationError, match="InvalidAccessKeyId|SignatureDoesNotMatch"):
        create_backend("s3", s3_config(seaweedfs, access_key_id="nobody"))


def test_missing_bucket_is_a_config_error_naming_it(seaweedfs):
    with pytest.raises(ConfigError, match="no-such-bucket-here") as caught:
        create_backend("s3", s3_config(seaweedfs, bucket="no-such-bucket-here"))
    assert caught.value.field == "bucket"


def test_unreachable_endpoint_names_the_endpoint(seaweedfs):
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.raises(BackendUnavailableError, match=f"127.0.0.1:{port}"):
        create_backend("s3", s3_config(seaweedfs, endpoint_url=endpoint))
    with pytest.raises(BackendUnavailableError) as caught:
        create_backend("s3", s3_config(seaweedfs, endpoint_url=f"http://user:url-password@127.0.0.1:{port}"))
    assert "url-password" not in str(caught.value)


def test_session_token_and_secret_stay_out_of_botocore_debug_logs(seaweedfs, caplog):
    """botocore logs signed headers at DEBUG, the session token among them; the connector redacts it."""
    import logging

    caplog.set_level(logging.DEBUG)
    token = "session-token-" + uuid.uuid4().hex
    with pytest.raises(AuthenticationError):  # SeaweedFS accepts no session tokens
        create_backend("s3", s3_config(seaweedfs, session_token=token))
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "x-amz-security-token" in logged.lower(), "botocore logged the signed headers"
    assert token not in logged and seaweedfs.secret_key not in logged


def test_secret_never_in_repr_str_or_config_errors(s3, seaweedfs):
    secret = seaweedfs.secret_key
    connector = s3.top
    assert secret not in repr(s3) and secret not in repr(connector)
    assert secret not in str(connector.config) and secret not in repr(connector.config)
    assert secret not in str(connector.config.public_dict())
    with pytest.raises(ConfigError) as caught:  # a secret without its access key id
        create_backend("s3", {"bucket": "bucket", "secret_access_key": secret})
    assert "access_key_id" in str(caught.value) and secret not in str(caught.value)
    with pytest.raises(ConfigError) as caught:  # a bad value next to the secret
        create_backend("s3", {**s3_config(seaweedfs), "max_concurrency": 0})
    assert secret not in str(caught.value)


def test_bad_config_values_are_named(tmp_path):
    with pytest.raises(ConfigError, match="multipart_part_size"):
        create_backend("s3", {"bucket": "bucket", "multipart_part_size": 1024})
    with pytest.raises(ConfigError, match="bucket"):
        create_backend("s3", {})
    with pytest.raises(ConfigError, match="verify.*CA bundle"):
        create_backend("s3", {"bucket": "bucket", "verify": str(tmp_path / "missing.pem")})
    with pytest.raises(ConfigError, match="endpoint_url"):
        create_backend("s3", {"bucket": "bucket", "endpoint_url": "not a url"})
    with pytest.raises(ConfigError, match="no-such-profile"):
        create_backend("s3", {"bucket": "bucket", "profile": "no-such-profile"})


@pytest.mark.parametrize(
    ("code", "status", "error"),
    [
        ("SlowDown", 503, ThrottledError),
        ("AccessDenied", 403, PermissionDeniedError),
        ("InternalError", 500, BackendUnavailableError),
        ("NoSuchBucket", 404, ConfigError),
        ("InvalidAccessKeyId", 403, AuthenticationError),
    ],
)
def test_error_mapping(s3, scope, code, status, error):
    """Errors SeaweedFS cannot be made to send on demand, injected with botocore's Stubber."""
    from botocore.stub import Stubber

    with Stubber(s3.top._client) as stubber:
        stubber.add_client_error("get_object", service_error_code=code, http_status_code=status)
        with pytest.raises(error) as caught:
            s3.get([scope.key(page_hash(9))], 10)
    assert caught.value.backend == "s3" and caught.value.operation == "get"


@pytest.mark.parametrize(
    ("code", "http", "status"),
    [
        ("SignatureDoesNotMatch", 403, ErrorStatus.PERMANENT),
        ("AccessDenied", 403, ErrorStatus.PERMANENT),
        ("InvalidArgument", 400, ErrorStatus.PERMANENT),
        ("RequestTimeTooSkewed", 403, ErrorStatus.PERMANENT),
        ("RequestTimeout", 400, ErrorStatus.TEMPORARY),
        ("SlowDown", 503, ErrorStatus.TEMPORARY),
        ("InternalError", 500, ErrorStatus.TEMPORARY),
    ],
)
def test_every_refusal_says_whether_trying_again_can_help(s3, scope, code, http, status):
    from botocore.stub import Stubber

    with Stubber(s3.top._client) as stubber:
        stubber.add_client_error("get_object", service_error_code=code, http_status_code=http)
        with pytest.raises(StorageError) as caught:
            s3.get([scope.key(page_hash(9))], 10)
    assert caught.value.status is status and code in str(caught.value)


def test_connection_refused_is_temporary(seaweedfs, scope):
    store = Store(UncheckedS3(s3_config(seaweedfs, endpoint_url=f"http://127.0.0.1:{free_port()}", connect_timeout=1)))
    try:
        with pytest.raises(BackendUnavailableError) as caught:
            store.exists([scope.key(page_hash(1))])
        assert caught.value.status is ErrorStatus.TEMPORARY
    finally:
        store.close()


def test_module_imports_without_boto3():
    code = (
        "import sys; sys.modules['boto3'] = None; sys.modules['botocore'] = None\n"
        "import hicache_storage.connectors.s3 as m\n"
        "from hicache_storage.errors import MissingDependencyError\n"
        "try:\n    m.S3Backend({'bucket': 'bucket'})\nexcept MissingDependencyError as e:\n    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "hicache-storage[s3]" in result.stdout


# --- a server that dies or hangs ------------------------------------------------------------------


@pytest.fixture(scope="module")
def own_seaweedfs() -> Iterator[object]:
    """A private server this module may kill and freeze without disturbing the shared one."""
    from hicache_storage.testing.seaweedfs import SeaweedFS

    server = SeaweedFS(tls=True)
    server.start()
    yield server
    server.kill()  # throwaway data: no need to wait for a graceful exit
    server.stop()


@pytest.mark.slow
def test_tls_with_the_servers_ca_bundle(own_seaweedfs, scope):
    https = own_seaweedfs.https_endpoint_url
    store = Store(create_backend("s3", s3_config(own_seaweedfs, endpoint_url=https, verify=str(own_seaweedfs.ca_bundle))))
    try:
        key = scope.key(page_hash(1))
        assert store.put([key], [b"tls" * 100]) == [True]
        assert store.get([key], 300) == [b"tls" * 100]
    finally:
        store.close()
    with pytest.raises(BackendUnavailableError, match="verify"):
        create_backend("s3", s3_config(own_seaweedfs, endpoint_url=https))  # system CAs do not know it


@pytest.mark.slow
def test_kill_and_restart(own_seaweedfs, scope):
    store = Store(create_backend("s3", s3_config(own_seaweedfs)))
    try:
        keys = scope.keys([page_hash(i) for i in range(6)])
        values = [os.urandom(32 * 1024) for _ in keys]
        assert store.put(keys, values) == [True] * 6
        own_seaweedfs.kill()
        for call in (
            lambda: store.exists(keys),
            lambda: store.get(keys, 32 * 1024),
            lambda: store.put(keys[:2], values[:2]),
            lambda: store.delete(keys[:1]),
        ):
            try:
                results = call()
            except (BackendUnavailableError, StorageTimeoutError) as exc:
                assert own_seaweedfs.endpoint_url in str(exc)
            else:
                assert not any(results), "a dead server cannot report a hit"
        own_seaweedfs.restart()
        assert store.get(keys, 32 * 1024) == values, "the same client reconnects and finds the old pages"
        new = scope.key(page_hash(99))
        assert store.put([new], [b"after" * 100]) == [True]
        assert store.get([new], 500) == [b"after" * 100]
    finally:
        store.close()


@pytest.mark.slow
def test_frozen_server_times_out_then_recovers(own_seaweedfs, scope):
    store = Store(create_backend("s3", s3_config(own_seaweedfs, read_timeout=1, connect_timeout=1)))
    try:
        key = scope.key(page_hash(1))
        assert store.put([key], [b"f" * 1000]) == [True]
        own_seaweedfs.freeze()
        try:
            with pytest.raises((StorageTimeoutError, BackendUnavailableError)):
                store.get([key], 1000)
        finally:
            own_seaweedfs.thaw()
        assert store.get([key], 1000) == [b"f" * 1000]
    finally:
        store.close()


# --- the shared suite -----------------------------------------------------------------------------


class TestS3Conformance(ConformanceTests):
    backend = "s3"

    @pytest.fixture
    def backend_config(self, seaweedfs) -> dict:
        return s3_config(seaweedfs, prefix="conformance/")


# --- the test service itself ----------------------------------------------------------------------


@pytest.mark.slow
def test_service_retries_on_new_ports_when_a_port_was_taken(monkeypatch):
    """A port picked as free can be taken before SeaweedFS binds it; start() then tries new ports."""
    import socket

    import hicache_storage.testing.seaweedfs as service

    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        picks: list[int] = []

        def first_s3_port_taken(avoid=()):
            picks.append(0)
            return taken if len(picks) == 1 + service._PORT_NAMES.index("s3.port") else free_port(avoid)

        monkeypatch.setattr(service, "free_port", first_s3_port_taken)
        server = service.SeaweedFS()
        try:
            server.start()
            assert server.s3_port != taken
            assert "address already in use" in server.log_path.read_text()
            server.client().head_bucket(Bucket=server.bucket)
        finally:
            server.kill()
            server.stop()
    assert not server.workdir.exists()


# --- a permanent error in an engine: the store is given up after its first failure -------------


class UncheckedS3(S3Backend):
    """The s3 connector without its check at open, as if the credentials were revoked after it
    opened; counts the calls that reach it (from any thread)."""

    def _check_bucket(self) -> None:
        self.calls = 0
        self._calls_lock = threading.Lock()

    def _called(self) -> None:
        with self._calls_lock:
            self.calls += 1

    def _exists(self, keys):
        self._called()
        return super()._exists(keys)

    def _get_into(self, keys, targets):
        self._called()
        return super()._get_into(keys, targets)

    def _put_from(self, keys, sources):
        self._called()
        return super()._put_from(keys, sources)


def test_engine_gives_up_a_store_with_a_wrong_secret_after_one_call_per_thread(seaweedfs, caplog):
    from hicache_core import CacheTiers, Engine, make_conversations
    from hicache_core.soak import serve_rounds, tiny_engine_config

    conversations = make_conversations(clients=2, rounds=3, turn_tokens=24, vocab_size=256, seed=5)
    with Engine(tiny_engine_config(CacheTiers.OFF, None)) as engine:
        expected = [r.output_ids for r in serve_rounds(engine, conversations, "off", 3)]
    store = UncheckedS3(s3_config(seaweedfs, secret_access_key="wrong-" + uuid.uuid4().hex))
    engine = Engine(tiny_engine_config(CacheTiers.L1_L2_L3, 10.0), storage=store)
    try:
        with caplog.at_level(logging.WARNING):
            assert [r.output_ids for r in serve_rounds(engine, conversations, "first", 3)] == expected
            engine.flush_cache()
            calls = store.calls
            assert 1 <= calls <= 2, f"{calls} calls reached a store that rejects the credentials"
            assert [r.output_ids for r in serve_rounds(engine, conversations, "again", 3)] == expected
            engine.flush_cache()
        assert store.calls == calls, "a store given up was called again"
        counters = engine.metrics.snapshot()
        assert counters["storage_disabled"] == 1 and counters["storage_permanent_errors"] == calls
        assert counters["storage_hit_tokens"] == 0 and engine.controller.threads_alive
        [line] = [r for r in caplog.records if r.levelno >= logging.ERROR]
        message = line.getMessage()
        assert "storage s3 disabled" in message and seaweedfs.endpoint_url in message
        assert "check" in message and "re-attach" in message, "the line says how to fix it"
        failure = engine.controller.storage_health.failure
        assert isinstance(failure, (AuthenticationError, PermissionDeniedError)) and failure.permanent
    finally:
        engine.close()
