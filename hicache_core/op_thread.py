"""One daemon thread serving a queue of operations in order: the backup and the prefetch thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

Op = TypeVar("Op")


class OpThread(Generic[Op]):
    """Runs ``serve(op)`` on its own thread for every op ``put``, in order. ``serve`` must not
    raise (an exception would end the thread). ``stop`` lets the queued ops finish first."""

    def __init__(self, name: str) -> None:
        self.name = name
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
