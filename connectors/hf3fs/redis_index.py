"""The hf3fs backend's slot index in Redis, shared by every instance and rank on any host.

Pages survive restarts. Every allocation and publication is one Lua script, so it is atomic;
standalone Redis only (the scripts touch keys they compute). redis-py is imported only when an
index is opened. Redis errors become typed SDK errors that name the server, never its password.
"""

from __future__ import annotations

import time

import pydantic

from hicache_storage.connectors.hf3fs.index import Location
from hicache_storage.connectors.redis.errors import reply_status
from hicache_storage.errors import (
    AuthenticationError,
    BackendUnavailableError,
    ErrorStatus,
    MissingDependencyError,
    PermissionDeniedError,
    StorageError,
    StorageTimeoutError,
)

# Redis scripts; each runs atomically. A page's LRU member is its rendered key (its "name").
# KEYS: free list, next-slot counter, LRU sorted set, generations hash (all of this rank).
# ARGV: capacity in slots, slots wanted, prefix of page keys.
_RESERVE = """
local taken = {}
for i = 1, tonumber(ARGV[2]) do
  local slot = redis.call('LPOP', KEYS[1])
  if not slot then
    local n = redis.call('INCR', KEYS[2])
    if n <= tonumber(ARGV[1]) then
      slot = tostring(n - 1)
    else
      redis.call('DECR', KEYS[2])
      local victim = redis.call('ZPOPMIN', KEYS[3])
      if #victim == 0 then break end
      local loc = redis.call('GET', ARGV[3] .. victim[1])
      if loc then
        redis.call('DEL', ARGV[3] .. victim[1])
        slot = string.match(loc, '^%d+|(%d+)|')
      end
    end
  end
  if slot then
    local generation = redis.call('HINCRBY', KEYS[4], slot, 1)
    table.insert(taken, {tonumber(slot), generation})
  end
end
return taken
"""

# KEYS: page key. ARGV: location, lru score, key-name (LRU member), prefix for rank keys.
_PUBLISH = """
local old = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1])
local rank = string.match(ARGV[1], '^(%d+)|')
redis.call('ZADD', ARGV[4] .. 'lru:' .. rank, ARGV[2], ARGV[3])
if old and old ~= ARGV[1] then
  local old_rank, old_slot = string.match(old, '^(%d+)|(%d+)|')
  if old_rank ~= rank then redis.call('ZREM', ARGV[4] .. 'lru:' .. old_rank, ARGV[3]) end
  redis.call('RPUSH', ARGV[4] .. 'free:' .. old_rank, old_slot)
end
return 1
"""

# KEYS: page key. ARGV: key-name (LRU member), prefix for rank keys.
_REMOVE = """
local old = redis.call('GET', KEYS[1])
if not old then return 0 end
redis.call('DEL', KEYS[1])
local rank, slot = string.match(old, '^(%d+)|(%d+)|')
redis.call('ZREM', ARGV[2] .. 'lru:' .. rank, ARGV[1])
redis.call('RPUSH', ARGV[2] .. 'free:' .. rank, slot)
return 1
"""


