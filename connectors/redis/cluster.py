"""The Redis backend's batches on a Redis Cluster: one pipeline per primary, all sent at once.

Keys carry no hash tag, so a batch spans many slots. It is grouped by the primary owning each
key's slot, one pipeline per node sent from a small thread pool, and the replies are put back in
request order. redis-py's own cluster pipeline would resend each command of a node that timed
out on its own, one socket timeout per key; here a dead or frozen node costs at most
``retries + 1`` timeouts per call. Keys whose slot is migrating (``MOVED``/``ASK``/``TRYAGAIN``)
are re-sent through the cluster client, which follows the redirection and updates its slot map;
after a connection failure the slot map is re-read before the next call (a failover moves slots).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

from hicache_storage.connectors.redis.connection import execute


class ClusterPipelines:
    """Runs a batch's per-key commands across a cluster's primaries; owns the node thread pool.

    ``redis`` is the imported redis-py module; ``workers`` how many nodes are talked to at once.
    Thread-safe: each call takes its own pipelines and connections. :meth:`close` stops the pool.
    """

    def __init__(self, redis: Any, *, retries: int, workers: int) -> None:
        self._redis = redis
        self._retries = retries
        self._topology_stale = False
        self._workers = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hicache-redis-node")

    def run(self, cluster: Any, names: list[str], queue: Callable[[Any, int], object]) -> list[Any]:
        """``queue(pipe, i)``'s command for every key ``names[i]`` on ``cluster``; replies in request order.

        A per-key error is its reply; a node's connection error or timeout (after the retries)
        is raised.
        """
        if self._topology_stale:  # a failover may have moved slots since the last failure
            cluster.nodes_manager.initialize()
            self._topology_stale = False
        groups: dict[str, tuple[Any, list[int]]] = {}
        for index, name in enumerate(names):
            node = cluster.get_node_from_key(name)
            groups.setdefault(node.name, (node, []))[1].append(index)
        jobs = list(groups.values())
        if len(jobs) == 1:
            outcomes = [self._run_on_node(cluster, *jobs[0], queue)]
        else:
            futures = [self._workers.submit(self._run_on_node, cluster, node, indices, queue) for node, indices in jobs]
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

    def note_failure(self, exc: BaseException) -> None:
        """After a connection failure or timeout, re-read the slot map before the next call."""
        exceptions = self._redis.exceptions
        if isinstance(exc, (exceptions.ConnectionError, exceptions.TimeoutError)):
            self._topology_stale = True

    def close(self) -> None:
        """Wait for running node calls and stop the thread pool."""
        self._workers.shutdown(wait=True)

    def _run_on_node(self, cluster: Any, node: Any, indices: list[int], queue: Callable[[Any, int], object]) -> list[Any]:
        # Node clients do not retry (the cluster client owns retries), so retry here, on a new
        # connection: a connection to a node that restarted fails once before the pool reconnects.
        client = cluster.get_redis_connection(node)
        exceptions = self._redis.exceptions
        for attempt in range(self._retries + 1):
            try:
                return execute(client, indices, queue)
            except (exceptions.ConnectionError, exceptions.TimeoutError):
                if attempt == self._retries:
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")
