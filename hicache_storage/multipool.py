"""Several pools of one model in one store, and the longest prefix all of them can restore.

A hybrid model keeps more than one kind of state per page of tokens: the full-attention KV (the
``kv`` pool), a sliding-window layer's KV (``swa``), a recurrent layer's state checkpoint
(``mamba``). Restoring a prefix of ``c`` pages from L3 is correct only if every pool can give
what that prefix needs; a KV hit with missing side state is silently wrong output. Each pool
declares what it needs with a :class:`HitPolicy`:

* ``ALL_PAGES``: every page before the cut (the KV; an indexer pool). Such pools *vote*: at least
  one is required, and they bound the cut.
* ``TRAILING_PAGES``: only the last ``trailing_pages`` pages before the cut. A sliding window of
  ``w`` pages needs pages ``[c - w, c)``; a recurrent checkpoint needs one page (``w = 1``). Older
  pages may be gone, so cut 5 can be restorable while 4 and 3 are not.

The usable prefix is the **longest cut every pool accepts** (:func:`longest_cut`); cut 0 (restore
nothing) is always accepted. Removing any page a pool needs at the full cut therefore shortens the
answer: never a full hit with missing state.

Keys. Pool ``P``'s page ``h`` is ``scope.with_part(P.name).key(h)``: the same page hash in two
pools names two values, which never share bytes. A recurrent checkpoint valid at cut ``c`` (the
state after the first ``c`` pages) is stored under the hash of page ``c - 1``, the last page it
covers; with ``TRAILING_PAGES`` and ``trailing_pages=1`` the cut ``c`` is then accepted exactly
when that checkpoint is present.

Sidecars. A pool that follows another pool's indices without voting (a speculative-decoding draft
model's KV follows the target's KV) is not a pool here: it is stored as extra segments of its
source pool's page value (``put("kv", hashes, [[k, v, draft_k, draft_v], ...])``). One key, one
atomic value: it is saved and restored with its source by construction, and a reader whose
buffers lack the draft segments gets a miss (a length mismatch), never half a page.

:class:`MultiPoolStore` is thread-safe: it holds only immutable state over a
:class:`~hicache_storage.store.Store`, which is thread-safe when its stack is (every connector
is, by contract).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from hicache_storage.buffers import BufferLike
from hicache_storage.errors import ErrorStatus, InvalidArgumentError, InvalidKeyError, StorageError
from hicache_storage.keys import KeyScope, PageKey
from hicache_storage.store import Store

logger = logging.getLogger(__name__)

T = TypeVar("T")


class HitPolicy(str, enum.Enum):
    """Which pages before a cut a pool needs to restore that cut (SGLang's ``PoolHitPolicy`` values)."""

    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"


@dataclass(frozen=True)
class PoolSpec:
    """One pool: its key part, and which pages it needs before a cut.

    ``trailing_pages`` is the window of a ``TRAILING_PAGES`` pool (at least 1); leave it at 1 for
    ``ALL_PAGES``. ``scope`` is the pool's own key scope when its namespace or shard differs from
    the store's (a pool of another dtype, a state replicated on every TP rank); its part is
    replaced by ``name`` either way.
    """

    name: str
    hit_policy: HitPolicy = HitPolicy.ALL_PAGES
    trailing_pages: int = 1
    scope: KeyScope | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgumentError(f"PoolSpec.name must be the pool's key part, e.g. 'kv' or 'swa'; got {self.name!r}")
        try:
            policy = HitPolicy(self.hit_policy)
        except ValueError:
            choices = ", ".join(repr(p.value) for p in HitPolicy)
            raise InvalidArgumentError(
                f"pool {self.name!r}: hit_policy must be a HitPolicy ({choices}); got {self.hit_policy!r}"
            ) from None
        object.__setattr__(self, "hit_policy", policy)
        window = self.trailing_pages
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise InvalidArgumentError(
                f"pool {self.name!r}: trailing_pages must be an int >= 1 (the pages a cut needs); got {window!r}"
            )
        if self.scope is not None and not isinstance(self.scope, KeyScope):
            raise InvalidArgumentError(f"pool {self.name!r}: scope must be a KeyScope or None; got {type(self.scope).__name__}")
        if policy is HitPolicy.ALL_PAGES and window != 1:
            raise InvalidArgumentError(
                f"pool {self.name!r}: trailing_pages={window} applies to TRAILING_PAGES pools only; "
                "drop it, or set hit_policy=HitPolicy.TRAILING_PAGES"
            )

    def accepted_cuts(self, present: Sequence[bool]) -> list[bool]:
        """For each cut ``c`` in ``0..len(present)``: may this pool restore pages ``[0, c)``?

        ``present[i]`` says whether this pool's page ``i`` is stored. Cut 0 is always accepted.
        """
        accepted = [True]
        run = 0  # present pages ending just before the current cut
        for c, here in enumerate(present, start=1):
            run = run + 1 if here else 0
            needed = c if self.hit_policy is HitPolicy.ALL_PAGES else min(c, self.trailing_pages)
            accepted.append(run >= needed)
        return accepted


def common_cuts(pools: Sequence[PoolSpec], presence: Mapping[str, Sequence[bool]]) -> list[bool]:
    """For each cut ``c`` in ``0..n``: does every pool accept it? ``presence`` maps each pool's name
    to its per-page presence, all of one length ``n``."""
    if not pools:
        raise InvalidArgumentError("no pools given; pass at least the KV pool's PoolSpec")
    missing = [spec.name for spec in pools if spec.name not in presence]
    if missing:
        raise InvalidArgumentError(f"presence has no entry for pool(s) {', '.join(map(repr, missing))}; give one list per pool")
    lengths = {spec.name: len(presence[spec.name]) for spec in pools}
    if len(set(lengths.values())) > 1:
        raise InvalidArgumentError(f"every pool's presence must cover the same pages; got lengths {lengths}")
    accepted = [True] * (next(iter(lengths.values())) + 1)
    for spec in pools:
        accepted = [a and b for a, b in zip(accepted, spec.accepted_cuts(presence[spec.name]))]
    return accepted


def longest_cut(pools: Sequence[PoolSpec], presence: Mapping[str, Sequence[bool]]) -> int:
    """The longest cut (in pages) every pool accepts; 0 when only the empty prefix is."""
    accepted = common_cuts(pools, presence)
    return max(c for c, ok in enumerate(accepted) if ok)


@dataclass(frozen=True)
class PoolCuts:
    """What one :meth:`MultiPoolStore.lookup` found.

    ``cuts``: every cut longer than ``held`` that every pool accepts, ascending. They need not be
    contiguous: a TRAILING_PAGES pool may accept cut 5 but not 4 (SGLang's
    ``restorable_prefix_pages``). ``longest`` is the last of them, or ``held`` when there is none.

    ``pool_hits``: each pool's own longest accepted cut (``held`` when it accepts none longer),
    for each pool asked about every cut up to the prefix the first ALL_PAGES pool holds. A pool
    asked about fewer (an earlier pool already ruled the later cuts out, and a trailing pool may
    accept a later cut it was not asked about) or not at all has no entry: its own longest cut is
    not known.
    """

    held: int
    cuts: tuple[int, ...]
    pool_hits: Mapping[str, int]

    @property
    def longest(self) -> int:
        return self.cuts[-1] if self.cuts else self.held


class MultiPoolStore:
    """One store holding several pools under one KeyScope (``scope.part`` is replaced per pool).

    Per-key results and errors are the store's (see :mod:`hicache_storage.connector`), except in
    :meth:`usable_pages`, which reports a store that fails with a retryable error as holding nothing.
    """

    def __init__(self, store: Store, scope: KeyScope, pools: Sequence[PoolSpec]) -> None:
        if not isinstance(store, Store):
            raise InvalidArgumentError(
                f"store must be a Store (open_store(...), or Store(connector)); got {type(store).__name__}"
            )
        if not isinstance(scope, KeyScope):
            raise InvalidArgumentError(f"scope must be a KeyScope; got {type(scope).__name__}")
        pools = list(pools)
        for spec in pools:
            if not isinstance(spec, PoolSpec):
                raise InvalidArgumentError(f"pools must be PoolSpec objects; got {type(spec).__name__}: {spec!r}")
        names = [spec.name for spec in pools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise InvalidArgumentError(f"pool names must be unique, {', '.join(map(repr, duplicates))} repeats; rename one")
        if not any(spec.hit_policy is HitPolicy.ALL_PAGES for spec in pools):
            raise InvalidArgumentError(
                "at least one pool must use HitPolicy.ALL_PAGES (the KV pool, e.g. PoolSpec('kv')): "
                "it bounds the restorable prefix"
            )
        self._scopes: dict[str, KeyScope] = {}
        for spec in pools:
            try:
                self._scopes[spec.name] = (spec.scope or scope).with_part(spec.name)
            except InvalidKeyError as exc:
                raise InvalidArgumentError(f"pool name {spec.name!r} is not a valid key part: {exc.message}") from exc
        self.store = store
        self.scope = scope
        self.pools: dict[str, PoolSpec] = {spec.name: spec for spec in pools}

    def keys(self, pool: str, page_hashes: Sequence[str]) -> list[PageKey]:
        """Pool ``pool``'s key for each page hash."""
        scope = self._scopes.get(pool)
        if scope is None:
            raise InvalidArgumentError(f"unknown pool {pool!r}; this store holds {', '.join(map(repr, self.pools))}")
        if isinstance(page_hashes, (str, bytes)):
            raise InvalidArgumentError("page_hashes must be a sequence of hex page hashes (wrap a single hash in a list)")
        return scope.keys(page_hashes)

    def usable_pages(self, page_hashes: Sequence[str]) -> int:
        """The longest prefix of ``page_hashes`` (in pages) every pool can restore.

        :meth:`restorable_pages` from the first page, except that a
        :class:`~hicache_storage.errors.StorageError` that is not permanent (temporary, or
        persistent once retries gave up) counts as nothing present: it is logged and the answer
        is 0; a permanent one is raised.
        """
        if isinstance(page_hashes, (str, bytes)):
            raise InvalidArgumentError("page_hashes must be a sequence of hex page hashes (wrap a single hash in a list)")
        try:
            return self.restorable_pages(page_hashes)
        except StorageError as exc:
            if exc.status is ErrorStatus.PERMANENT:
                raise
            logger.warning("hicache_storage: multi-pool lookup of %d pages failed, reporting no hit: %s", len(page_hashes), exc)
            return 0

    def restorable_pages(self, page_hashes: Sequence[str], held: int = 0) -> int:
        """The longest cut of ``page_hashes`` (in pages, at least ``held``) every pool accepts,
        for a caller that already holds every pool's state of the first ``held`` pages' prefix
        except what trailing pools need at a later cut.

        ``lookup(page_hashes, held).longest``, asked with fewer keys: each TRAILING_PAGES pool is
        first asked only for the window before the cut the ALL_PAGES pools leave (the common
        case: every pool holds the whole prefix), and the full :meth:`lookup` queries follow only
        if one lacks it. Returns ``held`` when no longer cut is accepted. Errors raise (the core decides what a
        failed lookup means).
        """
        return self._cuts(page_hashes, held, degrade=False, longest_only=True).longest

    def lookup(self, page_hashes: Sequence[str], held: int = 0, *, degrade: bool = False) -> PoolCuts:
        """Every cut of ``page_hashes`` longer than ``held`` that all pools accept, and each pool's
        own longest accepted cut (see :class:`PoolCuts`).

        Asks the ALL_PAGES pools with ``prefix_exists`` from page ``held`` on, each over the
        prefix the previous ones left, then each TRAILING_PAGES pool with one ``exists`` over the
        pages its window can reach (from ``held - trailing_pages``) up to the longest cut the
        pools before it accept. Stops asking once no cut longer than ``held`` is left.

        Errors raise, unless ``degrade``: then a :class:`~hicache_storage.errors.StorageError`
        that is not permanent is logged and counts as that pool holding none of the pages asked
        (so nothing past ``held`` is restorable); a permanent one still raises.
        """
        return self._cuts(page_hashes, held, degrade=degrade, longest_only=False)

    def _cuts(self, page_hashes: Sequence[str], held: int, *, degrade: bool, longest_only: bool) -> PoolCuts:
        """:meth:`lookup`; with ``longest_only``, the TRAILING_PAGES pools are first asked only for
        the window before the cut the ALL_PAGES pools leave (a few keys each, not every page back
        to ``held``): when all hold it, that cut is the longest and the answer is ``PoolCuts(held,
        (cut,), hits)`` without the other cuts; otherwise the full lookup goes on from there."""
        if isinstance(page_hashes, (str, bytes)):
            raise InvalidArgumentError("page_hashes must be a sequence of hex page hashes (wrap a single hash in a list)")
        hashes = list(page_hashes)
        if not 0 <= held <= len(hashes):
            raise InvalidArgumentError(f"held must lie in [0, {len(hashes)}] (pages of page_hashes); got {held}")
        hits: dict[str, int] = {}
        bound: int | None = None  # the cut the first pool left: a pool asked up to it has a verdict
        limit = len(hashes)
        for spec in self._by_policy(HitPolicy.ALL_PAGES):
            if limit == held:
                return PoolCuts(held, (), hits)
            asked = hashes[held:limit]
            found = self._ask(spec, degrade, len(asked), lambda: self.store.prefix_exists(self.keys(spec.name, asked)))
            reach, limit = limit, held + (found or 0)
            if bound is None:
                bound = reach = limit
            if reach == bound:
                hits[spec.name] = limit
        trailing = self._by_policy(HitPolicy.TRAILING_PAGES)
        if longest_only and trailing and limit > held and all(self._holds_window(spec, hashes, limit, degrade) for spec in trailing):
            return PoolCuts(held, (limit,), hits)
        accepted = [True] * (limit + 1)
        for spec in trailing:
            if limit == held:
                return PoolCuts(held, (), hits)
            first = max(0, held - spec.trailing_pages)
            asked = hashes[first:limit]
            present = self._ask(spec, degrade, len(asked), lambda: self.store.exists(self.keys(spec.name, asked)))
            own = spec.accepted_cuts([False] * first + (present or [False] * len(asked)))
            if limit == bound:
                hits[spec.name] = max(c for c in range(held, limit + 1) if c == held or own[c])
            accepted = [a and b for a, b in zip(accepted, own)]
            limit = max([held] + [c for c in range(held, limit + 1) if accepted[c]])
            accepted = accepted[: limit + 1]
        return PoolCuts(held, tuple(c for c in range(held + 1, limit + 1) if accepted[c]), hits)

    def _holds_window(self, spec: PoolSpec, hashes: list[str], cut: int, degrade: bool) -> bool:
        """Whether TRAILING_PAGES pool ``spec`` accepts ``cut``: it holds the pages before it that its window reads."""
        asked = hashes[max(0, cut - spec.trailing_pages) : cut]
        if not asked:
            return True
        found = self._ask(spec, degrade, len(asked), lambda: self.store.exists(self.keys(spec.name, asked)))
        return found is not None and all(found)

    def _ask(self, spec: PoolSpec, degrade: bool, pages: int, query: Callable[[], T]) -> T | None:
        """``query()``; with ``degrade``, ``None`` for a StorageError that is not permanent (logged)."""
        try:
            return query()
        except StorageError as exc:
            if not degrade or exc.status is ErrorStatus.PERMANENT:
                raise
            logger.warning(
                "hicache_storage: exists query for pool %s (%d pages) failed, counting them as misses: %s", spec.name, pages, exc
            )
            return None

    def presence(self, page_hashes: Sequence[str]) -> dict[str, list[bool]]:
        """Every pool's per-page presence over all of ``page_hashes`` (no shortcuts; errors raise)."""
        return {name: self.store.exists(self.keys(name, page_hashes)) for name in self.pools}

    def put(self, pool: str, page_hashes: Sequence[str], buffers: Sequence[BufferLike | Sequence[BufferLike]]) -> list[bool]:
        """Store each page of ``pool`` from its buffer(s) (``Store.put_from``, per key)."""
        return self.store.put_from(self.keys(pool, page_hashes), buffers)

    def get_into(self, pool: str, page_hashes: Sequence[str], buffers: Sequence[BufferLike | Sequence[BufferLike]]) -> list[bool]:
        """Read each page of ``pool`` into its buffer(s) (``Store.get_into``, per key)."""
        return self.store.get_into(self.keys(pool, page_hashes), buffers)

    def _by_policy(self, policy: HitPolicy) -> list[PoolSpec]:
        return [spec for spec in self.pools.values() if spec.hit_policy is policy]

    def __repr__(self) -> str:
        pools = [
            spec.name if spec.hit_policy is HitPolicy.ALL_PAGES else f"{spec.name}[last {spec.trailing_pages}]"
            for spec in self.pools.values()
        ]
        return f"<MultiPoolStore {self.store.name!r} pools={pools}>"
