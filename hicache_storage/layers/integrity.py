"""Integrity: a page reads back as exactly the bytes written for its key, or as a miss.

Every stored value is the page's bytes followed by a fixed 48-byte trailer::

    offset size field
         0    4 magic            b"HCPG"
         4    2 format version   1 (little-endian, like every integer here)
         6    1 checksum kind    1 = crc32 (zlib), 2 = blake2b-128
         7    1 reserved         0
         8    8 payload length   bytes of page data before the trailer
        16   16 key digest       blake2b-128 of the key's rendered identity, ``key.render()``
        32   16 checksum         over the payload and trailer bytes 0..31 (crc32 in the first 4
                                 bytes, zero-padded; or blake2b-128)

Reads stay zero-copy: the inner backend gets the caller's segments plus a private 48-byte trailer
buffer as one more segment, so the page lands directly in caller memory and only the trailer is
checked on the side. Trailer buffers come from one small arena which, when the inner backend
declares ``buffer_registration``, is registered with it once, so a store that moves bytes
zero-copy only between registered buffers (Mooncake) still reads straight into the caller's
registered host pool. Each trailer buffer is zeroed before a read, so a store that reports a hit
without delivering the trailer fails the magic check. A page whose trailer has the wrong magic, version, checksum kind, payload
length or key digest, or whose checksum does not match, is a **miss** (``False``), counted in
``stats()`` as ``integrity_miss_<reason>`` and logged; its bytes are never reported as data
(the caller's target then holds unspecified bytes, as for any miss). That turns a torn or
truncated value, the bytes of another key stored under this one (misplaced), a page of another
namespace, tenant or layout (foreign: the key digest covers every identity field), values written
without this layer, and corrupted bytes into misses.

``exists`` does not read pages by default, so it can be ``True`` for a page that then reads as a
miss; callers must handle a miss after a positive exists anyway (a page may also be evicted or
deleted in between). With ``verify_exists`` it reads and checks each page whose size it knows:
the payload size of each key scope (namespace, shard, part) is learned from the puts and reads
that pass through this layer (the last one seen wins), and a page is then reported only if it
reads back whole at that size; keys of a scope not seen yet are answered by the inner ``exists``.
Verifying costs one full read per page, which is why it is off by default.

Writers and readers must agree on the trailer: a store filled through this layer reads as all
misses without it, and the other way round. ``max_value_size`` shrinks by the trailer's size.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import zlib
from collections.abc import Iterable
from typing import Any, Literal

import pydantic

from hicache_storage.connector import Level
from hicache_storage.buffers import Segments, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.errors import ConfigError, StorageError
from hicache_storage.keys import KeyScope, PageKey
from hicache_storage.layers.base import Layer

log = logging.getLogger(__name__)

MAGIC = b"HCPG"
TRAILER_VERSION = 1
_HEAD = struct.Struct("<4sHBBQ16s")  # every trailer field but the checksum
_TRAILER = struct.Struct("<4sHBBQ16s16s")
TRAILER_SIZE = _TRAILER.size
_CHECKSUMS = {"crc32": 1, "blake2b": 2}
REASONS = ("magic", "version", "checksum_kind", "length", "key", "checksum")
#: Failures of one reason logged at WARNING before switching to one in every thousand.
_LOUD_FAILURES = 10


class IntegrityConfig(BackendConfig):
    checksum: Literal["crc32", "blake2b"] = pydantic.Field(
        "crc32", description="checksum written on puts; reads verify whichever kind the trailer names"
    )
    verify_exists: bool = pydantic.Field(
        False, description="exists() reads and verifies pages of known size instead of trusting the store"
    )
    trailer_slots: int = pydantic.Field(
        1024, ge=0, le=2**20, description="reads in flight that use the (registered) trailer arena; more use plain buffers"
    )


def key_digest(key: PageKey) -> bytes:
    """16 bytes naming the key's full identity (namespace, shard, part, page hash)."""
    return hashlib.blake2b(key.render().encode(), digest_size=16).digest()


def _checksum(kind: int, chunks: Iterable[Any]) -> bytes:
    if kind == 1:
        crc = 0
        for chunk in chunks:
            crc = zlib.crc32(chunk, crc)
        return crc.to_bytes(4, "little") + bytes(12)
    hasher = hashlib.blake2b(digest_size=16)
    for chunk in chunks:
        hasher.update(chunk)
    return hasher.digest()


def make_trailer(key: PageKey, payload: Segments, checksum: str = "crc32") -> bytes:
    """The trailer stored after ``payload`` under ``key``."""
    kind = _CHECKSUMS[checksum]
    head = _HEAD.pack(MAGIC, TRAILER_VERSION, kind, 0, segments_size(payload), key_digest(key))
    return head + _checksum(kind, [*payload, head])


