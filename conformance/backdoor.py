"""An independent path into a store, so a write is checked without trusting the same connector's read.

As zarr's ``StoreTests`` do with their backdoor ``get``/``set``, the suite reads and writes one
page's stored bytes the way the store keeps them, bypassing the connector under test: the
backdoor clauses then prove that what ``put`` stored is the caller's bytes under the caller's
key, that ``get`` and ``exists`` serve bytes the connector did not write itself, and that
``delete`` removes the stored value. A connector that is wrong both ways (it scrambles, truncates
or re-keys on write and undoes it on read) passes every round trip and fails these.

Each of this package's connectors has one (:data:`BUILTIN_BACKDOORS`). Each renders the stored
name from the rule its connector documents (``key.render(...)`` and the configured prefix), never
through the connector's own naming code, and takes what it needs from ``connector.config``:

========== ==================================================================================
memory     the connector's dict (:attr:`MemoryBackend.page_table`), under its lock
file       ``<root>/<namespace>/<shard>/<part>/<hash[:2]>/<hash>``, read and written with ``open``
redis      the string ``<prefix>:<key.render(":")>``: ``GET`` / ``SET`` by a redis-py client of its
           own (standalone, unix socket, TLS or cluster, as the config says)
s3         the object ``<prefix><key.render("/")>``: ``get_object`` / ``put_object`` by a boto3
           client of its own
mooncake   the object ``<key_prefix><key.render("/")>``: ``get_size`` / ``get_into`` /
           ``upsert_from`` on the connector's Mooncake client (:attr:`MooncakeBackend.client`),
           through memory the backdoor registers for the call
hf3fs      the slot a key's index entry points to, in ``<root>/rank<r>.<file>.data``; a write
           does what a writer does (reserve a slot, write it, publish the key)
fsspec     the file ``<url path>/<key.render("/")>``, through an fsspec filesystem of its own
========== ==================================================================================

A backdoor belongs to the class that declares it: it is looked up by the connector's exact class,
so a subclass gets none, however it names its pages (its test class may override the
``backdoor`` fixture, or the subclass may declare one with :func:`register_backdoor`: a
connector that keeps its parent's layout declares the parent's). The suite uses one only for a
bare connector: a store with layers (integrity adds a checksum to the stored value) gets none.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hicache_storage.keys import PageKey
from hicache_storage.store import Store

if TYPE_CHECKING:
    from hicache_storage.connectors.hf3fs.index import Location


class Backdoor(Protocol):
    """Reads and writes one page's stored bytes without going through the connector under test."""

    def get(self, key: PageKey) -> bytes | None:
        """The bytes stored under ``key``, or ``None`` if there is no page."""

    def set(self, key: PageKey, value: bytes) -> None:
        """Store ``value`` under ``key`` the way the connector itself would."""


#: Builds the backdoor of one open connector.
BackdoorFactory = Callable[[Any], Backdoor]


class MemoryBackdoor:
    """The memory connector's dict, read and written under its lock."""

    def __init__(self, connector: Any) -> None:
        self._table = connector.page_table

    def get(self, key: PageKey) -> bytes | None:
        with self._table.lock:
            value = self._table.pages.get(key)
        return None if value is None else bytes(value)

    def set(self, key: PageKey, value: bytes) -> None:
        with self._table.lock:
            old = self._table.pages.pop(key, None)
            if old is not None:
                self._table.size -= len(old)
            self._table.pages[key] = bytes(value)
            self._table.size += len(value)


class FileBackdoor:
    """The file connector's page files: ``<root>/<namespace>/<shard>/<part>/<hash[:2]>/<hash>``."""

    def __init__(self, connector: Any) -> None:
        self._root = os.path.abspath(os.path.expanduser(connector.config.root))

    def _path(self, key: PageKey) -> str:
        namespace, shard, part, page_hash = key.render("/").split("/")
        return os.path.join(self._root, namespace, shard, part, page_hash[:2], page_hash)

    def get(self, key: PageKey) -> bytes | None:
        try:
            with open(self._path(key), "rb") as page:
                return page.read()
        except FileNotFoundError:
            return None

    def set(self, key: PageKey, value: bytes) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        temp = f"{path}.backdoor-{os.getpid()}"
        with open(temp, "wb") as page:
            page.write(value)
        os.replace(temp, path)


