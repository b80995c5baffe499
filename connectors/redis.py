"""Redis connector: a standalone server or a Redis Cluster, one pipeline per batch (redis-py).

Contract, beyond the one every connector keeps (see :mod:`hicache_storage.backend`):

* **Keys.** ``<prefix>:<namespace fingerprint>:<shard>:<part>:<page hash>``, one Redis string per
  page holding its raw bytes. ``SET`` replaces a value atomically, so a reader sees a whole page or
  none. A stored value whose length differs from the target's is a miss.
* **Batches.** ``exists``, ``get_into``, ``put_from`` and ``delete`` each send one pipeline of
  single-key commands (``EXISTS``, ``GET``, ``SET``, ``UNLINK``): one round trip per batch and one
  result per key. A multi-key ``EXISTS`` would count keys, not say which exist.
* **Cluster.** Keys carry no hash tag: the pages of one namespace and shard spread over every
  node, so capacity and bandwidth grow with the cluster and no node is a hot spot. A batch then
  spans many slots; it is grouped by the primary owning each key's slot, one pipeline per node,
  all sent at once, and the replies are put back in request order. Keys whose slot is migrating
  (``MOVED``/``ASK``/``TRYAGAIN``) are re-sent through redis-py's cluster client, which follows the
  redirection and updates its slot map; after a connection failure the slot map is re-read before
  the next call (a failover moves slots). ``clear`` scans every primary.
* **Copies.** Not zero-copy: redis-py reads a value into a new ``bytes`` that is then copied into
  the caller's segments, and a page of several segments is joined before it is sent.
* **Failures.** An unreachable server at construction raises ``BackendUnavailableError`` naming
  the address; rejected credentials raise ``AuthenticationError``. A server that dies mid-run makes
  calls raise ``BackendUnavailableError`` / ``StorageTimeoutError`` (both retryable) after at most
  ``retries + 1`` attempts of ``socket_timeout`` each, however many keys the batch has; the pool
  reconnects on its own once the server is back. A connection that timed out is closed, never
  reused, so a late reply can never be read as the answer to a later request.
* **Secrets.** A password given in the URL is moved into the ``password`` field (a ``SecretStr``)
  when the config is parsed, so ``repr``, logs and error messages never show it.
* **Thread safety.** Every method may be called from several threads: each call takes its own
  pipelines and connections from thread-safe pools. In cluster mode a call sends its per-node
  pipelines from a small thread pool the backend owns (closed by ``close``).
"""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import pydantic

from hicache_storage.backend import StorageBackend
from hicache_storage.buffers import Segments, fill_segments, join_segments, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.errors import (
    AuthenticationError,
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    MissingDependencyError,
    PermissionDeniedError,
    StorageError,
    StorageTimeoutError,
)
from hicache_storage.keys import Namespace, PageKey

#: Redis' own limit on one value (``proto-max-bulk-len``), unless the server is configured lower.
REDIS_MAX_BULK_LEN = 512 * 1024 * 1024
_SCHEMES = ("redis", "rediss", "unix")
# No glob characters (clear() builds a SCAN pattern from it) and no braces (a hash tag).
_PREFIX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_USERINFO_RE = re.compile(r"(//[^/@?#]*?):[^/@?#]*@")
_SCAN_COUNT = 1000
_CLEAR_BATCH = 500


