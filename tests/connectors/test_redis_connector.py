"""The redis connector against real servers: standalone, TLS, unix socket, password, 3-node cluster.

Every page written is checked against an independent read path (a plain redis-py client reading
the raw key), faults are real (SIGKILL, SIGSTOP of the server process), and the conformance suite
runs against the standalone server, the cluster and a password-protected unix-socket server.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from hicache_storage.conformance import ConformanceTests
from hicache_storage.connectors.redis import REDIS_MAX_BULK_LEN, RedisBackend, RedisConfig, parse_redis_url
from hicache_storage.errors import (
    AuthenticationError,
    BackendUnavailableError,
    ConfigError,
    MissingDependencyError,
    PermissionDeniedError,
    StorageError,
    StorageTimeoutError,
    ValueTooLargeError,
)
from hicache_storage.keys import KeyScope, Namespace, Shard
from hicache_storage.registry import create_backend
from hicache_storage.store import Store
from hicache_storage.testing.process import free_port
from hicache_storage.testing.redis_server import RedisCluster, RedisServer

redis = pytest.importorskip("redis", reason="the redis extra is not installed: pip install 'hicache-storage[redis]'")

PASSWORD = "s3cret-Pa55word"


def new_scope(tag: str = "t", **shard: object) -> KeyScope:
    return KeyScope(Namespace(model=f"redis-test-{tag}-{os.urandom(4).hex()}", kv_dtype="bfloat16", page_size=64), Shard(**shard))


def random_keys(scope: KeyScope, count: int, rng: random.Random) -> list:
    return [scope.key("%064x" % rng.getrandbits(256)) for _ in range(count)]


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    return random.Random(request.node.nodeid)


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[Store]:
    opened = Store(RedisBackend({"url": redis_server.url}))
    yield opened
    opened.close()


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[object]:
    """A plain redis-py client: the independent read path."""
    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    yield client
    client.close()


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A private server this test may kill or freeze."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def password_server() -> Iterator[RedisServer]:
    server = RedisServer(password=PASSWORD, unix_socket=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tls_server() -> Iterator[RedisServer]:
    server = RedisServer(tls=True)
    server.start()
    yield server
    server.stop()


# --- the test services themselves ---------------------------------------------------------------


@pytest.mark.services
class TestServices:
    def test_a_server_that_fails_to_start_reports_its_log(self) -> None:
        from hicache_storage.testing.process import ServiceError

        server = RedisServer(extra_config=["no-such-directive yes"])
        with pytest.raises(ServiceError) as info:
            server.start()
        assert "no-such-directive" in str(info.value)
        assert not server.running()

    def test_restart_keeps_the_port_and_the_password(self) -> None:
        server = RedisServer(password=PASSWORD)
        server.start()
        try:
            port, pid = server.port, server.pid
            server.kill()
            assert not server.running()
            server.restart()
            assert server.port == port and server.pid != pid
            assert server.command("PING") == "PONG"  # authenticated with the same password
            assert PASSWORD not in " ".join(server.process.args)  # the password lives in the config file
        finally:
            server.stop()
        assert not server.running()


# --- config and URLs (no server) ----------------------------------------------------------------


class TestConfig:
    def test_defaults(self) -> None:
        config = RedisConfig.parse(None)
        assert parse_redis_url(config.url).address == "127.0.0.1:6379"
        assert config.prefix == "hicache" and config.ttl_seconds is None
        assert config.max_value_size == REDIS_MAX_BULK_LEN == 512 * 2**20

    @pytest.mark.parametrize(
        "url, clean, address, db, username",
        [
            (f"redis://:{PASSWORD}@db.example:6380/3", "redis://db.example:6380/3", "db.example:6380", 3, None),
            (f"redis://alice:{PASSWORD}@db.example/2", "redis://alice@db.example/2", "db.example:6379", 2, "alice"),
            (f"redis://db.example?password={PASSWORD}&db=5", "redis://db.example?db=5", "db.example:6379", 5, None),
            (f"rediss://:{PASSWORD}@[::1]:7000", "rediss://[::1]:7000", "[::1]:7000", 0, None),
            (f"unix://:{PASSWORD}@/run/redis.sock?db=4", "unix:///run/redis.sock?db=4", "unix:///run/redis.sock", 4, None),
        ],
    )
    def test_password_moves_out_of_the_url(self, url: str, clean: str, address: str, db: int, username: str | None) -> None:
        config = RedisConfig.parse({"url": url})
        assert config.url == clean
        assert config.password is not None and config.password.get_secret_value() == PASSWORD
        endpoint = parse_redis_url(config.url)
        assert (endpoint.address, endpoint.db, endpoint.username) == (address, db, username)
        assert PASSWORD not in repr(config) and PASSWORD not in str(config)
        assert PASSWORD not in str(config.public_dict())

    def test_password_field(self) -> None:
        config = RedisConfig.parse({"url": "redis://h:1/0", "password": PASSWORD})
        assert config.password.get_secret_value() == PASSWORD
        assert PASSWORD not in repr(config)

    @pytest.mark.parametrize(
        "config, message",
        [
            ({"url": f"redis://:{PASSWORD}@h/0", "password": "other"}, "password is given twice"),
            ({"url": f"redis://:{PASSWORD}@h/0?password=x"}, "password is given twice"),
            ({"url": f"http://:{PASSWORD}@h"}, "scheme must be one of"),
            ({"url": f"redis://:{PASSWORD}@h:99999"}, "port must be a number"),
            ({"url": f"redis://:{PASSWORD}@h/x"}, "non-negative integer"),
            ({"url": f"redis://:{PASSWORD}@h/1?db=2"}, "database twice"),
            ({"url": f"redis://:{PASSWORD}@h?socket_timeout=1"}, "unsupported url query parameter"),
            ({"url": f"redis://:{PASSWORD}@/0"}, "no host"),
            ({"url": "unix://"}, "socket path"),
            ({"url": f"redis://:{PASSWORD}@h/1", "cluster": True}, "only database 0"),
            ({"url": "unix:///tmp/r.sock", "startup_nodes": ["h:7000"]}, "unix socket"),
            ({"url": f"redis://:{PASSWORD}@h", "ssl_ca_certs": "/ca.pem"}, "rediss://"),
            ({"startup_nodes": ["no-port"]}, "host:port"),
            ({"prefix": "a*"}, "prefix must be"),
            ({"prefix": "{tag}"}, "prefix must be"),
            ({"ttl_seconds": 0}, "greater than 0"),
            ({"max_value_size": 0}, "greater than 0"),
            ({"socket_timeout": -1}, "greater than 0"),
            ({"url": f"redis://:{PASSWORD}@h", "bogus": 1}, "unknown config key"),
        ],
    )
    def test_bad_config_is_named_without_the_password(self, config: dict, message: str) -> None:
        with pytest.raises(ConfigError) as info:
            RedisConfig.parse(config)
        assert message in str(info.value)
        assert PASSWORD not in str(info.value)

    def test_cluster_is_implied_by_startup_nodes(self) -> None:
        assert RedisConfig.parse({"startup_nodes": ["10.0.0.2:7000"]}).is_cluster
        assert RedisConfig.parse({"cluster": True}).is_cluster
        assert not RedisConfig.parse({}).is_cluster

    def test_module_imports_without_redis_py(self) -> None:
        script = (
            "import sys; sys.modules['redis'] = None\n"
            "import hicache_storage.connectors.redis as m\n"
            "from hicache_storage.errors import MissingDependencyError\n"
            "try:\n    m.RedisBackend({})\n"
            "except MissingDependencyError as e:\n    print('missing', e.package, e.extra)\n"
        )
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "missing redis redis"
        assert issubclass(MissingDependencyError, StorageError)


# --- standalone server --------------------------------------------------------------------------


@pytest.mark.services
class TestStandalone:
    def test_registered_name(self, redis_server: RedisServer) -> None:
        with Store(create_backend("redis", {"url": redis_server.url})) as store:
            assert isinstance(store.top, RedisBackend)

    def test_roundtrip_is_binary_safe_and_stored_under_the_rendered_key(
        self, store: Store, raw: object, rng: random.Random
    ) -> None:
        scope = new_scope(tp_rank=1, tp_size=2)
        keys = random_keys(scope, 5, rng)
        values = [bytes(range(256)) * 16, (b"\r\n$-1\r\n" * 600)[:4096], bytes(4096), b"\xff" * 4096, rng.randbytes(4096)]
        assert store.put(keys, values) == [True] * 5
        assert store.get(keys, 4096) == values
        for key, value in zip(keys, values):
            assert raw.get(f"hicache:{key.render(':')}") == value
            expected = f"hicache:{scope.namespace.fingerprint}:tp1of2-pp0of1-cp0of1:kv:{key.page_hash}"
            assert expected == f"hicache:{key.render(':')}"

    def test_segments_in_and_out(self, store: Store, rng: random.Random) -> None:
        import numpy as np

        [key] = random_keys(new_scope(), 1, rng)
        k_half, v_half = np.frombuffer(rng.randbytes(2048), dtype=np.uint8), rng.randbytes(2048)
        assert store.put_from([key], [[k_half, v_half]]) == [True]
        target = np.zeros(4096, dtype=np.uint8)
        assert store.get_into([key], [[target[:1000], target[1000:]]]) == [True]
        assert target.tobytes() == k_half.tobytes() + v_half

    def test_empty_page(self, store: Store, rng: random.Random) -> None:
        [key] = random_keys(new_scope(), 1, rng)
        assert store.put([key], [b""]) == [True]
        assert store.get([key], 0) == [b""]
        assert store.get([key], 1) == [None]

    def test_per_key_results_in_order_with_duplicates(self, store: Store, rng: random.Random) -> None:
        scope = new_scope()
        present, absent = random_keys(scope, 3, rng), random_keys(scope, 2, rng)
        store.put(present, [b"a" * 8, b"b" * 8, b"c" * 8])
        batch = [present[0], absent[0], present[2], present[0], absent[1], present[1]]
        assert store.exists(batch) == [True, False, True, True, False, True]
        assert store.get(batch, 8) == [b"a" * 8, None, b"c" * 8, b"a" * 8, None, b"b" * 8]
        assert store.prefix_exists(batch) == 1

    def test_other_length_is_a_miss(self, store: Store, rng: random.Random) -> None:
        [key] = random_keys(new_scope(), 1, rng)
        store.put([key], [b"x" * 100])
        assert store.get([key], 99) == [None]
        assert store.get([key], 101) == [None]
        assert store.get([key], 100) == [b"x" * 100]

    def test_a_foreign_value_type_is_a_per_key_miss(self, store: Store, raw: object, rng: random.Random) -> None:
        keys = random_keys(new_scope(), 2, rng)
        raw.hset(f"hicache:{keys[0].render(':')}", "field", "not a page")  # GET on it fails with WRONGTYPE
        store.put(keys[1:], [b"page"])
        assert store.get(keys, 4) == [None, b"page"]
        assert store.put(keys[:1], [b"mine"]) == [True]  # SET replaces any type
        assert store.get(keys, 4) == [b"mine", b"page"]

    def test_delete(self, store: Store, raw: object, rng: random.Random) -> None:
        keys = random_keys(new_scope(), 3, rng)
        store.put(keys[:2], [b"1", b"2"])
        assert store.delete(keys) == [True, True, False]
        assert store.exists(keys) == [False, False, False]
        assert raw.exists(*[f"hicache:{k.render(':')}" for k in keys]) == 0

    def test_clear_removes_one_namespace_in_batches(
        self, redis_server: RedisServer, store: Store, raw: object, rng: random.Random
    ) -> None:
        doomed, kept = new_scope("doomed"), new_scope("kept")
        other_part = doomed.with_part("swa")
        doomed_keys = random_keys(doomed, 1200, rng) + random_keys(other_part, 30, rng)  # more than one UNLINK batch
        kept_keys = random_keys(kept, 20, rng)
        with Store(RedisBackend({"url": redis_server.url, "prefix": "elsewhere"})) as other_prefix:
            other_prefix.put(doomed_keys[:10], [b"p"] * 10)
            store.put(doomed_keys, [b"d"] * len(doomed_keys))
            store.put(kept_keys, [b"k"] * len(kept_keys))
            store.clear(doomed.namespace)
            assert store.exists(doomed_keys) == [False] * len(doomed_keys)
            assert store.exists(kept_keys) == [True] * len(kept_keys)
            assert other_prefix.exists(doomed_keys[:10]) == [True] * 10  # another prefix is another store
            assert list(raw.scan_iter(match=f"hicache:{doomed.namespace.fingerprint}:*")) == []
            other_prefix.clear(doomed.namespace)

    def test_prefixes_and_databases_are_separate_stores(self, redis_server: RedisServer, rng: random.Random) -> None:
        [key] = random_keys(new_scope(), 1, rng)
        base = redis_server.url.rsplit("/", 1)[0]
        with (
            Store(RedisBackend({"url": f"{base}/0"})) as db0,
            Store(RedisBackend({"url": f"{base}/1"})) as db1,
            Store(RedisBackend({"url": f"{base}?db=1", "prefix": "tenant2"})) as db1_other,
        ):
            assert db1.put([key], [b"in db 1"]) == [True]
            assert db0.exists([key]) == [False]
            assert db1_other.exists([key]) == [False]
            assert db1.get([key], 7) == [b"in db 1"]
            raw1 = redis.Redis(host=redis_server.host, port=redis_server.port, db=1)
            assert raw1.get(f"hicache:{key.render(':')}") == b"in db 1"
            raw1.close()
            db1.delete([key])

    @pytest.mark.slow
    def test_ttl_expires_pages(self, redis_server: RedisServer, raw: object, rng: random.Random) -> None:
        keys = random_keys(new_scope(), 2, rng)
        with Store(RedisBackend({"url": redis_server.url, "ttl_seconds": 1})) as backend:
            assert backend.capabilities.ttl and backend.capabilities.evicts
            assert backend.put(keys, [b"a", b"b"]) == [True, True]
            assert 0 < raw.pttl(f"hicache:{keys[0].render(':')}") <= 1000
            assert backend.exists(keys) == [True, True]
            time.sleep(1.5)  # let Redis expire them
            assert backend.exists(keys) == [False, False]
            assert backend.get(keys, 1) == [None, None]

    def test_without_ttl_pages_do_not_expire(self, store: Store, raw: object, rng: random.Random) -> None:
        [key] = random_keys(new_scope(), 1, rng)
        store.put([key], [b"v"])
        assert raw.ttl(f"hicache:{key.render(':')}") == -1
        assert not store.capabilities.evicts  # the test server runs with maxmemory-policy noeviction

    def test_max_value_size_is_configurable(self, redis_server: RedisServer, rng: random.Random) -> None:
        [key] = random_keys(new_scope(), 1, rng)
        with Store(RedisBackend({"url": redis_server.url, "max_value_size": 1000})) as backend:
            assert backend.capabilities.max_value_size == 1000
            with pytest.raises(ValueTooLargeError):
                backend.put([key], [bytes(1001)])
            assert backend.put([key], [bytes(1000)]) == [True]

    def test_server_limit_lowers_max_value_size(self) -> None:
        server = RedisServer(extra_config=["proto-max-bulk-len 2mb"])
        server.start()
        try:
            with Store(RedisBackend({"url": server.url})) as backend:
                assert backend.capabilities.max_value_size == 2 * 2**20
        finally:
            server.stop()

    def test_server_eviction_policy_is_declared(self) -> None:
        server = RedisServer(extra_config=["maxmemory 64mb", "maxmemory-policy allkeys-lru"])
        server.start()
        try:
            with Store(RedisBackend({"url": server.url})) as backend:
                assert backend.capabilities.evicts
        finally:
            server.stop()

    def test_a_full_server_refuses_pages_one_by_one(self, rng: random.Random) -> None:
        """With maxmemory and noeviction, writes past the limit fail as per-key False."""
        server = RedisServer(extra_config=["maxmemory 4mb", "maxmemory-policy noeviction"])
        server.start()
        try:
            keys = random_keys(new_scope(), 16, rng)
            values = [rng.randbytes(512 * 1024) for _ in keys]
            with Store(RedisBackend({"url": server.url})) as backend:
                assert not backend.capabilities.evicts
                stored = backend.put(keys, values)
                assert True in stored and False in stored
                assert backend.get(keys, 512 * 1024) == [v if ok else None for v, ok in zip(values, stored)]
        finally:
            server.stop()

    def test_large_batches_are_split_to_max_batch(self, redis_server: RedisServer, rng: random.Random) -> None:
        keys = random_keys(new_scope(), 50, rng)
        values = [rng.randbytes(64) for _ in keys]
        with Store(RedisBackend({"url": redis_server.url, "max_batch": 7})) as backend:
            assert backend.capabilities.max_batch == 7
            assert backend.put(keys, values) == [True] * 50
            assert backend.get(keys, 64) == values

    def test_unix_socket_with_password(self, password_server: RedisServer, rng: random.Random) -> None:
        [key] = random_keys(new_scope(), 1, rng)
        with Store(RedisBackend({"url": password_server.unix_url, "password": PASSWORD})) as backend:
            assert not backend.capabilities.shared_across_hosts
            assert backend.put([key], [b"over a socket file"]) == [True]
            assert backend.get([key], 18) == [b"over a socket file"]

    def test_tls_with_ca_bundle(self, tls_server: RedisServer, rng: random.Random) -> None:
        [key] = random_keys(new_scope(), 1, rng)
        assert tls_server.url.startswith("rediss://")
        with Store(RedisBackend({"url": tls_server.url, "ssl_ca_certs": str(tls_server.ca_path)})) as backend:
            assert backend.put([key], [b"encrypted"]) == [True]
            assert backend.get([key], 9) == [b"encrypted"]

    def test_tls_without_the_ca_is_a_config_error(self, tls_server: RedisServer) -> None:
        with pytest.raises(ConfigError) as info:
            RedisBackend({"url": tls_server.url})
        assert info.value.field == "ssl_ca_certs"


# --- credentials and unreachable servers --------------------------------------------------------


@pytest.mark.services
class TestFailures:
    def test_right_password_in_url_or_field(self, password_server: RedisServer, rng: random.Random) -> None:
        [key] = random_keys(new_scope(), 1, rng)
        url_with_password = f"redis://:{PASSWORD}@{password_server.address}/0"
        for config in ({"url": url_with_password}, {"url": password_server.url, "password": PASSWORD}):
            with Store(RedisBackend(config)) as backend:
                assert backend.put([key], [b"ok"]) == [True]
                assert PASSWORD not in repr(backend) and PASSWORD not in str(backend)
                assert PASSWORD not in repr(backend.top) and PASSWORD not in str(backend.top)

    @pytest.mark.parametrize("given", ["wrong-password", None])
    def test_wrong_or_missing_password(self, password_server: RedisServer, given: str | None) -> None:
        url = f"redis://:{given}@{password_server.address}/0" if given else password_server.url
        with pytest.raises(AuthenticationError) as info:
            RedisBackend({"url": url})
        assert not info.value.retryable
        assert password_server.address in str(info.value)
        for text in _error_texts(info.value):
            assert PASSWORD not in text and "wrong-password" not in text

    def test_acl_user_and_its_permissions(self, rng: random.Random) -> None:
        acl = [
            f"user writer on >{PASSWORD} ~hicache:* +@all",
            f"user reader on >{PASSWORD} ~hicache:* +ping +get +exists +scan +config|get +hello +auth",
        ]
        server = RedisServer(extra_config=acl)
        server.start()
        try:
            [key] = random_keys(new_scope(), 1, rng)
            with Store(RedisBackend({"url": f"redis://writer@{server.address}/0", "password": PASSWORD})) as writer:
                assert writer.put([key], [b"acl"]) == [True]
            with Store(RedisBackend({"url": f"redis://reader@{server.address}/0", "password": PASSWORD})) as reader:
                assert reader.get([key], 3) == [b"acl"]
                with pytest.raises(PermissionDeniedError) as info:
                    reader.put([key], [b"no!"])
                assert "'set' command" in str(info.value) and not info.value.retryable
                assert PASSWORD not in str(info.value)
            with pytest.raises(AuthenticationError):
                RedisBackend({"url": f"redis://nobody@{server.address}/0", "password": PASSWORD})
        finally:
            server.stop()

    def test_unreachable_server_is_named(self) -> None:
        port = free_port()
        with pytest.raises(BackendUnavailableError) as info:
            RedisBackend({"url": f"redis://:{PASSWORD}@127.0.0.1:{port}/0", "connect_timeout": 1})
        assert f"127.0.0.1:{port}" in str(info.value)
        assert info.value.retryable and info.value.operation == "connect"
        for text in _error_texts(info.value):
            assert PASSWORD not in text

    def test_missing_socket_file_is_named(self, tmp_path) -> None:
        path = tmp_path / "nothing.sock"
        with pytest.raises(BackendUnavailableError) as info:
            RedisBackend({"url": f"unix://{path}"})
        assert str(path) in str(info.value)

    def test_unreachable_cluster_is_named(self) -> None:
        port = free_port()
        with pytest.raises(BackendUnavailableError) as info:
            RedisBackend({"url": f"redis://127.0.0.1:{port}", "cluster": True, "connect_timeout": 1})
        assert f"127.0.0.1:{port}" in str(info.value)

    def test_killed_server_gives_typed_errors_then_reconnects(self, own_server: RedisServer, rng: random.Random) -> None:
        keys = random_keys(new_scope(), 4, rng)
        values = [rng.randbytes(512) for _ in keys]
        with Store(RedisBackend({"url": own_server.url, "connect_timeout": 1, "socket_timeout": 2})) as backend:
            assert backend.put(keys, values) == [True] * 4
            own_server.kill()
            for call in (
                lambda: backend.exists(keys),
                lambda: backend.get(keys, 512),
                lambda: backend.put(keys, values),
                lambda: backend.delete(keys),
                lambda: backend.clear(keys[0].scope.namespace),
            ):
                with pytest.raises(BackendUnavailableError) as info:
                    call()
                assert info.value.retryable and own_server.address in str(info.value)
            own_server.restart()  # same port, empty (the test server keeps nothing on disk)
            assert backend.exists(keys) == [False] * 4
            assert backend.put(keys, values) == [True] * 4
            assert backend.get(keys, 512) == values

    def test_frozen_server_times_out_and_never_mixes_replies(self, own_server: RedisServer, rng: random.Random) -> None:
        keys = random_keys(new_scope(), 2, rng)
        values = [b"A" * 1024, b"B" * 1024]
        with Store(RedisBackend({"url": own_server.url, "socket_timeout": 0.5, "retries": 0, "max_connections": 1})) as backend:
            assert backend.put(keys, values) == [True, True]
            own_server.freeze()
            try:
                with pytest.raises(StorageTimeoutError) as info:
                    backend.get(keys[:1], 1024)
                assert info.value.retryable
            finally:
                own_server.thaw()
            # The server now answers the abandoned GET; with one pooled connection, a reused
            # socket would hand that reply ("A...") to this request for B.
            assert backend.get(keys[1:], 1024) == [values[1]]
            assert backend.get(keys, 1024) == values


@pytest.mark.services
def test_concurrent_callers_survive_a_kill_and_restart(own_server: RedisServer, rng: random.Random) -> None:
    """Threads keep reading and writing while the server dies and returns.

    Every hit must be the exact page for its key, every failure a retryable StorageError, and
    every thread must succeed again after the restart.
    """
    keys = random_keys(new_scope(), 64, rng)
    expected = {key: hashlib.sha256(key.page_hash.encode()).digest() * 32 for key in keys}
    wrong: list[object] = []
    unexpected: list[BaseException] = []
    failures = [0]
    done_before, done_after = [0], [0]
    restarted, stop = threading.Event(), threading.Event()

    def worker(seed: int) -> None:
        picker = random.Random(seed)
        while not stop.is_set():
            batch = picker.sample(keys, 8)
            try:
                backend.put(batch, [expected[key] for key in batch])
                for key, value in zip(batch, backend.get(batch, 1024)):
                    if value is not None and value != expected[key]:
                        wrong.append(key)
                (done_after if restarted.is_set() else done_before)[0] += 1
            except StorageError as exc:
                failures[0] += 1
                if not exc.retryable:
                    unexpected.append(exc)
            except BaseException as exc:  # anything else is a crash the connector let through
                unexpected.append(exc)

    def wait_for(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 60  # a hang detector, not a performance bound
        while not condition():
            assert time.monotonic() < deadline, f"gave up waiting for {what}"
            time.sleep(0.01)

    config = {"url": own_server.url, "connect_timeout": 1, "socket_timeout": 2, "max_connections": 8}
    with Store(RedisBackend(config)) as backend:
        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        try:
            wait_for(lambda: done_before[0] >= 40, "calls before the kill")
            own_server.kill()
            wait_for(lambda: failures[0] >= 8, "calls to fail while the server is down")
            own_server.restart()
            restarted.set()
            wait_for(lambda: done_after[0] >= 40, "calls to succeed after the restart")
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=60)
    assert not wrong, f"{len(wrong)} reads returned bytes that were never written for their key"
    assert not unexpected, unexpected[0]


def _error_texts(error: BaseException) -> list[str]:
    texts = []
    while error is not None:
        texts += [str(error), repr(error)]
        error = error.__cause__ or error.__context__
    return texts


# --- cluster ------------------------------------------------------------------------------------


@pytest.mark.services
class TestCluster:
    @pytest.fixture
    def cluster_store(self, redis_cluster: RedisCluster) -> Iterator[Store]:
        opened = Store(RedisBackend({"url": redis_cluster.url, "cluster": True}))
        yield opened
        opened.close()

    def test_batch_spanning_many_slots_comes_back_in_order(
        self, redis_cluster: RedisCluster, cluster_store: Store, rng: random.Random
    ) -> None:
        from redis.cluster import key_slot

        scope = new_scope()
        keys = random_keys(scope, 600, rng)
        values = [i.to_bytes(4, "little") + rng.randbytes(60) for i in range(len(keys))]
        assert len({key_slot(f"hicache:{k.render(':')}".encode()) for k in keys}) > 500
        assert cluster_store.put(keys, values) == [True] * len(keys)
        assert cluster_store.get(keys, 64) == values
        missing = random_keys(scope, 100, rng)
        mixed = [k for pair in zip(keys[:100], missing) for k in pair]
        assert cluster_store.exists(mixed) == [True, False] * 100
        assert cluster_store.get(mixed[:6], 64) == [values[0], None, values[1], None, values[2], None]
        assert cluster_store.delete(mixed[:4]) == [True, False, True, False]

    def test_pages_spread_over_every_node_and_clear_reaches_them_all(
        self, redis_cluster: RedisCluster, cluster_store: Store, rng: random.Random
    ) -> None:
        doomed, kept = new_scope("doomed"), new_scope("kept")
        keys = random_keys(doomed, 300, rng)
        kept_keys = random_keys(kept, 30, rng)
        cluster_store.put(keys, [b"d"] * len(keys))
        cluster_store.put(kept_keys, [b"k"] * len(kept_keys))
        pattern = f"hicache:{doomed.namespace.fingerprint}:*"
        per_node = [_scan_count(redis_cluster, port, pattern) for port in redis_cluster.ports]
        assert all(count > 0 for count in per_node) and sum(per_node) == len(keys), per_node
        cluster_store.clear(doomed.namespace)
        assert [_scan_count(redis_cluster, port, pattern) for port in redis_cluster.ports] == [0, 0, 0]
        assert cluster_store.exists(kept_keys) == [True] * len(kept_keys)
        cluster_store.clear(kept.namespace)

    def test_startup_nodes_alone_select_cluster_mode(self, redis_cluster: RedisCluster, rng: random.Random) -> None:
        keys = random_keys(new_scope(), 20, rng)
        first, *others = redis_cluster.startup_nodes
        with Store(RedisBackend({"url": f"redis://{first}", "startup_nodes": others})) as backend:
            assert backend.put(keys, [b"x"] * 20) == [True] * 20
            assert backend.exists(keys) == [True] * 20
            backend.delete(keys)

    @pytest.mark.slow
    def test_tls_cluster_with_password(self, rng: random.Random) -> None:
        cluster = RedisCluster(nodes=3, password=PASSWORD, tls=True)
        cluster.start()
        try:
            assert cluster.url.startswith("rediss://")
            scope = new_scope()
            keys = random_keys(scope, 60, rng)
            values = [rng.randbytes(200) for _ in keys]
            config = {"url": cluster.url, "cluster": True, "password": PASSWORD, "ssl_ca_certs": str(cluster.ca_path)}
            with Store(RedisBackend(config)) as backend:
                assert backend.put(keys, values) == [True] * 60
                assert backend.get(keys, 200) == values
                backend.clear(scope.namespace)
                assert backend.exists(keys) == [False] * 60
                assert PASSWORD not in repr(backend) and PASSWORD not in repr(backend.top)
            wrong = f"rediss://:wrong-password@{cluster.nodes[0].address}"
            for url in (wrong, cluster.url):
                with pytest.raises(AuthenticationError) as info:
                    RedisBackend({"url": url, "cluster": True, "ssl_ca_certs": str(cluster.ca_path)})
                for text in _error_texts(info.value):
                    assert PASSWORD not in text and "wrong-password" not in text
        finally:
            cluster.stop()

    @pytest.mark.slow
    def test_a_moved_slot_is_followed(self, rng: random.Random) -> None:
        """Move a key's slot to another node behind the client's back: MOVED is followed."""
        from redis.cluster import key_slot

        cluster = RedisCluster(nodes=3)
        cluster.start()
        try:
            with Store(RedisBackend({"url": cluster.url, "cluster": True})) as backend:
                [key] = random_keys(new_scope(), 1, rng)
                name = f"hicache:{key.render(':')}"
                slot = key_slot(name.encode())
                owner = next(i for i, node in enumerate(cluster.nodes) if _owns(node, slot))
                assert cluster.nodes[owner].command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
                target = cluster.nodes[(owner + 1) % 3]
                target_id = target.command("CLUSTER", "MYID")
                for node in [target, *(n for n in cluster.nodes if n is not target)]:
                    node.command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
                assert backend.put([key], [b"moved"]) == [True]  # the client still routes to the old owner
                assert target.command("GET", name) == "moved"
                assert backend.get([key], 5) == [b"moved"]
                assert backend.exists([key]) == [True]
        finally:
            cluster.stop()

    @pytest.mark.slow
    def test_frozen_node_costs_one_timeout_per_attempt_not_per_key(
        self, rng: random.Random, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        cluster = RedisCluster(nodes=3)
        cluster.start()
        try:
            keys = random_keys(new_scope(), 90, rng)
            values = [rng.randbytes(100) for _ in keys]
            config = {"url": cluster.url, "cluster": True, "socket_timeout": 0.5, "retries": 1}
            with Store(RedisBackend(config)) as backend:
                assert backend.put(keys, values) == [True] * 90
                timeouts = _count_timeouts(monkeypatch)
                cluster.freeze(1)
                try:
                    with pytest.raises(StorageTimeoutError):
                        backend.get(keys, 100)  # about 30 of the keys live on the frozen node
                    assert timeouts[0] == 2  # the first try and one retry, whatever the key count
                finally:
                    cluster.thaw(1)
                assert backend.get(keys, 100) == values  # replies never cross between requests
        finally:
            cluster.stop()

    @pytest.mark.slow
    def test_killed_node_gives_typed_errors_then_recovers(self, rng: random.Random) -> None:
        cluster = RedisCluster(nodes=3)
        cluster.start()
        try:
            keys = random_keys(new_scope(), 60, rng)
            values = [rng.randbytes(100) for _ in keys]
            with Store(RedisBackend({"url": cluster.url, "cluster": True, "connect_timeout": 1, "socket_timeout": 2})) as backend:
                assert backend.put(keys, values) == [True] * 60
                cluster.kill(1)
                with pytest.raises(BackendUnavailableError):
                    backend.get(keys, 100)  # a third of the pages live on the dead node
                cluster.restart(1)
                assert backend.put(keys, values) == [True] * 60
                assert backend.get(keys, 100) == values
        finally:
            cluster.stop()


def _owns(node: RedisServer, slot: int) -> bool:
    """Whether ``node`` serves ``slot``, from its own CLUSTER SLOTS view."""
    for low, high, primary, *_ in node.command("CLUSTER", "SLOTS"):
        if low <= slot <= high and int(primary[1]) == node.port:
            return True
    return False


def _count_timeouts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the socket timeouts redis-py raises (an observation: behaviour is unchanged)."""
    counter = [0]

    class CountedTimeout(redis.exceptions.TimeoutError):
        def __init__(self, *args: object) -> None:
            counter[0] += 1
            super().__init__(*args)

    for name, module in list(sys.modules.items()):
        # Name first: getattr on other packages' lazy modules can import things (transformers does).
        if name.startswith("redis.") and name != "redis.exceptions":
            if getattr(module, "TimeoutError", None) is redis.exceptions.TimeoutError:
                monkeypatch.setattr(module, "TimeoutError", CountedTimeout)
    return counter


def _scan_count(cluster: RedisCluster, port: int, pattern: str) -> int:
    client = redis.Redis(host=cluster.host, port=port)
    try:
        return sum(1 for _ in client.scan_iter(match=pattern, count=1000))
    finally:
        client.close()


# --- the conformance suite ----------------------------------------------------------------------


@pytest.mark.services
class TestRedisConformance(ConformanceTests):
    backend = "redis"

    @pytest.fixture
    def backend_config(self, redis_server: RedisServer) -> dict:
        return {"url": redis_server.url}


@pytest.mark.services
class TestRedisClusterConformance(ConformanceTests):
    backend = "redis"

    @pytest.fixture
    def backend_config(self, redis_cluster: RedisCluster) -> dict:
        return {"url": redis_cluster.url, "cluster": True}


@pytest.mark.services
class TestRedisUnixPasswordTTLConformance(ConformanceTests):
    """Unix socket, password, TTL, another prefix and a small value limit the suite writes in full."""

    backend = "redis"

    @pytest.fixture
    def backend_config(self, password_server: RedisServer) -> dict:
        return {
            "url": password_server.unix_url,
            "password": PASSWORD,
            "prefix": "conformance",
            "ttl_seconds": 3600,
            "max_value_size": 4 * 2**20,
        }