class RedisSlotIndex:
    """The slot index in Redis, shared by every instance and rank configured with the same prefix.

    Keys: ``<prefix>k:<page>`` -> encoded :class:`Location`; ``<prefix>lru:<rank>`` sorted set of
    page names by last use; ``<prefix>free:<rank>`` list of released slots; ``<prefix>next:<rank>``
    count of slots ever handed out; ``<prefix>gen:<rank>`` hash slot -> generation;
    ``<prefix>page_size``. The same methods and contracts as :class:`LocalSlotIndex`; Redis
    errors propagate as redis-py raises them. Thread-safe (redis-py's connection pool).
    """

    def __init__(self, url: str, prefix: str, rank: int, capacity: int) -> None:
        try:
            import redis
        except ImportError as exc:
            raise MissingDependencyError("hf3fs", "redis", "hf3fs") from exc
        self.client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=3, health_check_interval=30)
        self.prefix = prefix
        self.rank = rank
        self.capacity = capacity
        self.page_size: int | None = None
        self._reserve = self.client.register_script(_RESERVE)
        self._publish = self.client.register_script(_PUBLISH)
        self._remove = self.client.register_script(_REMOVE)
        stored = self.client.get(prefix + "page_size")
        self.page_size = int(stored) if stored is not None else None

    def _key(self, name: str) -> str:
        return f"{self.prefix}k:{name}"

    def fix_page_size(self, size: int) -> int:
        """The shared slot size: ``size`` unless some instance fixed one before, which then wins."""
        self.client.set(self.prefix + "page_size", size, nx=True)
        stored = self.client.get(self.prefix + "page_size")
        # None only if the key vanished between the two calls (the index flushed): ours stands.
        self.page_size = int(stored) if stored is not None else size
        return self.page_size

    def lookup(self, names: list[str]) -> list[Location | None]:
        """Each name's published location, ``None`` for a miss; one MGET."""
        values = self.client.mget([self._key(n) for n in names]) if names else []
        return [Location.decode(v) if v is not None else None for v in values]

    def reserve(self, count: int) -> list[tuple[int, int]]:
        """Up to ``count`` (slot, generation) pairs no key points at, evicting LRU pages when full; one script."""
        r = self.rank
        keys = [f"{self.prefix}free:{r}", f"{self.prefix}next:{r}", f"{self.prefix}lru:{r}", f"{self.prefix}gen:{r}"]
        taken = self._reserve(keys=keys, args=[self.capacity, count, self.prefix + "k:"])
        return [(int(slot), int(generation)) for slot, generation in taken]

    def publish(self, pages: list[tuple[str, Location]]) -> None:
        """One pipelined round trip; each page's script is atomic, and they run in order.

        Each later page of the call gets an LRU score one microsecond older, so the first pages
        count as the most recent and a later eviction takes a prefix's tail first.
        """
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        for position, (name, location) in enumerate(pages):
            score = now - position * 1e-6
            self._publish(keys=[self._key(name)], args=[location.encode(), score, name, self.prefix], client=pipe)
        pipe.execute()

    def release(self, slots: list[int]) -> None:
        """Give back reserved slots that were never published (their write failed)."""
        if slots:
            self.client.rpush(f"{self.prefix}free:{self.rank}", *slots)

    def still_valid(self, locations: list[Location], names: list[str]) -> list[bool]:
        """Whether each slot still has the generation it had when read; refreshes LRU order of the valid."""
        pipe = self.client.pipeline(transaction=False)
        for loc in locations:
            pipe.hget(f"{self.prefix}gen:{loc.rank}", loc.slot)
        generations = pipe.execute()
        valid = [g is not None and int(g) == loc.generation for g, loc in zip(generations, locations)]
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        for name, loc, ok in zip(names, locations, valid):
            if ok:
                pipe.zadd(f"{self.prefix}lru:{loc.rank}", {name: now}, xx=True)
        pipe.execute()
        return valid

    def remove(self, names: list[str]) -> list[bool]:
        """Unpublish each name and free its slot; ``True`` where the name was published."""
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            self._remove(keys=[self._key(name)], args=[name, self.prefix], client=pipe)
        return [bool(r) for r in pipe.execute()]

    def names_with_prefix(self, prefix: str) -> list[str]:
        """Every published name starting with ``prefix`` (a namespace being cleared); SCANs the keys."""
        start = len(self.prefix) + 2
        return [k.decode()[start:] for k in self.client.scan_iter(match=f"{self.prefix}k:{prefix}*", count=1000)]


def redis_error_base() -> type[BaseException]:
    """``redis.RedisError``, the class every redis-py error derives from; ``MissingDependencyError`` without redis-py."""
    try:
        import redis
    except ImportError as exc:
        raise MissingDependencyError("hf3fs", "redis", "hf3fs") from exc
    return redis.RedisError


def typed_redis_error(exc: BaseException, where: str, operation: str) -> StorageError:
    """The typed SDK error for a redis-py error of the index at ``where`` (an address without credentials)."""
    import redis

    what = f"the hf3fs slot index in Redis at {where}"
    kind: type[StorageError]
    if isinstance(exc, redis.AuthenticationError):  # a subclass of ConnectionError: test it first
        kind, message = AuthenticationError, f"{what} rejected the credentials in metadata_url"
    elif isinstance(exc, redis.exceptions.NoPermissionError):
        kind, message = PermissionDeniedError, f"{what} refused a command to this user (ACL): {type(exc).__name__}"
    elif isinstance(exc, redis.TimeoutError):
        kind, message = StorageTimeoutError, f"{what} did not answer in time"
    elif isinstance(exc, redis.ConnectionError):
        kind, message = BackendUnavailableError, f"{what} is unreachable: {type(exc).__name__}"
    else:
        status = ErrorStatus.TEMPORARY if isinstance(exc, redis.exceptions.ReadOnlyError) else reply_status(str(exc))
        return StorageError(f"{what} failed: {type(exc).__name__}", backend="hf3fs", operation=operation, status=status)
    return kind(message, backend="hf3fs", operation=operation)


def redacted_url(url: pydantic.SecretStr | None) -> str:
    """``scheme://host:port`` of the index's URL: no user, password, path or query."""
    if url is None:
        return "(none)"
    from urllib.parse import urlparse

    parsed = urlparse(url.get_secret_value())
    return f"{parsed.scheme}://{parsed.hostname or ''}{':' + str(parsed.port) if parsed.port else ''}"
