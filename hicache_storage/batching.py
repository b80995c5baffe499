"""Run a per-key function over a batch on a thread pool, for connectors whose client has no batch call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
