"""The part s3 and fsspec share: a store that takes one call per page, run over a thread pool.

Object stores and file systems behind fsspec have no batch call, so a batch is one call per key on
the connector's pool (:func:`~hicache_storage.batching.map_outcomes`): every call of a batch runs
to its end before the first failure is raised as a typed error, so no call still touches a
caller's buffer once the batch has returned. A key named twice in one put is written once, with
its last value (:func:`~hicache_storage.batching.write_last_positions`): parallel writes of one
key would race.

A subclass sets ``self._pool`` and gives the four per-key calls and its error translation.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NoReturn, TypeVar

from hicache_storage.batching import map_outcomes, write_last_positions
from hicache_storage.buffers import Segments
from hicache_storage.connector import Connector
from hicache_storage.errors import StorageError
from hicache_storage.keys import PageKey

T = TypeVar("T")


class PerKeyConnector(Connector):
    """Hooks over one call per key; see the module docstring."""

    _pool: ThreadPoolExecutor

    @abstractmethod
    def _exists_one(self, key: PageKey) -> bool: ...

    @abstractmethod
    def _get_one(self, key: PageKey, target: Segments) -> bool: ...

    @abstractmethod
    def _put_one(self, key: PageKey, source: Segments) -> bool: ...

    @abstractmethod
    def _delete_one(self, key: PageKey) -> bool: ...

    @abstractmethod
    def _translate(self, exc: BaseException) -> StorageError | None:
        """``exc`` (from the client library) as a typed error, or ``None`` if it is of no known kind."""

    # --- hooks --------------------------------------------------------------------------------

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        return self._each(keys, self._exists_one, "exists")

    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        return self._each(list(zip(keys, targets)), lambda item: self._get_one(*item), "get", keys)

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        return write_last_positions(
            keys,
            lambda written: self._each(
                [(keys[i], sources[i]) for i in written], lambda item: self._put_one(*item), "put", [keys[i] for i in written]
            ),
        )

    def _delete(self, keys: list[PageKey]) -> list[bool]:
        return self._each(keys, self._delete_one, "delete")

    # --- batches and errors -------------------------------------------------------------------

    def _each(self, items: Sequence[T], fn: Callable[[T], bool], operation: str, keys: Sequence[PageKey] | None = None) -> list[bool]:
        """``fn`` on every item, on the pool; the first failure is raised as a typed error naming its key."""
        outcomes = map_outcomes(self._pool, fn, items)
        for index, (_, error) in enumerate(outcomes):
            if error is not None:
                key = keys[index] if keys is not None else items[index]
                self._raise(error, operation, key if isinstance(key, PageKey) else None)
        return [bool(result) for result, _ in outcomes]

    def _raise(self, exc: BaseException, operation: str, key: PageKey | None = None) -> NoReturn:
        """Raise ``exc`` as a typed StorageError; an exception of no known kind (a bug) as is."""
        if isinstance(exc, StorageError):
            raise exc.with_context(backend=self.name, operation=operation, key=key)
        mapped = self._translate(exc)
        if mapped is None:
            raise exc
        raise mapped.with_context(backend=self.name, operation=operation, key=key) from None
