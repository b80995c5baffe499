"""Mooncake Store: pages as objects in a Mooncake cluster, moved zero-copy from registered memory.

Setup takes the keys SGLang's Mooncake backend uses (``master_server_address``,
``metadata_server``, ``local_hostname``, ``global_segment_size``, ``local_buffer_size``,
``protocol``, ``device_name``); a key left out of the config is read from its environment
variable (``MOONCAKE_MASTER``, ``MOONCAKE_TE_META_DATA_SERVER``, ``MOONCAKE_LOCAL_HOSTNAME`` or
``LOCAL_HOSTNAME``, ``MOONCAKE_GLOBAL_SEGMENT_SIZE``, ``MOONCAKE_LOCAL_BUFFER_SIZE``,
``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``), then from the defaults below.

A page is the object ``<key_prefix><namespace>/<shard>/<part>/<page hash>`` (``key_prefix`` +
``key.render("/")``) holding its raw bytes.

How pages move (checked against ``mooncake-transfer-engine`` 0.3.13):

* Memory announced with :meth:`register_buffer` (the host KV pool) is registered once with the
  transfer engine. A page whose segments all lie in registered memory is read with
  ``batch_get_into_multi_buffers`` straight into the caller's buffers, and a one-segment page is
  written with ``batch_upsert_from`` straight from them.
* Everything else goes through one registered staging buffer (``staging_buffer_size``, which is
  also the declared ``max_value_size``): a copy into it before a write, out of it after a read.
  Multi-segment pages are always written this way, because Mooncake's ``put`` on an existing key
  keeps the old value and 0.3.13 has no multi-buffer upsert. Hence ``zero_copy_write=False``;
  store K and V as separate parts (``k``, ``v``) to keep MHA writes zero-copy.
* Mooncake refuses empty objects: a zero-byte page is reported not stored (``False``).
* A read is a hit only if the object's length equals the target's (``batch_get_into`` returns
  the bytes read; a larger object is refused by Mooncake with ``INVALID_PARAMS``).

Leases: every read *and every exists check* gives the object a read lease on the master
(``--default_kv_lease_ttl``, 10 s by default) during which ``remove`` fails with
``OBJECT_HAS_LEASE`` (-706). The lease is what keeps a reader's bytes from being freed and
reused under it, so this connector never forces a removal. ``delete`` retries leased keys with
backoff for up to ``1.5 * lease_ttl_s + 0.5`` seconds and then reports ``False`` for a key still
leased (it is still stored). ``clear`` first waits until this instance's own leases on the
namespace have expired; a page another client read within the last ``lease_ttl_s`` may survive
it. Set ``lease_ttl_s`` to the master's lease TTL.

Where bytes live, and so which capabilities hold (declared per configuration): Mooncake puts
each object in a randomly chosen mounted segment, and a segment lives as long as the client that
mounted it (a client unmounts its segment when it closes, and the master drops its objects).

* ``global_segment_size`` > 0 (the default 4 GiB; how SGLang instances run Mooncake when each
  contributes memory): a page lives in some client's segment, possibly its writer's. Another
  *live* process sees it (``shared_across_processes``, ``shared_across_hosts``), but it may leave
  with its writer: ``persistent`` and ``outlives_writer`` are not declared.
* ``global_segment_size=0``, with dedicated storage nodes (e.g. ``mooncake_client`` processes,
  each mounting its memory): this client mounts nothing, so its pages live on the storage nodes
  and survive its exit and restart: ``persistent`` and ``outlives_writer`` are declared. The pages
  then live as long as those nodes; if the only segments are other engines' own, they leave with
  those engines instead.

A master restart forgets every object in either deployment: reads of earlier pages are then
misses, never wrong bytes.

Return codes (negative ints from the client) map to results and errors as follows:

* ``OBJECT_NOT_FOUND`` -704, ``REPLICA_IS_NOT_READY`` -703, ``LEASE_EXPIRED`` -707,
  ``REPLICA_NOT_FOUND`` -710, ``REPLICA_IS_GONE`` -712, ``INVALID_PARAMS`` -600 (on a read: the
  object is larger than the target): a miss.
* ``NO_AVAILABLE_HANDLE`` -200 (no room in any segment) and any other per-key code on a write:
  ``False`` for that key.
* ``RPC_FAIL`` -900, ``TRANSFER_FAIL`` -800, ``UNAVAILABLE_IN_CURRENT_STATUS`` -1010: the master
  or a storage node is unreachable. If every key of a call failed this way the call raises
  :class:`~hicache_storage.errors.BackendUnavailableError` (``RPC_TIMEOUT`` -901:
  :class:`~hicache_storage.errors.StorageTimeoutError`; Mooncake gives up on a hung master
  after 30 s); otherwise those keys are ``False``. The client reconnects on its own once the
  master is back.

Thread safety: the Mooncake client may be called from several threads; staging-buffer use is
serialized by a lock. ``close`` takes about a second
(the Mooncake client joins its heartbeat thread). Every client process needs ``MC_TCP_BIND_ADDRESS``; it is set from
``local_hostname`` when unset.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import pydantic

from hicache_storage.connector import Connector
from hicache_storage.buffers import Segments, fill_segments, join_segments, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig, parse_size
from hicache_storage.errors import (
    BackendUnavailableError,
    ConfigError,
    ErrorStatus,
    InvalidArgumentError,
    MissingDependencyError,
    StorageError,
    StorageTimeoutError,
)
from hicache_storage.keys import Namespace, PageKey

# --- the Mooncake return codes this module acts on (mooncake-store/include/types.h) -------------------------------------

OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901
UNAVAILABLE_IN_CURRENT_STATUS = -1010

_UNREACHABLE = frozenset({TRANSFER_FAIL, RPC_FAIL, RPC_TIMEOUT, UNAVAILABLE_IN_CURRENT_STATUS})

_ENV_FALLBACKS: dict[str, tuple[str, ...]] = {
    "master_server_address": ("MOONCAKE_MASTER",),
    "metadata_server": ("MOONCAKE_TE_META_DATA_SERVER",),
    "local_hostname": ("MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME"),
    "global_segment_size": ("MOONCAKE_GLOBAL_SEGMENT_SIZE",),
    "local_buffer_size": ("MOONCAKE_LOCAL_BUFFER_SIZE",),
    "protocol": ("MOONCAKE_PROTOCOL",),
    "device_name": ("MOONCAKE_DEVICE",),
}


class MooncakeConfig(BackendConfig):
    """Connection settings; each of the first seven falls back to its ``MOONCAKE_*`` variable."""

    master_server_address: str | None = pydantic.Field(
        None, description="host:port of mooncake_master (env MOONCAKE_MASTER); required"
    )
    metadata_server: str = pydantic.Field(
        "P2PHANDSHAKE",
        description="transfer-engine metadata: http://host:port/metadata or P2PHANDSHAKE (env MOONCAKE_TE_META_DATA_SERVER)",
    )
    local_hostname: str = pydantic.Field(
        "127.0.0.1", description="address other nodes reach this client at (env MOONCAKE_LOCAL_HOSTNAME)"
    )
    global_segment_size: int = pydantic.Field(
        4 * 2**30,
        ge=0,
        description="bytes of memory this client contributes to the cluster; 0 for none (env MOONCAKE_GLOBAL_SEGMENT_SIZE)",
    )
    local_buffer_size: int = pydantic.Field(
        16 * 2**20, ge=0, description="the transfer engine's own buffer in bytes (env MOONCAKE_LOCAL_BUFFER_SIZE)"
    )
    protocol: str = pydantic.Field("tcp", description="tcp or rdma (env MOONCAKE_PROTOCOL)")
    device_name: str = pydantic.Field("", description="RDMA devices, comma-separated (env MOONCAKE_DEVICE)")
    key_prefix: str = pydantic.Field(
        "hicache/", pattern=r"^[A-Za-z0-9_./-]*$", description="prefix of every object key this connector writes"
    )
    staging_buffer_size: int = pydantic.Field(
        64 * 2**20, gt=0, description="registered bounce buffer for unregistered memory; also the largest page"
    )
    lease_ttl_s: float = pydantic.Field(
        10.0, ge=0, description="the master's --default_kv_lease_ttl in seconds; bounds how long delete waits"
    )
    connect_timeout_s: float = pydantic.Field(
        3.0, gt=0, description="how long to try reaching the master before construction fails"
    )

    @pydantic.model_validator(mode="before")
    @classmethod
    def _fill_from_environment(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        filled = dict(data)
        for field, variables in _ENV_FALLBACKS.items():
            if filled.get(field) is None:
                for variable in variables:
                    if os.environ.get(variable):
                        filled[field] = os.environ[variable]
                        break
                else:
                    filled.pop(field, None)
        return filled

    @pydantic.field_validator("global_segment_size", "local_buffer_size", "staging_buffer_size", mode="before")
    @classmethod
    def _sizes(cls, value: Any) -> Any:
        return parse_size(value) if isinstance(value, str) else value


def _address(view: memoryview) -> int | None:
    """The address of a buffer's first byte, or ``None`` when it cannot be known without a copy."""
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    try:
        import numpy
    except ImportError:
        return None
    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data)


