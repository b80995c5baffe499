"""Redis connector: a standalone server or a Redis Cluster, one pipeline per batch (redis-py).

Contract, beyond the one every connector keeps (see :mod:`hicache_storage.connector`):

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

The package's modules are listed in its docstring (:mod:`hicache_storage.connectors.redis`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hicache_storage.connector import Connector
from hicache_storage.buffers import Segments, fill_segments, join_segments, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.connectors.redis.cluster import ClusterPipelines
from hicache_storage.connectors.redis.config import REDIS_MAX_BULK_LEN, RedisConfig, RedisEndpoint, parse_redis_url
from hicache_storage.connectors.redis.connection import connect, execute, primaries, server_limits
from hicache_storage.connectors.redis.errors import RedisErrors
from hicache_storage.errors import MissingDependencyError
from hicache_storage.keys import Namespace, PageKey

__all__ = ["REDIS_MAX_BULK_LEN", "RedisBackend", "RedisConfig", "RedisEndpoint", "parse_redis_url"]

_SCAN_COUNT = 1000
_CLEAR_BATCH = 500


def _import_redis() -> Any:
    try:
        import redis
        import redis.cluster
    except ImportError as exc:
        raise MissingDependencyError("redis", "redis", "redis") from exc
    return redis


class RedisBackend(Connector):
    """Pages as Redis strings on a standalone server or a cluster. See the module docstring."""

    name = "redis"
    Config = RedisConfig
    config: RedisConfig
    capabilities = Capabilities(
        native_batch_exists=True,
        bounded_calls=True,  # socket_timeout and connect_timeout (always set) bound every call
        max_batch=256,
        max_value_size=REDIS_MAX_BULK_LEN,
        delete=True,
        clear=True,
        ttl=True,
        persistent=True,
        shared_across_processes=True,
        outlives_writer=True,
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
            where = "cluster " + ", ".join(dict.fromkeys(nodes))
        else:
            where = self._endpoint.address
        self._errors = RedisErrors(
            self._redis, backend=self.name, where=where, secret=self._secret, socket_timeout=config.socket_timeout
        )
        self._key_prefix = config.prefix + ":"
        self._client: Any = None
        self._cluster: ClusterPipelines | None = None
        if config.is_cluster:
            self._cluster = ClusterPipelines(self._redis, retries=config.retries, workers=min(32, config.max_connections))
        try:
            self._client = connect(self._redis, config, self._endpoint, self._secret, self._errors)
            evicts, server_max_value = server_limits(self._redis, self._primaries(), self._errors)
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
            raise self._errors.translate(exc, "clear") from exc

    def _close(self) -> None:
        if self._cluster is not None:
            self._cluster.close()
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

    def _primaries(self) -> list[Any]:
        return primaries(self._client, cluster=self.config.is_cluster)

    def _unlink_on(self, node: Any, names: list[bytes]) -> None:
        # One UNLINK per key: a multi-key UNLINK on a cluster node fails across slots.
        self._errors.check_replies("clear", execute(node, range(len(names)), lambda pipe, i: pipe.unlink(names[i])))

    def _pipelined(self, operation: str, names: list[str], queue: Callable[[Any, int], object]) -> list[Any]:
        """Run ``queue(pipe, i)``'s command for every key ``names[i]``; replies in order, per-key errors in place."""
        try:
            if self._cluster is not None:
                replies = self._cluster.run(self._client, names, queue)
            else:
                replies = execute(self._client, range(len(names)), queue)
        except Exception as exc:
            self._note_failure(exc)
            raise self._errors.translate(exc, operation) from exc
        return self._errors.check_replies(operation, replies)

    def _note_failure(self, exc: BaseException) -> None:
        if self._cluster is not None:
            self._cluster.note_failure(exc)
