"""An append-only token sequence that remembers its SGLang page hashes.

A conversation grows by appends, and every call into the radix tree (match, insert) and into L3
(page keys) needs the SHA-256 page chain of the whole prefix. Hashing the whole conversation per
call is linear in its length; a :class:`TokenSequence` hashes each page once, the first time it is
asked for, and keeps the digests. The radix tree then finds the deepest cached page with a few
dictionary lookups instead of comparing tokens (see ``RadixTree.match_prefix``).

The chain is the one of :func:`hicache_storage.keys.page_hashes`: equal hashes mean equal
prefixes up to SHA-256 collisions, which is the trust L3 keys already rest on.

Not thread-safe: one owner appends and reads.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

from hicache_storage.errors import InvalidKeyError


def chain_page_hashes(tokens: Iterable[int], page_size: int, prior_hash: str | None = None) -> list[str]:
    """Same result as :func:`hicache_storage.keys.page_hashes`, hashing straight from packed ids."""
    try:
        packed = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise InvalidKeyError("token ids must be integers with 0 <= id < 2**32") from exc
    hexes: list[str] = []
    _chain(packed, 0, len(packed) // page_size, page_size, bytes.fromhex(prior_hash) if prior_hash else b"", [], hexes)
    return hexes


def _chain(tokens: array, first: int, pages: int, page_size: int, prior: bytes, digests: list[bytes], hexes: list[str]) -> None:
    """Append to ``digests``/``hexes`` the chain over ``pages`` pages of ``tokens`` from token ``first``.

    SGLang's encoding: SHA-256 of the prior page's digest then each id as 4-byte little-endian.
    """
    if sys.byteorder != "little":
        tokens = array("I", tokens[first : first + pages * page_size])
        tokens.byteswap()
        first = 0
    step = 4 * page_size
    sha256 = hashlib.sha256
    data = memoryview(tokens).cast("B")
    try:
        for start in range(4 * first, 4 * first + pages * step, step):
            hasher = sha256(prior)
            hasher.update(data[start : start + step])
            prior = hasher.digest()
            digests.append(prior)
            hexes.append(prior.hex())
    finally:
        data.release()


class _Store:
    """Tokens as 4-byte unsigned ints (the hash input encoding) and the digests of full pages."""

    __slots__ = ("tokens", "digests", "hexes")

    def __init__(self) -> None:
        self.tokens = array("I")
        self.digests: list[bytes] = []
        self.hexes: list[str] = []


class TokenSequence(Sequence[int]):
    """Token ids (``0 <= id < 2**32``) with their page hashes for one page size.

    A read-only ``Sequence[int]`` (indexing and slices give ints and lists).
    :meth:`prefix` gives an O(1) view of the first tokens that shares the hash cache; extending a
    view that is not at the tip copies it first, so a view never changes.
    """

    __slots__ = ("page_size", "_store", "_length")

    def __init__(self, page_size: int, tokens: Iterable[int] = ()) -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise InvalidKeyError(f"page_size must be a positive integer, got {page_size!r}")
        self.page_size = page_size
        self._store = _Store()
        self._length = 0
        self.extend(tokens)

    # --- growth -------------------------------------------------------------------------------

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens``; raises ``InvalidKeyError`` (and appends nothing) if one is out of range."""
        try:
            new = array("I", tokens)
        except (OverflowError, TypeError) as exc:
            raise InvalidKeyError("token ids must be integers with 0 <= id < 2**32") from exc
        if self._length != len(self._store.tokens):
            self._fork()
        self._store.tokens.extend(new)
        self._length += len(new)

    def append(self, token: int) -> None:
        self.extend((token,))

    def _fork(self) -> None:
        """Give this view its own store holding only its tokens (and their known hashes)."""
        old, pages = self._store, self._length // self.page_size
        store = _Store()
        store.tokens = old.tokens[: self._length]
        store.digests = old.digests[:pages]
        store.hexes = old.hexes[:pages]
        self._store = store

    def continuation(self, tokens: Iterable[int]) -> TokenSequence | None:
        """``tokens`` as a sequence that reuses this one's page hashes, or None when ``tokens`` does
        not start with this whole sequence (then nothing is shared).

        For the next turn of a conversation: its prompt repeats the previous sequence, whose
        hashes need not be computed again. The check is one C-level comparison of the tokens.
        This sequence is unchanged (if it is not at the tip of its storage, the result gets its
        own copy, as :meth:`extend` on a view does).
        """
        try:
            new = array("I", tokens)
        except (OverflowError, TypeError) as exc:
            raise InvalidKeyError("token ids must be integers with 0 <= id < 2**32") from exc
        length = self._length
        if len(new) < length or new[:length] != self._store.tokens[:length]:
            return None
        continued = self.prefix(length)
        continued.extend(new[length:])
        return continued

    def prefix(self, length: int) -> TokenSequence:
        """The first ``length`` tokens, sharing storage and hashes (O(1))."""
        if not 0 <= length <= self._length:
            raise IndexError(f"prefix length {length} outside 0..{self._length}")
        view = TokenSequence.__new__(TokenSequence)
        view.page_size, view._store, view._length = self.page_size, self._store, length
        return view

    # --- hashes -------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        """Full pages in the sequence (a trailing partial page has no hash)."""
        return self._length // self.page_size

    def page_hashes(self, stop: int | None = None) -> list[str]:
        """Hex hashes of pages ``[0, stop)`` (all full pages by default), computing only new ones.

        Returns the cache itself for speed when it is exactly that long; callers must not mutate it.
        """
        pages = self.num_pages if stop is None else stop
        if not 0 <= pages <= self.num_pages:
            raise IndexError(f"page {pages} outside 0..{self.num_pages}")
        self._hash_until(pages)
        hexes = self._store.hexes
        return hexes if len(hexes) == pages else hexes[:pages]

    def page_hash(self, page: int) -> str:
        """Hex hash of page ``page`` (0-based), which names the whole prefix up to its end."""
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} outside 0..{self.num_pages - 1}")
        self._hash_until(page + 1)
        return self._store.hexes[page]

    def known_page_hashes(self) -> list[str]:
        """Every page hash of this sequence (computed now if missing), as the shared cache itself.

        Entries past :attr:`num_pages` may exist (a longer sequence sharing this one's storage)
        and must be ignored; the list must not be mutated. No copy, for the tree's lookups.
        """
        self._hash_until(self.num_pages)
        return self._store.hexes

    def _hash_until(self, pages: int) -> None:
        store = self._store
        done = len(store.digests)
        if done < pages:
            ps = self.page_size
            _chain(store.tokens, done * ps, pages - done, ps, store.digests[-1] if done else b"", store.digests, store.hexes)

    # --- Sequence reads -----------------------------------------------------------------------

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            return self._store.tokens[start:stop:step].tolist()
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError("TokenSequence index out of range")
        return self._store.tokens[index]

    def __iter__(self) -> Iterator[int]:
        tokens = self._store.tokens
        return (tokens[i] for i in range(self._length))

    def tolist(self) -> list[int]:
        return self._store.tokens[: self._length].tolist()

    def __repr__(self) -> str:
        return f"TokenSequence(page_size={self.page_size}, tokens={self._length}, hashed_pages={min(len(self._store.digests), self.num_pages)})"