# --- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RedisEndpoint:
    """Where a URL points, without credentials."""

    scheme: str
    host: str | None
    port: int | None
    path: str | None  # the socket file, for unix://
    db: int
    username: str | None

    @property
    def address(self) -> str:
        if self.scheme == "unix":
            return f"unix://{self.path}"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_redis_url(url: str) -> RedisEndpoint:
    """Parse a password-free Redis URL; ``ValueError`` says what is wrong with it."""
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ValueError("url is malformed; expected redis://host:port/db, rediss://host:port/db or unix:///path?db=N") from None
    try:
        port = parts.port
    except ValueError:
        raise ValueError("the url's port must be a number from 1 to 65535") from None
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(f"url scheme must be one of {', '.join(s + '://' for s in _SCHEMES)}; got {parts.scheme or '(none)'!r}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    if parts.password is not None or any(name == "password" for name, _ in query):
        raise ValueError("the password is given twice; put it either in the url or in the 'password' field")
    unknown = sorted({name for name, _ in query} - {"db"})
    if unknown:
        raise ValueError(
            f"unsupported url query parameter(s) {', '.join(unknown)}; only 'db' is read from the url, "
            "set timeouts, TLS and pool size as config fields"
        )
    db_texts = [value for name, value in query if name == "db"]
    if scheme == "unix":
        path = unquote(parts.path)
        if not path:
            raise ValueError("a unix:// url needs the socket path, as in unix:///run/redis.sock?db=0")
        host = None
    else:
        host, path = parts.hostname, None
        if not host:
            raise ValueError(f"url has no host; expected {scheme}://host:port/db")
        port = port or 6379
        if parts.path.strip("/"):
            db_texts.append(parts.path.strip("/"))
    if len(set(db_texts)) > 1:
        raise ValueError(f"url names the database twice with different values: {', '.join(db_texts)}")
    db_text = db_texts[0] if db_texts else "0"
    if not db_text.isdigit():
        raise ValueError(f"the database must be a non-negative integer, got {db_text!r}")
    username = unquote(parts.username or "") or None
    return RedisEndpoint(scheme, host, port if scheme != "unix" else None, path, int(db_text), username)


def _split_password(url: str) -> tuple[str, list[str]]:
    """The URL without any password (from userinfo or the query string), and the passwords found."""
    try:
        parts = urlsplit(url)
        userinfo_password = parts.password
    except ValueError:
        return _USERINFO_RE.sub(r"\1:***@", url), []
    query = parse_qsl(parts.query, keep_blank_values=True)
    found = ([unquote(userinfo_password)] if userinfo_password is not None else []) + [
        value for name, value in query if name == "password"
    ]
    if not found:
        return url, []
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    netloc = f"{user}@{hostport}" if user else hostport
    rest = "&".join(f"{name}={value}" for name, value in query if name != "password")
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{rest}" if rest else ""), found


class RedisConfig(BackendConfig):
    url: str = pydantic.Field(
        "redis://127.0.0.1:6379/0",
        description="redis://[user[:password]@]host:port/db, rediss://... for TLS, or unix:///path/to/socket?db=N",
    )
    password: pydantic.SecretStr | None = pydantic.Field(
        None, description="the server password (or the ACL user's); may also be given in the url"
    )
    cluster: bool = pydantic.Field(False, description="talk to a Redis Cluster through the node in the url")
    startup_nodes: list[str] = pydantic.Field(
        default_factory=list, description="extra cluster nodes as 'host:port' to discover the cluster from; implies cluster"
    )
    prefix: str = pydantic.Field("hicache", description="first component of every key, [A-Za-z0-9][A-Za-z0-9._-]{0,63}")
    ttl_seconds: pydantic.PositiveInt | None = pydantic.Field(
        None, description="expire pages this many seconds after their write; omit to keep them"
    )
    max_value_size: pydantic.PositiveInt = pydantic.Field(
        REDIS_MAX_BULK_LEN, description="largest page in bytes (Redis' proto-max-bulk-len, 512 MiB by default)"
    )
    max_batch: pydantic.PositiveInt = pydantic.Field(256, description="most pages in one pipeline; larger batches are split")
    socket_timeout: pydantic.PositiveFloat = pydantic.Field(5.0, description="seconds to wait for a reply before a call fails")
    connect_timeout: pydantic.PositiveFloat = pydantic.Field(
        2.0, description="seconds to wait for a connection (and for a free one in the pool)"
    )
    retries: pydantic.NonNegativeInt = pydantic.Field(
        1, description="retries of a call on a fresh connection after a connection error or timeout"
    )
    max_connections: pydantic.PositiveInt = pydantic.Field(64, description="connection pool size (per node in a cluster)")
    ssl_ca_certs: str | None = pydantic.Field(None, description="CA bundle file to verify the server with; rediss:// only")

    @pydantic.model_validator(mode="before")
    @classmethod
    def _move_password_out_of_url(cls, data: Any) -> Any:
        # Runs before any other check, so that no error message can echo the password.
        if not isinstance(data, dict) or not isinstance(data.get("url"), str):
            return data
        url, passwords = _split_password(data["url"])
        data = {**data, "url": url}
        if len(passwords) == 1 and data.get("password") is None:
            data["password"] = passwords[0]
        elif passwords:  # given twice: a masked marker makes the url check report it
            data["url"] = url + ("&" if "?" in url else "?") + "password=***"
        return data

    @pydantic.field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        parse_redis_url(url)
        return url

    @pydantic.field_validator("prefix")
    @classmethod
    def _check_prefix(cls, prefix: str) -> str:
        if not _PREFIX_RE.fullmatch(prefix):
            raise ValueError("prefix must be 1-64 characters of [A-Za-z0-9._-], starting with a letter or digit")
        return prefix

    @pydantic.field_validator("startup_nodes")
    @classmethod
    def _check_nodes(cls, nodes: list[str]) -> list[str]:
        for node in nodes:
            host, _, port = node.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"startup node {node!r} must look like 'host:port'")
        return nodes

    # The checks that combine fields are field validators on the later field: an error raised by
    # a whole-model validator would be reported with the raw input, password included.

    @pydantic.field_validator("cluster", "startup_nodes")
    @classmethod
    def _check_cluster_url(cls, value: bool | list[str], info: pydantic.ValidationInfo) -> bool | list[str]:
        url = info.data.get("url")
        if value and url is not None:
            endpoint = parse_redis_url(url)
            if endpoint.scheme == "unix":
                raise ValueError("Redis Cluster cannot be reached over a unix socket; use a redis:// url")
            if endpoint.db != 0:
                raise ValueError(f"Redis Cluster has only database 0; the url names database {endpoint.db}")
        return value

    @pydantic.field_validator("ssl_ca_certs")
    @classmethod
    def _check_tls_url(cls, value: str | None, info: pydantic.ValidationInfo) -> str | None:
        url = info.data.get("url")
        if value is not None and url is not None and parse_redis_url(url).scheme != "rediss":
            raise ValueError("ssl_ca_certs needs a rediss:// url (TLS)")
        return value

    @property
    def is_cluster(self) -> bool:
        return self.cluster or bool(self.startup_nodes)