def check_trailer(key: PageKey, payload: Segments, trailer: bytes | bytearray | memoryview) -> str | None:
    """``None`` if ``trailer`` vouches for ``payload`` under ``key``; otherwise the failed check's name."""
    magic, version, kind, _, length, digest, checksum = _TRAILER.unpack(trailer)
    if magic != MAGIC:
        return "magic"
    if version != TRAILER_VERSION:
        return "version"
    if kind not in _CHECKSUMS.values():
        return "checksum_kind"
    if length != segments_size(payload):
        return "length"
    if digest != key_digest(key):
        return "key"
    if checksum != _checksum(kind, [*payload, memoryview(trailer)[: _HEAD.size]]):
        return "checksum"
    return None


class _TrailerSlots:
    """Trailer buffers carved from one arena; thread-safe. Out of slots, plain buffers are used."""

    def __init__(self, count: int) -> None:
        self.arena = memoryview(bytearray(count * TRAILER_SIZE))
        self._free = list(range(count))
        self._lock = threading.Lock()

    def take(self, count: int) -> tuple[list[memoryview], list[int]]:
        with self._lock:
            taken = [self._free.pop() for _ in range(min(count, len(self._free)))]
        views = [self.arena[i * TRAILER_SIZE : (i + 1) * TRAILER_SIZE] for i in taken]
        views += [memoryview(bytearray(TRAILER_SIZE)) for _ in range(count - len(taken))]
        for view in views[: len(taken)]:
            view[:] = bytes(TRAILER_SIZE)
        return views, taken

    def give_back(self, taken: list[int]) -> None:
        with self._lock:
            self._free.extend(taken)


class IntegrityLayer(Layer):
    """Adds and verifies a trailer per page; see the module docstring. Thread-safe."""

    kind = "integrity"
    Config = IntegrityConfig
    extra_stats = tuple(f"integrity_miss_{reason}" for reason in REASONS)
    config: IntegrityConfig

    def __init__(self, inner: Level, config: IntegrityConfig | dict[str, Any] | str | None = None) -> None:
        super().__init__(inner, config)
        self._page_sizes: dict[KeyScope, int] = {}
        self._slots = _TrailerSlots(self.config.trailer_slots)
        self._arena_registration = threading.Lock()
        self._arena_registered = not self.config.trailer_slots
        self.capabilities  # noqa: B018  # refuses a store whose values leave no room for the trailer

    def adjust_capabilities(self, inner: Capabilities) -> Capabilities:
        limit = inner.max_value_size
        if limit is None:
            return inner
        if limit <= TRAILER_SIZE:
            raise ConfigError(
                f"{self.inner.name} stores values of at most {limit} bytes, which leaves no room for a page "
                f"after the {TRAILER_SIZE}-byte integrity trailer; raise the store's limit or drop integrity",
                backend=self.name,
            )
        return inner.replace(max_value_size=limit - TRAILER_SIZE)

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        framed = []
        for key, source in zip(keys, sources):
            framed.append([*source, memoryview(make_trailer(key, source, self.config.checksum))])
            self._page_sizes[key.scope] = segments_size(source)
        return super()._put_from(keys, framed)

    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        if not self._arena_registered and self.inner.capabilities.buffer_registration:
            self._register_arena()
        trailers, taken = self._slots.take(len(keys))
        try:
            framed = [[*target, trailer] for target, trailer in zip(targets, trailers)]
            results = super()._get_into(keys, framed)
            return [
                hit and self._verified(key, target, trailer)
                for key, target, trailer, hit in zip(keys, targets, trailers, results)
            ]
        finally:
            self._slots.give_back(taken)

    def _register_arena(self) -> None:
        """Register the trailer arena with the level below, once it declares buffer registration
        (read live: a connector may declare it after opening); a refusal only costs speed."""
        with self._arena_registration:
            if self._arena_registered:
                return
            self._arena_registered = True
            try:
                super()._register_buffer(self._slots.arena)
            except StorageError as exc:
                log.warning("%s: registering the trailer arena failed, reads may not be zero-copy: %s", self.name, exc)

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        results = super()._exists(keys)
        if not self.config.verify_exists:
            return results
        sizes = [self._page_sizes.get(key.scope) for key in keys]
        checkable = [(i, size) for i, (hit, size) in enumerate(zip(results, sizes)) if hit and size is not None]
        if checkable:
            scratch: list[Segments] = [[memoryview(bytearray(size))] for _, size in checkable]
            verified = self._get_into([keys[i] for i, _ in checkable], scratch)
            for (i, _), ok in zip(checkable, verified):
                results[i] = ok
        return results

    def _verified(self, key: PageKey, target: Segments, trailer: memoryview) -> bool:
        reason = check_trailer(key, target, trailer)
        if reason is None:
            self._page_sizes[key.scope] = segments_size(target)
            return True
        counter = f"integrity_miss_{reason}"
        seen = self._count(**{counter: 1})
        if seen <= _LOUD_FAILURES or seen % 1000 == 0:
            log.warning(
                "%s: page %s failed its %s check and reads as a miss (%d such failures so far)",
                self.name,
                key,
                reason,
                seen,
            )
        return False