class RedisBackdoor:
    """Redis strings ``<prefix>:<key.render(":")>`` through a redis-py client of its own."""

    def __init__(self, connector: Any) -> None:
        import redis
        from redis.cluster import ClusterNode, RedisCluster

        from hicache_storage.connectors.redis import parse_redis_url

        config = connector.config
        endpoint = parse_redis_url(config.url)
        options: dict[str, Any] = {
            "username": endpoint.username,
            "password": config.password.get_secret_value() if config.password is not None else None,
            "socket_timeout": config.socket_timeout,
            "socket_connect_timeout": config.connect_timeout,
        }
        if endpoint.scheme == "rediss":
            options["ssl"] = True
            if config.ssl_ca_certs is not None:
                options["ssl_ca_certs"] = config.ssl_ca_certs
        self._client: Any
        if config.is_cluster:
            nodes = [ClusterNode(endpoint.host, endpoint.port)]
            for node in config.startup_nodes:
                host, _, port = node.rpartition(":")
                nodes.append(ClusterNode(host, int(port)))
            self._client = RedisCluster(startup_nodes=nodes, **options)
        else:
            if endpoint.scheme == "unix":
                options["unix_socket_path"] = endpoint.path
            else:
                options["host"], options["port"] = endpoint.host, endpoint.port
            self._client = redis.Redis(db=endpoint.db, **options)
        self._prefix = config.prefix
        self._ttl = config.ttl_seconds

    def _name(self, key: PageKey) -> str:
        return f"{self._prefix}:{key.render(':')}"

    def get(self, key: PageKey) -> bytes | None:
        value = self._client.get(self._name(key))
        return None if value is None else bytes(value)

    def set(self, key: PageKey, value: bytes) -> None:
        if not self._client.set(self._name(key), bytes(value), ex=self._ttl):
            raise RuntimeError(f"redis refused SET {self._name(key)!r}")


class S3Backdoor:
    """Objects ``<prefix><key.render("/")>`` through a boto3 client of its own.

    The prefix is the configured one without leading ``/``, with a ``/`` added if it has none at
    its end (S3Config's ``prefix``). Writes carry no S3 checksum: the connector checks one only
    where the store returns it.
    """

    def __init__(self, connector: Any) -> None:
        import boto3
        import botocore.config

        config = connector.config
        self._bucket = config.bucket
        prefix = config.prefix.lstrip("/")
        self._prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        session = boto3.session.Session(profile_name=config.profile)
        self._client = session.client(
            "s3",
            endpoint_url=config.endpoint_url,
            region_name=config.region,
            aws_access_key_id=config.access_key_id,
            aws_secret_access_key=config.secret_access_key.get_secret_value() if config.secret_access_key else None,
            aws_session_token=config.session_token.get_secret_value() if config.session_token else None,
            verify=config.verify,
            config=botocore.config.Config(s3={"addressing_style": config.addressing_style}),
        )

    def _name(self, key: PageKey) -> str:
        return self._prefix + key.render("/")

    def get(self, key: PageKey) -> bytes | None:
        try:
            response = self._client.get_object(Bucket=self._bucket, Key=self._name(key))
        except self._client.exceptions.NoSuchKey:
            return None
        body = response["Body"]
        try:
            return bytes(body.read())
        finally:
            body.close()

    def set(self, key: PageKey, value: bytes) -> None:
        self._client.put_object(Bucket=self._bucket, Key=self._name(key), Body=bytes(value))


#: Mooncake's return code for a key it does not hold (mooncake-store/include/types.h).
_MOONCAKE_OBJECT_NOT_FOUND = -704