class MooncakeBackend(Connector):
    """Pages in a Mooncake Store cluster. See the module docstring for semantics and error mapping."""

    name = "mooncake"
    Config = MooncakeConfig
    config: MooncakeConfig
    capabilities = Capabilities(
        zero_copy_read=True,
        native_batch_exists=True,
        delete=True,
        clear=True,
        buffer_registration=True,
        shared_across_processes=True,
        shared_across_hosts=True,
        evicts=True,
    )

    def __init__(self, config: MooncakeConfig | dict | str | None = None) -> None:
        super().__init__(config)
        cfg: MooncakeConfig = self.config
        if not cfg.master_server_address:
            raise ConfigError(
                "the mooncake backend needs master_server_address (host:port of mooncake_master) "
                "in its config or in the MOONCAKE_MASTER environment variable",
                field="master_server_address",
                backend=self.name,
            )
        # With no segment of its own, this client's pages live elsewhere and outlive it; see
        # "Where bytes live" in the module docstring.
        lives_elsewhere = cfg.global_segment_size == 0
        self.capabilities = self.capabilities.replace(
            max_value_size=cfg.staging_buffer_size, persistent=lives_elsewhere, outlives_writer=lives_elsewhere
        )
        try:
            from mooncake.store import MooncakeDistributedStore
        except (ImportError, OSError) as exc:
            raise MissingDependencyError(self.name, "mooncake-transfer-engine (or -non-cuda without a GPU)", "mooncake") from exc
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", cfg.local_hostname)
        self._check_reachable(cfg.master_server_address, "master")
        if cfg.metadata_server.startswith(("http://", "https://")):
            parsed = urlparse(cfg.metadata_server)
            self._check_reachable(f"{parsed.hostname}:{parsed.port or 80}", "HTTP metadata server")
        self._store = MooncakeDistributedStore()
        code = self._store.setup(
            cfg.local_hostname,
            cfg.metadata_server,
            cfg.global_segment_size,
            cfg.local_buffer_size,
            cfg.protocol,
            cfg.device_name,
            cfg.master_server_address,
        )
        if code != 0:
            raise BackendUnavailableError(
                f"Mooncake client setup failed with code {code} (master {cfg.master_server_address}, "
                f"metadata {cfg.metadata_server}, protocol {cfg.protocol}); check that both are reachable from here",
                backend=self.name,
            )
        self._registered: list[tuple[int, int]] = []  # sorted, non-overlapping [start, end)
        self._registered_lock = threading.Lock()
        self._staging_memory = mmap.mmap(-1, cfg.staging_buffer_size)
        self._staging_array = (ctypes.c_ubyte * cfg.staging_buffer_size).from_buffer(self._staging_memory)
        self._staging = memoryview(self._staging_array).cast("B")
        self._staging_lock = threading.Lock()
        self._register_range(ctypes.addressof(self._staging_array), cfg.staging_buffer_size)
        self._last_lease: dict[Namespace, float] = {}
        self._lease_lock = threading.Lock()

    # --- hooks --------------------------------------------------------------------------------

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        self._note_leases(keys)
        codes = list(self._store.batch_is_exist([self._object_key(k) for k in keys]))
        if len(codes) != len(keys) or (codes and all(code < 0 for code in codes)):
            # Every key failed (1: stored, 0: not, below 0: the lookup failed), or the client
            # answered for other keys than asked: an error, not a batch of misses.
            raise self._unreachable(
                "exists", codes, f"did not answer an exists of {len(keys)} keys (client returned {len(codes)} codes: {sorted(set(codes))})"
            )
        return [code == 1 for code in codes]

    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        # Mooncake fills one target per distinct key of a batch (0.3.13: the last; it returns the
        # size for every repeat, the others untouched): read each key once per target size, then
        # copy its bytes into the repeats.
        first: dict[tuple[str, int], int] = {}
        repeats: list[tuple[int, int]] = []
        for i, (key, target) in enumerate(zip(keys, targets)):
            identity = (self._object_key(key), segments_size(target))
            if identity in first:
                repeats.append((i, first[identity]))
            else:
                first[identity] = i
        if not repeats:
            return self._get_distinct(keys, targets)
        distinct = list(first.values())
        results = [False] * len(keys)
        for i, hit in zip(distinct, self._get_distinct([keys[i] for i in distinct], [targets[i] for i in distinct])):
            results[i] = hit
        for i, source in repeats:
            if results[source]:
                fill_segments(targets[i], join_segments(targets[source]))
                results[i] = True
        return results

    def _get_distinct(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        """``_get_into`` for a batch in which no key repeats with the same target size."""
        self._note_leases(keys)
        results = [False] * len(keys)
        direct: list[int] = []
        staged: list[int] = []
        pointers: list[list[int]] = []
        for i, target in enumerate(targets):
            addresses = self._registered_addresses(target)
            if addresses is None:
                staged.append(i)
            else:
                direct.append(i)
                pointers.append(addresses)
        codes: dict[int, int] = {}
        if direct:
            raw = self._store.batch_get_into_multi_buffers(
                [self._object_key(keys[i]) for i in direct],
                pointers,
                [[view.nbytes for view in targets[i]] for i in direct],
            )
            codes.update(zip(direct, raw))
        for chunk in self._staging_chunks(staged, targets):
            with self._staging_lock:
                offsets = self._staging_offsets(chunk, targets)
                raw = self._store.batch_get_into(
                    [self._object_key(keys[i]) for i in chunk],
                    [self._staging_address + offset for offset in offsets],
                    [segments_size(targets[i]) for i in chunk],
                )
                for i, offset, code in zip(chunk, offsets, raw):
                    size = segments_size(targets[i])
                    if code == size:
                        fill_segments(targets[i], self._staging[offset : offset + size])
                    codes[i] = code
        self._raise_if_unreachable("get", list(codes.values()))
        for i, code in codes.items():
            results[i] = code == segments_size(targets[i])
        return results

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        direct: list[int] = []
        staged: list[int] = []
        pointers: list[int] = []
        for i, source in enumerate(sources):
            addresses = self._registered_addresses(source) if len(source) == 1 else None
            if addresses is None:
                staged.append(i)
            else:
                direct.append(i)
                pointers.append(addresses[0])
        codes: dict[int, int] = {}
        if direct:
            raw = self._store.batch_upsert_from(
                [self._object_key(keys[i]) for i in direct], pointers, [sources[i][0].nbytes for i in direct]
            )
            codes.update(zip(direct, raw))
        for chunk in self._staging_chunks(staged, sources):
            with self._staging_lock:
                offsets = self._staging_offsets(chunk, sources)
                for i, offset in zip(chunk, offsets):
                    position = offset
                    for view in sources[i]:
                        self._staging[position : position + view.nbytes] = view
                        position += view.nbytes
                raw = self._store.batch_upsert_from(
                    [self._object_key(keys[i]) for i in chunk],
                    [self._staging_address + offset for offset in offsets],
                    [segments_size(sources[i]) for i in chunk],
                )
            codes.update(zip(chunk, raw))
        self._raise_if_unreachable("put", list(codes.values()))
        return [codes[i] == 0 for i in range(len(keys))]

    def _delete(self, keys: list[PageKey]) -> list[bool]:
        names = [self._object_key(k) for k in keys]
        results = [False] * len(keys)
        pending = list(range(len(keys)))
        deadline = time.monotonic() + 1.5 * self.config.lease_ttl_s + 0.5
        pause = 0.01
        while pending:
            codes = self._store.batch_remove([names[i] for i in pending], False)
            self._raise_if_unreachable("delete", codes)
            leased = []
            for i, code in zip(pending, codes):
                if code == 0:
                    results[i] = True
                elif code == OBJECT_HAS_LEASE:
                    leased.append(i)
            pending = leased
            if pending:
                if time.monotonic() + pause > deadline:
                    break  # still leased by a reader: reported False, the page stays stored
                time.sleep(pause)
                pause = min(pause * 2, 0.2)
        return results

    def _clear(self, namespace: Namespace) -> None:
        # Our own recent reads and exists checks hold leases that would make the removal skip
        # those pages: wait them out first. Other clients' leases are unknown to us.
        with self._lease_lock:
            last = self._last_lease.pop(namespace, None)
        if last is not None:
            wait = last + self.config.lease_ttl_s + 0.05 - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        pattern = "^" + re.escape(self.config.key_prefix + namespace.fingerprint + "/")
        code = self._store.remove_by_regex(pattern, False)
        if code < 0:
            self._raise_if_unreachable("clear", [code])
            # A page under a read lease goes once the lease ends; other codes need a fix.
            raise StorageError(
                f"Mooncake remove_by_regex failed with code {code}",
                backend=self.name,
                operation="clear",
                status=ErrorStatus.TEMPORARY if code == OBJECT_HAS_LEASE else ErrorStatus.PERMANENT,
            )

    def _register_buffer(self, view: memoryview) -> None:
        address = _address(view)
        if address is None:
            raise InvalidArgumentError(
                "register_buffer needs writable memory (or numpy installed to find a read-only buffer's address)",
                backend=self.name,
                operation="register_buffer",
            )
        if view.nbytes and self._covered(address, view.nbytes) is None:
            self._register_range(address, view.nbytes)

    def _close(self) -> None:
        # Mooncake's shutdown joins its heartbeat thread while holding the GIL (about 1 s); a
        # background thread would block the caller just the same, so it is done here.
        self._store.close()
        self._staging.release()
        del self._staging_array
        self._staging_memory.close()

    @property
    def client(self) -> Any:
        """The ``MooncakeDistributedStore`` this connector calls, for code that reads or writes the
        cluster without the hooks, such as the conformance suite's backdoor. Calls on it bypass this
        connector: no key prefix, staging buffer or lease bookkeeping (``clear`` does not wait for the
        read leases they take). Closed by ``close``."""
        return self._store

    # --- internals ----------------------------------------------------------------------------

    def _object_key(self, key: PageKey) -> str:
        return self.config.key_prefix + key.render("/")

    @property
    def _staging_address(self) -> int:
        return ctypes.addressof(self._staging_array)

    def _check_reachable(self, address: str, what: str) -> None:
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=self.config.connect_timeout_s):
                pass
        except (OSError, ValueError) as exc:
            raise BackendUnavailableError(
                f"cannot reach the Mooncake {what} at {address}: {exc}; start it or fix the address in the config",
                backend=self.name,
            ) from None

    def _register_range(self, address: int, size: int) -> None:
        code = self._store.register_buffer(address, size)
        if code != 0:
            raise StorageError(
                f"Mooncake register_buffer of {size} bytes failed with code {code}; check protocol and device_name in the config",
                backend=self.name,
                operation="register_buffer",
                status=ErrorStatus.PERMANENT,
            )
        with self._registered_lock:
            bisect.insort(self._registered, (address, address + size))

    def _covered(self, address: int, size: int) -> tuple[int, int] | None:
        """The registered range holding ``[address, address + size)``, if any."""
        with self._registered_lock:
            index = bisect.bisect_right(self._registered, (address, float("inf"))) - 1
            if index >= 0:
                start, end = self._registered[index]
                if start <= address and address + size <= end:
                    return start, end
        return None

    def _registered_addresses(self, segments: Segments) -> list[int] | None:
        """Each segment's address if every one lies in registered memory, else ``None``."""
        addresses = []
        for view in segments:
            address = _address(view) if view.nbytes else None
            if address is None or self._covered(address, view.nbytes) is None:
                return None
            addresses.append(address)
        return addresses

    def _staging_chunks(self, indices: list[int], buffers: list[Segments]) -> list[list[int]]:
        """Split ``indices`` into runs whose pages fit in the staging buffer together."""
        chunks: list[list[int]] = []
        current: list[int] = []
        used = 0
        for i in indices:
            size = segments_size(buffers[i])
            if current and used + size > self.config.staging_buffer_size:
                chunks.append(current)
                current, used = [], 0
            current.append(i)
            used += size
        if current:
            chunks.append(current)
        return chunks

    @staticmethod
    def _staging_offsets(chunk: list[int], buffers: list[Segments]) -> list[int]:
        offsets, position = [], 0
        for i in chunk:
            offsets.append(position)
            position += segments_size(buffers[i])
        return offsets

    def _note_leases(self, keys: list[PageKey]) -> None:
        now = time.monotonic()
        with self._lease_lock:
            for key in keys:
                self._last_lease[key.scope.namespace] = now

    def _raise_if_unreachable(self, operation: str, codes: list[int]) -> None:
        """Raise when every key of a call failed because the cluster could not be reached."""
        if codes and all(code in _UNREACHABLE for code in codes):
            raise self._unreachable(operation, codes, f"or a storage node did not answer (codes {sorted(set(codes))})")

    def _unreachable(self, operation: str, codes: list[int], what: str) -> StorageError:
        """The error for a call the cluster did not answer: a timeout if -901 is among ``codes``."""
        error: Callable[..., StorageError] = StorageTimeoutError if RPC_TIMEOUT in codes else BackendUnavailableError
        return error(
            f"Mooncake master {self.config.master_server_address} {what}; the client reconnects when it is back",
            backend=self.name,
            operation=operation,
        )
