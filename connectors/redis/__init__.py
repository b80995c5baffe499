"""Redis connector: a standalone server or a Redis Cluster, one pipeline per batch (redis-py).

Modules, one concept each: ``connector`` (the hooks and the contract, :class:`RedisBackend`),
``config`` (the URL and the settings), ``connection`` (clients, TLS, server limits, one
pipeline), ``cluster`` (per-node pipelines on a cluster) and ``errors`` (typed errors from
Redis replies). redis-py is imported only when a connector is built.
"""

from hicache_storage.connectors.redis.config import REDIS_MAX_BULK_LEN, RedisConfig, parse_redis_url
from hicache_storage.connectors.redis.connector import RedisBackend

__all__ = ["REDIS_MAX_BULK_LEN", "RedisBackend", "RedisConfig", "parse_redis_url"]
