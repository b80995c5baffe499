"""Retries with exponential backoff and full jitter, for temporary errors only.

A call that raises a :class:`~hicache_storage.errors.StorageError` whose status is
``TEMPORARY`` (unavailable, timeout, throttled, by default every
:class:`~hicache_storage.errors.RetryableError`) is tried again after a random pause drawn
uniformly from ``[0, min(cap_seconds, base_seconds * 2**n))`` for the n-th retry ("full jitter":
many clients hit by the same outage spread out instead of retrying in lockstep). It stops after
``attempts`` tries in total, or earlier when the next pause would end past ``deadline_seconds``
from the first try; the last error is then raised with its status set to ``PERSISTENT`` (a
layer further up does not retry it again, and the HiCache core stops calling the store).
Permanent and persistent errors, and anything that is not a ``StorageError``, pass through at
once.

Put ``retry`` outside ``timeout`` (``retry(timeout(store))``): the deadline is checked between
tries, so only a timeout below it bounds how long one try can take.

What retrying means per operation: reads, exists and puts are idempotent (a page key always names
the same bytes). A delete whose first try removed the page but failed to answer reports ``False``
on the retry, as if the page had not been there; ``clear`` is idempotent.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pydantic

from hicache_storage.connector import Level
from hicache_storage.buffers import Segments
from hicache_storage.config import BackendConfig
from hicache_storage.errors import ErrorStatus, StorageError
from hicache_storage.keys import Namespace, PageKey
from hicache_storage.layers.base import OPERATIONS, Layer, Operation

log = logging.getLogger(__name__)

T = TypeVar("T")


class RetryConfig(BackendConfig):
    attempts: int = pydantic.Field(3, ge=1, le=100, description="tries in total, the first included")
    base_seconds: float = pydantic.Field(0.05, gt=0, description="pause bound before the first retry; doubles per retry")
    cap_seconds: float = pydantic.Field(2.0, gt=0, description="largest pause bound between two tries")
    deadline_seconds: float | None = pydantic.Field(
        10.0, gt=0, description="no retry whose pause would end later than this after the first try; omit for none"
    )
    seed: int | None = pydantic.Field(None, description="seed for the jitter, to replay a run; omit for a random one")
    operations: tuple[Operation, ...] = pydantic.Field(
        OPERATIONS, description="operations to retry; others fail at their first error (e.g. leave out put for best-effort backups)"
    )


class RetryLayer(Layer):
    """Retries temporary errors with backoff; thread-safe (each call keeps its own count)."""

    kind = "retry"
    Config = RetryConfig
    extra_stats = ("retries", "retries_exhausted")
    config: RetryConfig

    def __init__(self, inner: Level, config: RetryConfig | dict[str, Any] | str | None = None) -> None:
        super().__init__(inner, config)
        self._rng = random.Random(self.config.seed)
        # Replaceable for tests that check the schedule without sleeping.
        self._sleep: Callable[[float], None] = time.sleep
        self._clock: Callable[[], float] = time.monotonic

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        return self._retrying("exists", lambda: super(RetryLayer, self)._exists(keys))

    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        return self._retrying("get", lambda: super(RetryLayer, self)._get_into(keys, targets))

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        return self._retrying("put", lambda: super(RetryLayer, self)._put_from(keys, sources))

    def _delete(self, keys: list[PageKey]) -> list[bool]:
        return self._retrying("delete", lambda: super(RetryLayer, self)._delete(keys))

    def _clear(self, namespace: Namespace) -> None:
        self._retrying("clear", lambda: super(RetryLayer, self)._clear(namespace))

    def _register_buffer(self, view: memoryview) -> None:
        self._retrying("register_buffer", lambda: super(RetryLayer, self)._register_buffer(view))

    def backoff(self, retry: int) -> float:
        """The pause before retry number ``retry`` (1 for the first retry), with full jitter."""
        bound = min(self.config.cap_seconds, self.config.base_seconds * 2 ** (retry - 1))
        return self._rng.uniform(0.0, bound)

    def _retrying(self, operation: Operation, fn: Callable[[], T]) -> T:
        if operation not in self.config.operations:
            return fn()
        deadline = None if self.config.deadline_seconds is None else self._clock() + self.config.deadline_seconds
        tries = 0
        while True:
            tries += 1
            try:
                return fn()
            except StorageError as exc:
                if exc.status is not ErrorStatus.TEMPORARY:
                    raise
                pause = self.backoff(tries) if tries < self.config.attempts else None
                if pause is None or (deadline is not None and self._clock() + pause > deadline):
                    self._count(retries_exhausted=1)
                    exc.status = ErrorStatus.PERSISTENT
                    if hasattr(exc, "add_note"):  # Python 3.11+
                        exc.add_note(f"{self.name}: gave up after {tries} tr{'y' if tries == 1 else 'ies'}")
                    raise
                self._count(retries=1)
                log.debug("%s %s: %s; retry %d in %.3fs", self.name, operation, exc, tries, pause)
                self._sleep(pause)
