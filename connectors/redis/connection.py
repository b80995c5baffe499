"""Connecting the Redis backend: a client for a standalone server (TCP, TLS, unix socket) or a
cluster, what its primaries allow, and running one pipeline on a client.

Nothing here imports redis-py: the backend passes in the module it imported (lazily). Every
failure to connect is raised as the typed SDK error ``errors`` translates it to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hicache_storage.connectors.redis.config import REDIS_MAX_BULK_LEN, RedisConfig, RedisEndpoint
from hicache_storage.connectors.redis.errors import RedisErrors


def connect(redis: Any, config: RedisConfig, endpoint: RedisEndpoint, secret: str | None, errors: RedisErrors) -> Any:
    """A connected client: a ``RedisCluster``, or a ``Redis`` over a blocking pool that answered PING.

    ``rediss://`` turns TLS on, verified against ``ssl_ca_certs`` when given. Calls are retried
    ``config.retries`` times on a fresh connection, without backoff. Thread-safe clients.
    """
    common: dict[str, Any] = {
        "username": endpoint.username,
        "password": secret,
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
        return _standalone_client(redis, config, endpoint, common, retry)
    except Exception as exc:
        raise errors.translate(exc, "connect") from exc


def _standalone_client(redis: Any, config: RedisConfig, endpoint: RedisEndpoint, common: dict[str, Any], retry: Any) -> Any:
    kwargs = {k: v for k, v in common.items() if k != "ssl"}
    if endpoint.scheme == "unix":
        kwargs["connection_class"] = redis.UnixDomainSocketConnection
        kwargs["path"] = endpoint.path
    else:
        kwargs["connection_class"] = redis.SSLConnection if endpoint.scheme == "rediss" else redis.Connection
        kwargs["host"], kwargs["port"] = endpoint.host, endpoint.port
    pool = redis.BlockingConnectionPool(
        max_connections=config.max_connections,
        timeout=config.connect_timeout,
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


def primaries(client: Any, *, cluster: bool) -> list[Any]:
    """One client per primary: the client itself, or each cluster primary's node client."""
    if not cluster:
        return [client]
    return [client.get_redis_connection(node) for node in client.get_primaries()]


def server_limits(redis: Any, nodes: list[Any], errors: RedisErrors) -> tuple[bool, int]:
    """Whether one of the primaries ``nodes`` may evict keys, and the smallest proto-max-bulk-len among them.

    A server that hides CONFIG (managed services often do) is assumed to evict, with Redis'
    default size limit.
    """
    evicts, max_value = False, REDIS_MAX_BULK_LEN
    for node in nodes:
        try:
            settings = node.config_get("maxmemory-policy", "proto-max-bulk-len")
        except redis.exceptions.ResponseError:
            evicts = True
            continue
        except Exception as exc:
            raise errors.translate(exc, "connect") from exc
        evicts = evicts or settings.get("maxmemory-policy", "noeviction") != "noeviction"
        max_value = min(max_value, int(settings.get("proto-max-bulk-len", REDIS_MAX_BULK_LEN)))
    return evicts, max_value


def execute(client: Any, indices: range | list[int], queue: Callable[[Any, int], object]) -> list[Any]:
    """One pipeline on ``client`` (no MULTI/EXEC) with ``queue(pipe, i)``'s command for each index.

    Replies in index order; a command's error is its reply, not raised.
    """
    pipe = client.pipeline(transaction=False)
    for index in indices:
        queue(pipe, index)
    return pipe.execute(raise_on_error=False)