# --- the connector ------------------------------------------------------------------------------


def _import_redis() -> Any:
    try:
        import redis
        import redis.cluster
    except ImportError as exc:
        raise MissingDependencyError("redis", "redis", "redis") from exc
    return redis


class RedisBackend(StorageBackend):
    """Pages as Redis strings on a standalone server or a cluster. See the module docstring."""

    name = "redis"
    Config = RedisConfig
    capabilities = Capabilities(
        native_batch_exists=True,
        max_batch=256,
        max_value_size=REDIS_MAX_BULK_LEN,
        delete=True,
        clear=True,
        ttl=True,
        persistent=True,
        shared_across_processes=True,
        shared_across_hosts=True,
    )

    def __init__(self, config: RedisConfig | dict[str, Any] | str | None = None) -> None:
        super().__init__(config)
        self._redis = _import_redis()
        config = self.config
        self._endpoint = parse_redis_url(config.url)
        self._secret = config.password.get_secret_value() if config.password is not None else None
        if config.is_cluster:
            nodes = [self._endpoint.address, *config.startup_nodes]
            self._where = "cluster " + ", ".join(dict.fromkeys(nodes))
        else:
            self._where = self._endpoint.address
        self._key_prefix = config.prefix + ":"
        exceptions = self._redis.exceptions
        # Errors in a per-key reply slot that say the server (or the cluster) is unusable, not the key.
        self._server_wide_errors = (
            exceptions.ConnectionError,
            exceptions.TimeoutError,
            exceptions.ClusterError,
            exceptions.NoPermissionError,
        )
        self._client: Any = None
        self._topology_stale = False
        self._node_workers: concurrent.futures.ThreadPoolExecutor | None = None
        if config.is_cluster:
            self._node_workers = concurrent.futures.ThreadPoolExecutor(
                max_workers=min(32, config.max_connections), thread_name_prefix="hicache-redis-node"
            )
        try:
            self._client = self._connect()
            evicts, server_max_value = self._server_limits()
        except BaseException:
            self._close()
            raise
        loopback = self._endpoint.scheme == "unix" or self._endpoint.host in ("localhost", "127.0.0.1", "::1")
        self.capabilities = self.capabilities.replace(
            max_batch=config.max_batch,
            max_value_size=min(config.max_value_size, server_max_value),
            evicts=evicts or config.ttl_seconds is not None,
            shared_across_hosts=not loopback,
        )

    # --- hooks ---------------------------------------------------------------------------------

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        names = [self._name(key) for key in keys]
        replies = self._pipelined("exists", names, lambda pipe, i: pipe.exists(names[i]))
        return [reply == 1 for reply in replies]

    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        names = [self._name(key) for key in keys]
        values = self._pipelined("get", names, lambda pipe, i: pipe.get(names[i]))
        results = []
        for value, target in zip(values, targets):
            hit = isinstance(value, bytes) and len(value) == segments_size(target)
            if hit:
                fill_segments(target, value)
            results.append(hit)
        return results

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        names = [self._name(key) for key in keys]
        values = [join_segments(source) for source in sources]
        ttl = self.config.ttl_seconds
        replies = self._pipelined("put", names, lambda pipe, i: pipe.set(names[i], values[i], ex=ttl))
        return [reply is True for reply in replies]

    def _delete(self, keys: list[PageKey]) -> list[bool]:
        names = [self._name(key) for key in keys]
        replies = self._pipelined("delete", names, lambda pipe, i: pipe.unlink(names[i]))
        return [reply == 1 for reply in replies]

    def _clear(self, namespace: Namespace) -> None:
        """SCAN every primary for the namespace's keys and UNLINK them in batches.

        Keys written while the scan runs may survive it; clear is not atomic.
        """
        pattern = f"{self._key_prefix}{namespace.fingerprint}:*"
        try:
            for node in self._primaries():
                batch: list[bytes] = []
                for name in node.scan_iter(match=pattern, count=_SCAN_COUNT):
                    batch.append(name)
                    if len(batch) >= _CLEAR_BATCH:
                        self._unlink_on(node, batch)
                        batch = []
                if batch:
                    self._unlink_on(node, batch)
        except Exception as exc:
            self._note_failure(exc)
            raise self._translate(exc, "clear") from exc

    def _close(self) -> None:
        if self._node_workers is not None:
            self._node_workers.shutdown(wait=True)
        client, self._client = self._client, None
        if client is None:
            return
        if self.config.is_cluster:
            client.close()
        else:
            client.connection_pool.disconnect()

    # --- internals -----------------------------------------------------------------------------

    def _name(self, key: PageKey) -> str:
        return self._key_prefix + key.render(":")

    def _connect(self) -> Any:
        redis, config, endpoint = self._redis, self.config, self._endpoint
        common: dict[str, Any] = {
            "username": endpoint.username,
            "password": self._secret,
            "socket_timeout": config.socket_timeout,
            "socket_connect_timeout": config.connect_timeout,
        }
        if endpoint.scheme == "rediss":
            common["ssl"] = True
            if config.ssl_ca_certs is not None:
                common["ssl_ca_certs"] = config.ssl_ca_certs
        retry = redis.retry.Retry(redis.backoff.NoBackoff(), config.retries)
        try:
            if config.is_cluster:
                from redis.cluster import ClusterNode, RedisCluster

                nodes = [ClusterNode(endpoint.host, endpoint.port)]
                for node in config.startup_nodes:
                    host, _, port = node.rpartition(":")
                    nodes.append(ClusterNode(host, int(port)))
                return RedisCluster(startup_nodes=nodes, retry=retry, max_connections=config.max_connections, **common)
            return self._standalone_client(common, retry)
        except Exception as exc:
            raise self._translate(exc, "connect") from exc

    def _standalone_client(self, common: dict[str, Any], retry: Any) -> Any:
        redis, endpoint = self._redis, self._endpoint
        kwargs = {k: v for k, v in common.items() if k != "ssl"}
        if endpoint.scheme == "unix":
            kwargs["connection_class"] = redis.UnixDomainSocketConnection
            kwargs["path"] = endpoint.path
        else:
            kwargs["connection_class"] = redis.SSLConnection if endpoint.scheme == "rediss" else redis.Connection
            kwargs["host"], kwargs["port"] = endpoint.host, endpoint.port
        pool = redis.BlockingConnectionPool(
            max_connections=self.config.max_connections,
            timeout=self.config.connect_timeout,
            db=endpoint.db,
            retry=retry,
            **kwargs,
        )
        client = redis.Redis(connection_pool=pool)
        try:
            client.ping()  # fail now, naming the address, rather than on the first page
        except BaseException:
            pool.disconnect()
            raise
        return client

    def _server_limits(self) -> tuple[bool, int]:
        """Whether a primary may evict keys, and the smallest proto-max-bulk-len among them.

        A server that hides CONFIG (managed services often do) is assumed to evict, with Redis'
        default size limit.
        """
        evicts, max_value = False, REDIS_MAX_BULK_LEN
        for node in self._primaries():
            try:
                settings = node.config_get("maxmemory-policy", "proto-max-bulk-len")
            except self._redis.exceptions.ResponseError:
                evicts = True
                continue
            except Exception as exc:
                raise self._translate(exc, "connect") from exc
            evicts = evicts or settings.get("maxmemory-policy", "noeviction") != "noeviction"
            max_value = min(max_value, int(settings.get("proto-max-bulk-len", REDIS_MAX_BULK_LEN)))
        return evicts, max_value

    def _primaries(self) -> list[Any]:
        """One client per primary: the client itself, or each cluster primary's node client."""
        if not self.config.is_cluster:
            return [self._client]
        return [self._client.get_redis_connection(node) for node in self._client.get_primaries()]

    def _unlink_on(self, node: Any, names: list[bytes]) -> None:
        # One UNLINK per key: a multi-key UNLINK on a cluster node fails across slots.
        self._check_replies("clear", _execute(node, range(len(names)), lambda pipe, i: pipe.unlink(names[i])))

    def _pipelined(self, operation: str, names: list[str], queue: Callable[[Any, int], object]) -> list[Any]:
        """Run ``queue(pipe, i)``'s command for every key ``names[i]``; replies in order, per-key errors in place."""
        try:
            if self.config.is_cluster:
                replies = self._cluster_pipelined(names, queue)
            else:
                replies = _execute(self._client, range(len(names)), queue)
        except Exception as exc:
            self._note_failure(exc)
            raise self._translate(exc, operation) from exc
        return self._check_replies(operation, replies)

    def _cluster_pipelined(self, names: list[str], queue: Callable[[Any, int], object]) -> list[Any]:
        """One pipeline per primary that owns some of the keys, all sent at once; replies in request order.

        redis-py's own cluster pipeline would resend each command of a node that timed out on its
        own, one socket timeout per key; here a dead or frozen node costs at most ``retries + 1``
        timeouts per call.
        """
        cluster = self._client
        if self._topology_stale:  # a failover may have moved slots since the last failure
            cluster.nodes_manager.initialize()
            self._topology_stale = False
        groups: dict[str, tuple[Any, list[int]]] = {}
        for index, name in enumerate(names):
            node = cluster.get_node_from_key(name)
            groups.setdefault(node.name, (node, []))[1].append(index)
        jobs = list(groups.values())
        if len(jobs) == 1:
            outcomes = [self._run_on_node(*jobs[0], queue)]
        else:
            futures = [self._node_workers.submit(self._run_on_node, node, indices, queue) for node, indices in jobs]
            concurrent.futures.wait(futures)
            outcomes = [future.result() for future in futures]  # raises the first node's error
        replies: list[Any] = [None] * len(names)
        for (_, indices), node_replies in zip(jobs, outcomes):
            for index, reply in zip(indices, node_replies):
                replies[index] = reply
        exceptions = self._redis.exceptions
        moved = [i for i, reply in enumerate(replies) if isinstance(reply, (exceptions.AskError, exceptions.TryAgainError))]
        if moved:
            # Slots are migrating: the cluster client follows MOVED/ASK and updates its slot map.
            pipe = cluster.pipeline()
            for index in moved:
                queue(pipe, index)
            for index, reply in zip(moved, pipe.execute(raise_on_error=False)):
                replies[index] = reply
        return replies

    def _run_on_node(self, node: Any, indices: list[int], queue: Callable[[Any, int], object]) -> list[Any]:
        # Node clients do not retry (the cluster client owns retries), so retry here, on a new
        # connection: a connection to a node that restarted fails once before the pool reconnects.
        client = self._client.get_redis_connection(node)
        exceptions = self._redis.exceptions
        for attempt in range(self.config.retries + 1):
            try:
                return _execute(client, indices, queue)
            except (exceptions.ConnectionError, exceptions.TimeoutError):
                if attempt == self.config.retries:
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _note_failure(self, exc: BaseException) -> None:
        exceptions = self._redis.exceptions
        if self.config.is_cluster and isinstance(exc, (exceptions.ConnectionError, exceptions.TimeoutError)):
            self._topology_stale = True

    def _check_replies(self, operation: str, replies: list[Any]) -> list[Any]:
        """Raise for an error that concerns the whole server; leave per-key errors as misses."""
        exceptions = self._redis.exceptions
        for reply in replies:
            if isinstance(reply, self._server_wide_errors):
                raise self._translate(reply, operation) from reply
            if isinstance(reply, exceptions.ResponseError) and _is_auth_failure(str(reply)):
                raise self._translate(reply, operation) from reply
        return replies

    def _translate(self, exc: BaseException, operation: str) -> StorageError:
        """The typed SDK error for a redis-py exception, with the address named and secrets removed."""
        exceptions = self._redis.exceptions
        detail = self._redact(str(exc)) or type(exc).__name__
        where = f"Redis at {self._where}"
        if isinstance(exc, StorageError):
            return exc
        if isinstance(exc, exceptions.AuthenticationError) or _is_auth_failure(detail):
            return AuthenticationError(
                f"{where} rejected the credentials ({detail}); check the password (and the user name in the url)",
                backend=self.name,
                operation=operation,
            )
        if "CERTIFICATE_VERIFY_FAILED" in detail:
            return ConfigError(
                f"the TLS certificate of {where} did not verify ({detail}); "
                "set ssl_ca_certs to the CA bundle that signed it",
                field="ssl_ca_certs",
                backend=self.name,
            )
        if isinstance(exc, exceptions.NoPermissionError):
            return PermissionDeniedError(
                f"{where} does not allow this user to run the commands the connector needs ({detail}); "
                "grant it GET, SET, EXISTS, UNLINK, SCAN and PING on the key prefix",
                backend=self.name,
                operation=operation,
            )
        if isinstance(exc, exceptions.TimeoutError):
            return StorageTimeoutError(
                f"{where} did not answer within socket_timeout={self.config.socket_timeout}s ({detail})",
                backend=self.name,
                operation=operation,
            )
        if isinstance(exc, exceptions.OutOfMemoryError):
            return CapacityError(
                f"{where} is out of memory and does not evict ({detail}); raise maxmemory or set an eviction policy",
                backend=self.name,
                operation=operation,
            )
        unavailable = (
            exceptions.ConnectionError,
            exceptions.ClusterError,
            exceptions.TryAgainError,
            exceptions.RedisClusterException,
            OSError,
        )
        if isinstance(exc, unavailable):
            hint = "; check that the server is running and that the url is right" if operation == "connect" else ""
            return BackendUnavailableError(
                f"cannot use {where}: {detail.rstrip('.')}{hint}", backend=self.name, operation=operation
            )
        return StorageError(f"{where} failed: {type(exc).__name__}: {detail}", backend=self.name, operation=operation)

    def _redact(self, text: str) -> str:
        if self._secret:
            text = text.replace(self._secret, "***")
        return _USERINFO_RE.sub(r"\1:***@", text)


# How servers word a rejected or missing password; the cluster client reports these only as text.
_AUTH_FAILURE_MARKERS = (
    "WRONGPASS",
    "NOAUTH",
    "invalid username-password",
    "invalid password",
    "Authentication required",
    "must be called with the client already authenticated",
)


def _execute(client: Any, indices: range | list[int], queue: Callable[[Any, int], object]) -> list[Any]:
    """One pipeline on ``client`` (no MULTI/EXEC) with ``queue(pipe, i)``'s command for each index."""
    pipe = client.pipeline(transaction=False)
    for index in indices:
        queue(pipe, index)
    return pipe.execute(raise_on_error=False)


def _is_auth_failure(message: str) -> bool:
    return any(marker in message for marker in _AUTH_FAILURE_MARKERS)
