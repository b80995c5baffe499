"""Run a per-key function over a batch on a thread pool, for connectors whose client has no batch call."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor, Future, wait
from typing import TypeVar

from hicache_storage.errors import BackendClosedError

T = TypeVar("T")
R = TypeVar("R")


def map_outcomes(pool: Executor, fn: Callable[[T], R], items: Sequence[T]) -> list[tuple[R | None, BaseException | None]]:
    """``(result, None)`` or ``(None, error)`` for every item, in order; every item runs to the end.

    A single item runs on the caller's thread (no hand-off to the pool). The caller decides what
    an error means: connectors raise the first one as a typed error once the whole batch is done,
    so no call is left running against caller buffers after the batch returns.
    """
    if len(items) == 1:
        return [_outcome(fn, items[0])]
    futures: list[Future[tuple[R | None, BaseException | None]]] = []
    try:
        for item in items:
            futures.append(pool.submit(_outcome, fn, item))
    except RuntimeError:  # the pool was shut down by a concurrent close()
        for future in futures:
            future.cancel()
        wait(futures)
        raise BackendClosedError("backend was closed during the call") from None
    return [future.result() for future in futures]


def map_all(pool: Executor, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``fn`` over every item, results in order; once every call has ended, the first error (in item order) is raised.

    Waiting for every call before raising matters: a read must never still be writing into a
    caller's buffer after the caller got an exception back.
    """
    outcomes = map_outcomes(pool, fn, items)
    for _, error in outcomes:
        if error is not None:
            raise error
    return [result for result, _ in outcomes]  # type: ignore[misc]  # no call raised (checked above): each result is an R


def _outcome(fn: Callable[[T], R], item: T) -> tuple[R | None, BaseException | None]:
    try:
        return fn(item), None
    except BaseException as exc:  # noqa: BLE001 - handed back: the caller raises it once every item has ended
        return None, exc


def last_write_positions(keys: Sequence[Hashable]) -> list[int]:
    """For each position, the position of its key's last occurrence in the batch.

    A batch that names a key twice must end with the key's last value (the contract: the last
    write wins). Run in parallel, the writes of one key would race; a connector writes only the
    positions in this list and gives every position its key's last write's result.
    """
    last = {key: i for i, key in enumerate(keys)}
    return [last[key] for key in keys]


def write_last_positions(keys: Sequence[Hashable], write: Callable[[list[int]], list[bool]]) -> list[bool]:
    """Write each key's last position only: ``write(positions)`` (ascending) returns one result
    per position given; every position of the batch gets its key's last write's result."""
    positions = last_write_positions(keys)
    written = sorted(set(positions))
    by_position = dict(zip(written, write(written)))
    return [by_position[p] for p in positions]