class MooncakeBackdoor:
    """Objects ``<key_prefix><key.render("/")>`` through raw calls on the connector's Mooncake client.

    The connector's own client, not a second one: the backdoor has no ``close``, and a Mooncake
    client left open keeps a heartbeat thread and a mounted segment. The calls bypass every part of
    the connector (its naming, staging buffer, registered-memory choice and batching). A value
    moves through memory registered with the client for the call and unregistered after it (the
    client's ``get``/``upsert`` copy through its local buffer, which holds less than the largest
    pages). A read gives the object a read lease on the master, as any read does, during which it
    cannot be removed; the connector's ``clear`` waits only for its own leases, so a read here waits
    its lease out (``lease_ttl_s``) before it returns, or the namespace's clear after a clause would
    leave the pages it read stored (seen: 21 MiB left on the test's 256 MiB storage node by one run
    of the backdoor clauses).
    """

    def __init__(self, connector: Any) -> None:
        self._client = connector.client
        self._prefix = connector.config.key_prefix
        self._lease_s = connector.config.lease_ttl_s

    def _name(self, key: PageKey) -> str:
        return self._prefix + key.render("/")

    def _registered(self, size: int) -> tuple[Any, int]:
        buffer = (ctypes.c_ubyte * max(size, 1))()
        address = ctypes.addressof(buffer)
        code = self._client.register_buffer(address, len(buffer))
        if code != 0:
            raise RuntimeError(f"Mooncake register_buffer of {len(buffer)} bytes failed with code {code}")
        return buffer, address

    def get(self, key: PageKey) -> bytes | None:
        name = self._name(key)
        size = self._client.get_size(name)
        if size == _MOONCAKE_OBJECT_NOT_FOUND:
            return None
        if size < 0:
            raise RuntimeError(f"Mooncake get_size({name!r}) failed with code {size}")
        buffer, address = self._registered(size)
        try:
            read = self._client.get_into(name, address, size)
        finally:
            self._client.unregister_buffer(address)
        time.sleep(self._lease_s + 0.05)
        if read == _MOONCAKE_OBJECT_NOT_FOUND:
            return None
        if read != size:
            raise RuntimeError(f"Mooncake get_into({name!r}) of {size} bytes returned {read}")
        return bytes(buffer)[:size]

    def set(self, key: PageKey, value: bytes) -> None:
        name = self._name(key)
        buffer, address = self._registered(len(value))
        try:
            ctypes.memmove(buffer, bytes(value), len(value))
            code = self._client.upsert_from(name, address, len(value))
        finally:
            self._client.unregister_buffer(address)
        if code != 0:
            raise RuntimeError(f"Mooncake upsert_from({name!r}) of {len(value)} bytes failed with code {code}")


