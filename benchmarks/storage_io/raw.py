"""The raw client doing the same I/O as a connector, so the SDK's overhead shows as a ratio.

Each baseline moves the same pages (same sizes, same batch, same concurrency where the connector
has a knob for it) with the client library alone: no keys, no validation, no result checks. The
benchmark gives it the same fresh names on every put pass as the SDK gets keys, and has it
``delete`` each pass's pages once measured, so both hold the same bytes and write the same way.
``make_raw(backend)`` returns the baseline for a connector, or ``None`` when there is none.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from hicache_storage.connectors.file import FileBackend
from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.connectors.mooncake import MooncakeBackend
from hicache_storage.connectors.redis import RedisBackend
from hicache_storage.connectors.s3 import S3Backend
from hicache_storage.layers import connector_of
from hicache_storage.store import Store


class RawClient(Protocol):
    label: str

    def put(self, names: list[str], pages: list[memoryview]) -> None: ...

    def get(self, names: list[str], pages: list[memoryview]) -> None: ...

    def exists(self, names: list[str]) -> None: ...

    def delete(self, names: list[str]) -> None:
        """Remove these pages, each written by this client (the benchmark does not time it)."""

    def close(self) -> None: ...


class FileRaw:
    """``os.pwrite`` / ``os.preadv`` / ``os.stat`` from a thread pool, one file per page."""

    label = "os.pwrite/preadv"

    def __init__(self, threads: int) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="hicache-raw-"))
        self.pool = ThreadPoolExecutor(threads)

    def _write(self, name: str, page: memoryview) -> None:
        fd = os.open(self.root / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.pwrite(fd, page, 0)
        finally:
            os.close(fd)

    def _read(self, name: str, page: memoryview) -> None:
        fd = os.open(self.root / name, os.O_RDONLY)
        try:
            os.preadv(fd, [page], 0)
        finally:
            os.close(fd)

    def put(self, names: list[str], pages: list[memoryview]) -> None:
        list(self.pool.map(self._write, names, pages))

    def get(self, names: list[str], pages: list[memoryview]) -> None:
        list(self.pool.map(self._read, names, pages))

    def exists(self, names: list[str]) -> None:
        list(self.pool.map(lambda n: (self.root / n).exists(), names))

    def delete(self, names: list[str]) -> None:
        list(self.pool.map(lambda n: (self.root / n).unlink(), names))

    def close(self) -> None:
        self.pool.shutdown()
        shutil.rmtree(self.root, ignore_errors=True)


class RedisRaw:
    """redis-py pipelines of SET / GET / EXISTS on the connector's own URL."""

    label = "redis-py pipeline"

    def __init__(self, backend: RedisBackend) -> None:
        import redis

        config = backend.config
        password = config.password.get_secret_value() if config.password is not None else None
        self.client = redis.Redis.from_url(config.url, password=password)

    def put(self, names: list[str], pages: list[memoryview]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name, page in zip(names, pages):
            pipe.set(name, page)
        pipe.execute()

    def get(self, names: list[str], pages: list[memoryview]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        for value, page in zip(pipe.execute(), pages):
            page[:] = value

    def exists(self, names: list[str]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        pipe.execute()

    def delete(self, names: list[str]) -> None:
        self.client.unlink(*names)

    def close(self) -> None:
        self.client.close()


class S3Raw:
    """boto3 put_object / get_object / head_object on a thread pool, same endpoint and bucket."""

    label = "boto3"
    #: Most keys one DeleteObjects request may name (S3's limit).
    DELETE_BATCH = 1000

    def __init__(self, backend: S3Backend) -> None:
        import boto3
        from botocore.config import Config

        config = backend.config
        secret = config.secret_access_key.get_secret_value() if config.secret_access_key is not None else None
        self.bucket = config.bucket
        self.client = boto3.client(
            "s3",
            endpoint_url=config.endpoint_url,
            region_name=config.region,
            aws_access_key_id=config.access_key_id,
            aws_secret_access_key=secret,
            config=Config(s3={"addressing_style": config.addressing_style}, max_pool_connections=config.max_concurrency),
        )
        self.pool = ThreadPoolExecutor(config.max_concurrency)

    def put(self, names: list[str], pages: list[memoryview]) -> None:
        list(self.pool.map(lambda n, p: self.client.put_object(Bucket=self.bucket, Key=n, Body=bytes(p)), names, pages))

    def get(self, names: list[str], pages: list[memoryview]) -> None:
        def read(name: str, page: memoryview) -> None:
            page[:] = self.client.get_object(Bucket=self.bucket, Key=name)["Body"].read()

        list(self.pool.map(read, names, pages))

    def exists(self, names: list[str]) -> None:
        list(self.pool.map(lambda n: self.client.head_object(Bucket=self.bucket, Key=n), names))

    def delete(self, names: list[str]) -> None:
        for start in range(0, len(names), self.DELETE_BATCH):
            objects = [{"Key": name} for name in names[start : start + self.DELETE_BATCH]]
            response = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True})
            errors = response.get("Errors") or []
            if errors:
                first = errors[0]
                raise RuntimeError(
                    f"S3 bucket {self.bucket!r} refused to delete {len(errors)} of the raw baseline's "
                    f"{len(objects)} objects, e.g. {first.get('Key')!r}: {first.get('Code')} {first.get('Message', '')}".rstrip()
                )

    def close(self) -> None:
        self.pool.shutdown()


class MooncakeRaw:
    """``batch_put_from`` / ``batch_get_into`` / ``batch_is_exist`` on the connector's own store
    object (one process holds one Mooncake client), from memory registered with it."""

    label = "mooncake batch_*_from/into"
    #: Mooncake's return code for a key it does not hold (mooncake-store/include/types.h).
    OBJECT_NOT_FOUND = -704

    def __init__(self, backend: MooncakeBackend) -> None:
        self.store = backend._store  # the connector's client: one setup, one registration table

    @staticmethod
    def _pointers(pages: list[memoryview]) -> tuple[list[int], list[int]]:
        return [ctypes.addressof(ctypes.c_char.from_buffer(p)) for p in pages], [p.nbytes for p in pages]

    def put(self, names: list[str], pages: list[memoryview]) -> None:
        ptrs, sizes = self._pointers(pages)
        self.store.batch_upsert_from(names, ptrs, sizes)

    def get(self, names: list[str], pages: list[memoryview]) -> None:
        ptrs, sizes = self._pointers(pages)
        self.store.batch_get_into(names, ptrs, sizes)

    def exists(self, names: list[str]) -> None:
        self.store.batch_is_exist(names)

    def delete(self, names: list[str]) -> None:
        # Forced: this client's own reads just took read leases on these objects, and nothing
        # else reads them; unforced, each removal would wait the lease out (lease_ttl_s).
        # Not found is no error: a put this baseline does not check may have been refused (a full segment).
        codes = self.store.batch_remove(names, True)
        refused = [(name, code) for name, code in zip(names, codes) if code not in (0, self.OBJECT_NOT_FOUND)]
        if refused:
            name, code = refused[0]
            raise RuntimeError(f"Mooncake refused to remove {len(refused)} of the raw baseline's {len(names)} objects, e.g. {name!r}: code {code}")

    def close(self) -> None:
        """Nothing to release: the store belongs to the connector, which closes it."""


class MemoryRaw:
    """A plain dict: the floor any in-process store could reach."""

    label = "dict"

    def __init__(self) -> None:
        self.pages: dict[str, bytes] = {}

    def put(self, names: list[str], pages: list[memoryview]) -> None:
        for name, page in zip(names, pages):
            self.pages[name] = bytes(page)

    def get(self, names: list[str], pages: list[memoryview]) -> None:
        for name, page in zip(names, pages):
            page[:] = self.pages[name]

    def exists(self, names: list[str]) -> None:
        [name in self.pages for name in names]

    def delete(self, names: list[str]) -> None:
        for name in names:
            del self.pages[name]

    def close(self) -> None:
        self.pages.clear()


def make_raw(store: Store) -> RawClient | None:
    """The raw baseline for the connector of ``store``, or ``None`` if there is none."""
    backend = connector_of(store)
    if isinstance(backend, FileBackend):
        return FileRaw(backend.config.io_threads)
    if isinstance(backend, RedisBackend) and not backend.config.is_cluster:
        return RedisRaw(backend)
    if isinstance(backend, S3Backend):
        return S3Raw(backend)
    if isinstance(backend, MooncakeBackend):
        return MooncakeRaw(backend)
    if isinstance(backend, MemoryBackend):
        return MemoryRaw()
    return None


def dd_direct(page_size: int, pages: int, directory: str) -> dict[str, float]:
    """GB/s of ``dd`` with O_DIRECT writing then reading ``pages`` blocks of ``page_size`` bytes."""
    path = Path(tempfile.mkdtemp(prefix="hicache-dd-", dir=directory)) / "dd.bin"
    try:
        rates = {}
        for op, args in (
            ("write", ["if=/dev/zero", f"of={path}", "oflag=direct", "conv=fsync"]),
            ("read", [f"if={path}", "of=/dev/null", "iflag=direct"]),
        ):
            start = time.perf_counter()
            subprocess.run(["dd", *args, f"bs={page_size}", f"count={pages}"], check=True, capture_output=True)
            rates[op] = page_size * pages / (time.perf_counter() - start) / 1e9
        return rates
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
