"""Background threads and how the scheduler hears from them: :class:`OpThread` serves a queue of
operations in order (the backup and the prefetch threads); :class:`Wakeup` tells the scheduler
that one finished."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

Op = TypeVar("Op")


class Wakeup:
    """Wakes the scheduler when background work it waits on has finished (a prefetch or backup
    op, a batch of reads, a copy, a load), instead of at its next poll.

    The scheduler waits here between steps while its device is busy or nothing can start: for
    at most ``timeout`` (what nothing notifies, such as a CUDA copy or a timer, is still seen
    that late), and no longer once notified. Polling every 0.5 ms instead, the scheduler of a
    5.5 s long-history run at the H200 point (file store) took 7,000 steps and 0.81 s of the
    2-core bench machine's CPU, which the copies and the store's client needed: 2,900 steps and
    0.58 s now. Eight runs each alternated, 5.46 s -> 5.30 s (a fixed 2 ms poll: 3% faster,
    8 of 8, and 5 ms no faster than 2 ms: a finished read or copy must be acted on at once);
    the default compute, the recurrent shape and S3 at the L4 point unchanged (3-6 runs each).

    A notice that lands while the scheduler is awake is not lost: the scheduler reads the state
    it reports (``poll``) after ``wait`` has cleared it."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def notify(self) -> None:
        self._event.set()

    def wait(self, timeout: float) -> None:
        """Until notified (or at once, if notified since the last wait), at most ``timeout`` seconds."""
        self._event.wait(timeout)
        self._event.clear()


class OpThread(Generic[Op]):
    """Runs ``serve(op)`` on its own thread for every op ``put``, in order, and notifies
    ``wakeup`` after each. ``serve`` must not raise (an exception would end the thread).
    ``stop`` lets the queued ops finish first."""

    def __init__(self, name: str, wakeup: Wakeup | None = None) -> None:
        self.name = name
        self.wakeup = wakeup
        self._queue: queue.SimpleQueue[Op | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, serve: Callable[[Op], None]) -> None:
        self._thread = threading.Thread(target=self._loop, args=(serve,), name=self.name, daemon=True)
        self._thread.start()

    def put(self, op: Op) -> None:
        self._queue.put(op)

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self, serve: Callable[[Op], None]) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            serve(op)
            if self.wakeup is not None:
                self.wakeup.notify()
