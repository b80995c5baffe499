"""Run a per-key function over a batch on a thread pool, for connectors whose client has no batch call."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from typing import TypeVar

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
    return [future.result() for future in [pool.submit(_outcome, fn, item) for item in items]]


def _outcome(fn: Callable[[T], R], item: T) -> tuple[R | None, BaseException | None]:
    try:
        return fn(item), None
    except Exception as exc:
        return None, exc


def last_write_positions(keys: Sequence[Hashable]) -> list[int]:
    """For each position, the position of its key's last occurrence in the batch.

    A batch that names a key twice must end with the key's last value (the contract: the last
    write wins). Run in parallel, the writes of one key would race; a connector writes only the
    positions in this list and gives every position its key's last write's result.
    """
    last = {key: i for i, key in enumerate(keys)}
    return [last[key] for key in keys]
