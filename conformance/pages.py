"""Page contents that name their key, so every read can say whose bytes it got.

A page the suite writes for ``(key, version)`` is a 32-byte header (a magic, the first 16 bytes
of the SHA-256 of the rendered key, the version, the page size) followed by bytes drawn from a
generator seeded with that header (a random block repeated at a prime period), the whole cut to the page size. A reader can then tell a
whole page of its own key from another key's page, from a version never written, and from a
torn mix of two versions: the body of one version never follows the header of another.

Pages shorter than the header carry a prefix of it; :func:`check_page` then compares them with
each candidate version in full.
"""

from __future__ import annotations

import functools
import hashlib
import random
import struct
from collections.abc import Iterable, Mapping, Sequence

from hicache_storage.keys import PageKey

HEADER = struct.Struct("<4s16sQI")
MAGIC = b"HCpg"
#: Larger bodies repeat a random block of this many bytes: a prime, so a page whose chunks of
#: any power-of-two size are swapped, dropped or shifted never matches.
_BODY_PERIOD = 65521
#: Pages up to this size are cached (the concurrent clauses read the same pages many times);
#: the few most recent of up to ``_CACHED_LARGE_PAGE_BYTES`` too (their MiB pages, checked on every read).
_CACHED_PAGE_BYTES = 1 << 20
_CACHED_LARGE_PAGE_BYTES = 4 << 20


def random_hash(rng: random.Random, digits: int = 64) -> str:
    """A page hash of ``digits`` hex digits (PageKey allows 8 to 128)."""
    return "%0*x" % (digits, rng.getrandbits(4 * digits))


def key_digest(key: PageKey) -> bytes:
    return hashlib.sha256(key.render().encode()).digest()[:16]


def page_for(key: PageKey, size: int, version: int = 0) -> bytes:
    """The page the suite writes for ``key`` at ``version``: ``size`` bytes that name both."""
    digest = key_digest(key)
    if size <= _CACHED_PAGE_BYTES:
        return _cached_page(digest, version, size)
    if size <= _CACHED_LARGE_PAGE_BYTES:
        return _cached_large_page(digest, version, size)
    return _make_page(digest, version, size)