class HF3FSBackdoor:
    """The slot a key's index entry points to, in the data files ``<root>/rank<r>.<file>.data``.

    A page is named by ``key.render("/")`` in the slot index. The index is this process's (with
    no ``metadata_url``: the only copy of it, read through
    :func:`~hicache_storage.connectors.hf3fs.index.open_local_index`) or Redis's, read raw: the
    string ``<metadata prefix>k:<name>`` holds ``rank|slot|file|offset|length|generation`` and the
    hash ``<metadata prefix>gen:<rank>`` each slot's generation; the metadata prefix is
    ``metadata_prefix``, or ``hicache:hf3fs:<first 16 hex digits of sha256(resolved root)>:``.
    A read checks that the entry points at its slot (file ``slot % numjobs``, offset
    ``(slot // numjobs) * slot size``) and that the slot's generation did not change while it read.

    A write does what the connector documents a writer does, through the index's own protocol (it
    is the shared state every writer agrees on): reserve a slot of the config's rank, write the
    bytes there, then publish the key; the first write fixes the slot size if nothing did.
    """

    _ALIGNMENT = 4096

    def __init__(self, connector: Any) -> None:
        config = connector.config
        self._config = config
        self._root = Path(config.root).expanduser().resolve()
        self._redis: Any = None
        self._index: Any = None
        if config.metadata_url is not None:
            import redis

            from hicache_storage.connectors.hf3fs.redis_index import RedisSlotIndex

            url = config.metadata_url.get_secret_value()
            self._meta = config.metadata_prefix or f"hicache:hf3fs:{hashlib.sha256(str(self._root).encode()).hexdigest()[:16]}:"
            self._redis = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=3)
            self._index = RedisSlotIndex(url, self._meta, config.rank, 0)

    def _data_file(self, rank: int, file: int) -> Path:
        return self._root / f"rank{rank}.{file}.data"

    def _with_index(self, use: Callable[[Any], Any]) -> Any:
        """``use(index)`` on the slot index (this process's is opened, and closed after, for the call)."""
        if self._index is not None:
            return use(self._index)
        from hicache_storage.connectors.hf3fs.index import close_local_index, open_local_index

        index = open_local_index(self._root, self._config.rank)
        try:
            return use(index)
        finally:
            close_local_index(self._root, self._config.rank)

    def _entry(self, name: str, index: Any) -> tuple[Location | None, int | None]:
        """The key's index entry, and the slot size."""
        from hicache_storage.connectors.hf3fs.index import Location

        if self._redis is None:
            return index.lookup([name])[0], index.page_size
        text, page_size = self._redis.mget([f"{self._meta}k:{name}", f"{self._meta}page_size"])
        entry = Location(*(int(part) for part in text.decode().split("|"))) if text is not None else None
        return entry, int(page_size) if page_size is not None else None

    def _unchanged(self, entry: Location, name: str, index: Any) -> bool:
        """Whether the entry's slot still has the generation it had when the key was published."""
        if self._redis is None:
            return bool(index.still_valid([entry], [name]) == [True])
        stored = self._redis.hget(f"{self._meta}gen:{entry.rank}", entry.slot)
        return stored is not None and int(stored) == entry.generation

    def get(self, key: PageKey) -> bytes | None:
        name = key.render("/")

        def read(index: Any) -> bytes | None:
            entry, page_size = self._entry(name, index)
            if entry is None:
                return None
            numjobs = self._config.numjobs
            if page_size is None or (entry.file, entry.offset) != (entry.slot % numjobs, (entry.slot // numjobs) * page_size):
                raise AssertionError(
                    f"the index entry of {name!r} ({entry}) is not slot {entry.slot}'s place: file slot % {numjobs}, "
                    f"offset (slot // {numjobs}) * the {page_size}-byte slot size"
                )
            if entry.length > page_size:
                raise AssertionError(f"the index entry of {name!r} says {entry.length} bytes, more than a {page_size}-byte slot")
            descriptor = os.open(self._data_file(entry.rank, entry.file), os.O_RDONLY)
            try:
                value = os.pread(descriptor, entry.length, entry.offset)
            finally:
                os.close(descriptor)
            if not self._unchanged(entry, name, index):
                raise AssertionError(f"slot {entry.slot} of rank {entry.rank} was handed out again while the backdoor read {name!r}")
            return value

        return self._with_index(read)

    def set(self, key: PageKey, value: bytes) -> None:
        from hicache_storage.connectors.hf3fs.index import Location

        config = self._config

        def write(index: Any) -> None:
            page_size = index.page_size or index.fix_page_size(-(-max(len(value), 1) // self._ALIGNMENT) * self._ALIGNMENT)
            if len(value) > page_size:
                raise ValueError(f"a {len(value)}-byte page does not fit in this store's {page_size}-byte slots")
            if not index.capacity:
                index.capacity = (config.file_size // page_size) * config.numjobs
            reserved = index.reserve(1)
            if not reserved:
                raise RuntimeError(f"no free slot in rank {config.rank}'s files for the backdoor's write")
            slot, generation = reserved[0]
            file, offset = slot % config.numjobs, (slot // config.numjobs) * page_size
            descriptor = os.open(self._data_file(config.rank, file), os.O_WRONLY)
            try:
                written = os.pwrite(descriptor, bytes(value), offset)
            finally:
                os.close(descriptor)
            if written != len(value):
                index.release([slot])
                raise OSError(f"a short write of {written} of {len(value)} bytes into slot {slot}")
            index.publish([(key.render("/"), Location(config.rank, slot, file, offset, len(value), generation))])

        self._with_index(write)


class FsspecBackdoor:
    """Files ``<url path>/<key.render("/")>`` through an fsspec filesystem of its own.

    The filesystem is opened from the config's ``url`` and options (secrets included) with
    fsspec's instance cache skipped, so it is not the connector's object; ``memory://`` still
    shares fsspec's process-wide dict, which is where that filesystem keeps its files.
    """

    def __init__(self, connector: Any) -> None:
        from fsspec.core import url_to_fs

        config = connector.config
        options = {**config.storage_options, **{name: secret.get_secret_value() for name, secret in config.secret_storage_options.items()}}
        self._fs, root = url_to_fs(config.url, skip_instance_cache=True, **options)
        self._root = root.rstrip("/")

    def _path(self, key: PageKey) -> str:
        return f"{self._root}/{key.render('/')}"

    def get(self, key: PageKey) -> bytes | None:
        try:
            return bytes(self._fs.cat_file(self._path(key)))
        except FileNotFoundError:
            return None

    def set(self, key: PageKey, value: bytes) -> None:
        path = self._path(key)
        try:
            self._fs.pipe_file(path, bytes(value))
        except FileNotFoundError:  # a local filesystem without the page's directory yet
            self._fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            self._fs.pipe_file(path, bytes(value))


#: The backdoors of this package's connectors, by registry name: each is the backdoor of exactly
#: the class that name resolves to.
BUILTIN_BACKDOORS: dict[str, BackdoorFactory] = {
    "memory": MemoryBackdoor,
    "file": FileBackdoor,
    "redis": RedisBackdoor,
    "s3": S3Backdoor,
    "mooncake": MooncakeBackdoor,
    "hf3fs": HF3FSBackdoor,
    "fsspec": FsspecBackdoor,
}
_DECLARED: dict[type, BackdoorFactory] = {}


def register_backdoor(connector_class: type, factory: BackdoorFactory) -> None:
    """Declare ``factory(connector)`` the backdoor of ``connector_class`` itself (not of its subclasses).

    For a connector run by ``hicache-storage conformance`` (no test class to override the
    ``backdoor`` fixture): register it in the connector's module, which the run imports. A subclass
    that stores pages exactly as its parent does may declare the parent's backdoor.
    """
    _DECLARED[connector_class] = factory


def _builtin_class(name: str) -> type | None:
    """The built-in connector class registered as ``name``, if its module is imported."""
    from hicache_storage.registry import BUILTINS

    module, _, attribute = BUILTINS[name].target.partition(":")
    return getattr(sys.modules.get(module), attribute, None)


def declared_backdoor(connector_class: type) -> BackdoorFactory | None:
    """The backdoor declared for exactly ``connector_class`` (registered, or built in), or ``None``:
    a subclass inherits none."""
    factory = _DECLARED.get(connector_class)
    if factory is None:
        factory = next((made for name, made in BUILTIN_BACKDOORS.items() if _builtin_class(name) is connector_class), None)
    return factory


def backdoor_for(connector: object) -> Backdoor | None:
    """The backdoor of ``connector``, as declared for its exact class; ``None`` if there is none."""
    factory = declared_backdoor(type(connector))
    return None if factory is None else factory(connector)


def builtin_backdoor(store: Store) -> Backdoor | None:
    """The backdoor of a store that is one bare connector whose exact class declares one; ``None`` for anything else."""
    levels = store.levels()
    if len(levels) != 1:
        return None
    return backdoor_for(levels[0])