def _make_page(digest: bytes, version: int, size: int) -> bytes:
    header = HEADER.pack(MAGIC, digest, version, size & 0xFFFFFFFF)
    body_size = max(0, size - HEADER.size)
    block = random.Random(header).randbytes(min(body_size, _BODY_PERIOD))
    body = block * (body_size // _BODY_PERIOD) + block[: body_size % _BODY_PERIOD] if block else b""
    return (header + body)[:size]


@functools.lru_cache(maxsize=512)
def _cached_page(digest: bytes, version: int, size: int) -> bytes:
    return _make_page(digest, version, size)


@functools.lru_cache(maxsize=32)
def _cached_large_page(digest: bytes, version: int, size: int) -> bytes:
    return _make_page(digest, version, size)


class PageMismatch(AssertionError):
    """A read returned bytes that are not a whole page of the key asked for."""


Bytes = bytes | bytearray | memoryview


def byte_difference(got: Bytes | None | Sequence[Bytes | None], expected: Bytes | None | Sequence[Bytes | None]) -> str | None:
    """Where ``got`` first differs from ``expected``, in one short line; ``None`` when equal.

    Each is a page (bytes-like, ``None`` for a miss) or a list of them. Clauses compare pages
    through this, never with a bare ``==`` in an ``assert``: pytest explains a failed ``==`` of two
    pages by diffing their reprs, and with ``CI`` set (where it truncates nothing) that diff runs
    for minutes on a MiB page, so a vendor's CI would hang on the failure instead of reporting it.
    """
    if isinstance(expected, (bytes, bytearray, memoryview)) or expected is None:
        return _page_difference(got, expected)  # type: ignore[arg-type]
    if isinstance(got, (bytes, bytearray, memoryview)) or got is None:
        return f"got {_describe(got)} where a list of {len(expected)} pages was expected"
    if len(got) != len(expected):
        return f"got {len(got)} pages, expected {len(expected)}"
    for index, (one, other) in enumerate(zip(got, expected)):
        if (difference := _page_difference(one, other)) is not None:
            return f"page {index} of {len(expected)}: {difference}"
    return None


def assert_same_bytes(got: Bytes | None | Sequence[Bytes | None], expected: Bytes | None | Sequence[Bytes | None], message: str = "") -> None:
    """Fail with ``message`` and :func:`byte_difference`'s line unless ``got`` equals ``expected``."""
    if (difference := byte_difference(got, expected)) is not None:
        raise AssertionError(f"{message}: {difference}" if message else difference)


def _describe(data: Bytes | None) -> str:
    return "a miss" if data is None else f"{len(data)} byte{'' if len(data) == 1 else 's'}"


def _page_difference(got: Bytes | None, expected: Bytes | None) -> str | None:
    if got is None or expected is None:
        return None if got is None and expected is None else f"got {_describe(got)}, expected {_describe(expected)}"
    got, expected = bytes(got), bytes(expected)
    if got == expected:
        return None
    common = min(len(got), len(expected))
    offset = common
    for start in range(0, common, 4096):  # by blocks: a Python loop over every byte of a MiB page is slow
        end = min(start + 4096, common)
        if got[start:end] != expected[start:end]:
            offset = next(i for i in range(start, end) if got[i] != expected[i])
            break
    if offset == common:
        return f"got {len(got)} bytes, expected {len(expected)} (equal over the first {common})"
    return (
        f"{len(got)} bytes against {len(expected)}, first different at byte {offset}: "
        f"got {got[offset : offset + 8].hex()}, expected {expected[offset : offset + 8].hex()}"
    )


def check_page(
    data: bytes | bytearray | memoryview | None,
    key: PageKey,
    versions: Iterable[int] = (0,),
    known: Mapping[bytes, PageKey] | None = None,
) -> int:
    """The version of ``key`` that ``data`` holds whole; raises :class:`PageMismatch` otherwise.

    ``versions`` are the versions a correct store may return at this point; ``known`` maps
    :func:`key_digest` of the other keys in play to the keys, to name a foreign page. ``None``
    (what ``get`` returns for a miss) is a mismatch.
    """
    if data is None:
        raise PageMismatch(f"read of {_name(key)} was a miss; a correct store returns one of versions {_span(set(versions))}")
    data = bytes(data)
    size = len(data)
    allowed = set(versions)
    if size < HEADER.size:
        for version in allowed:
            if data == page_for(key, size, version):
                return version
        raise PageMismatch(f"{size}-byte read of {_name(key)} holds none of versions {sorted(allowed)}")
    magic, digest, version, stated = HEADER.unpack_from(data)
    if magic != MAGIC or stated != size & 0xFFFFFFFF:
        raise PageMismatch(f"read of {_name(key)} holds no page header: a torn, shifted or foreign value")
    if digest != key_digest(key):
        other = (known or {}).get(digest)
        raise PageMismatch(f"read of {_name(key)} returned the page of {_name(other) if other else 'another key'}")
    if data != page_for(key, size, version):
        first = next(i for i, (a, b) in enumerate(zip(data, page_for(key, size, version))) if a != b)
        raise PageMismatch(f"read of {_name(key)}: header of version {version}, other bytes from offset {first} (torn)")
    if version not in allowed:
        raise PageMismatch(f"read of {_name(key)} returned version {version}; a correct store returns one of {_span(allowed)}")
    return version


def _name(key: PageKey | None) -> str:
    return "an unknown key" if key is None else f"page {key.page_hash[:16]}..{len(key.page_hash)} ({key.scope.prefix()})"


def _span(versions: set[int]) -> str:
    ordered = sorted(versions)
    if len(ordered) > 3 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}..{ordered[-1]}"
    return str(ordered)
