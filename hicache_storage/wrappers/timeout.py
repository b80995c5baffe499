"""Per-call timeout: a hanging store cannot block a caller for longer than ``seconds``.

How a call runs
---------------
Each hook call (one batch chunk) runs on one of ``workers`` daemon threads while the caller waits
for it at most ``seconds``. If it has not finished by then the caller gets a
:class:`~hicache_storage.errors.StorageTimeoutError` (retryable) and the worker is left to finish
the inner call on its own; its result is discarded.

Bounded threads
---------------
The wrapper never has more than ``workers`` threads. A call first takes a worker slot, and a slot
is given back only when the inner call really returns, not when its caller gives up. So when
every worker is stuck in a hung store, new calls do not queue up behind them: they wait for a
slot for at most ``seconds`` and then time out too (counted as ``timeout_busy``). A call that
got a slot but whose caller timed out before a worker picked it up is dropped, never run late.
Threads are daemons, so a store that never answers cannot keep the process from exiting.

Caller buffers are never touched late (the correctness-critical part)
---------------------------------------------------------------------
Python cannot cancel a running call, so an inner call that times out may still complete later.
If it held the caller's buffers it would write a page into host memory the caller has already
reused for something else (reads), or store bytes the caller has since overwritten (writes).
So the inner backend never sees caller memory:

* **reads** go into a private staging buffer owned by the call; only the *caller's* thread copies
  staged pages into the caller's segments, and only after the inner call finished in time. A late
  completion writes into the staging buffer, which nobody reads any more.
* **writes** copy the caller's segments into a private staging buffer before the call is handed
  to a worker; the inner backend reads only that copy, so a write that lands late stores exactly
  the bytes the caller passed, never what the caller wrote into its buffer afterwards.

Staging buffers are reused between calls (up to ``staging_cache_bytes`` kept), and a buffer goes
back for reuse only when both its caller and its worker are done with it: a late completion still
owns its buffer until the inner call returns, so no later call's data can be overwritten either.

The price is one memory copy per page in each direction, so this wrapper declares neither
``zero_copy_read`` nor ``zero_copy_write``. For the same reason it does not pass
``register_buffer`` on and declares no ``buffer_registration``: the inner backend never sees the
caller's memory, so registering (pinning) it there would cost and never help. A store whose own
client enforces deadlines and moves pages zero-copy from registered memory (Mooncake) keeps
that path only without this wrapper.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any, TypeVar

import pydantic

from hicache_storage.backend import StorageBackend
from hicache_storage.buffers import Segments, fill_segments, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.errors import StorageTimeoutError
from hicache_storage.keys import Namespace, PageKey
from hicache_storage.wrappers.base import BackendWrapper

log = logging.getLogger(__name__)

T = TypeVar("T")


class TimeoutConfig(BackendConfig):
    seconds: float = pydantic.Field(5.0, gt=0, description="longest a caller waits for one call (one batch), in seconds")
    clear_seconds: float | None = pydantic.Field(
        None, gt=0, description="longest a caller waits for clear(), which may scan the store; omit to use seconds"
    )
    workers: int = pydantic.Field(
        8, ge=1, le=1024, description="worker threads, the most calls in flight (hung ones included)"
    )
    staging_cache_bytes: int = pydantic.Field(
        256 * 2**20, ge=0, description="staging memory kept for reuse between calls, in bytes; 0 allocates per call"
    )


class _Staging:
    """A private buffer lent to one call, viewed as one segment per page.

    Two references, the caller's and the job's; it returns to the pool when both are released,
    so a buffer a late inner call still writes into is never lent to anyone else.
    """

    def __init__(self, pool: _StagingPool, buffer: bytearray, sizes: list[int]) -> None:
        self._pool, self._buffer, self._refs = pool, buffer, 2
        view, offset = memoryview(buffer), 0
        self.pages: list[Segments] = []
        for size in sizes:
            self.pages.append([view[offset : offset + size]])
            offset += size

    def release(self) -> None:
        with self._pool.lock:
            self._refs -= 1
            if self._refs:
                return
        self._pool.give_back(self._buffer)


class _StagingPool:
    """Free staging buffers, at most ``limit`` bytes of them; thread-safe."""

    def __init__(self, limit: int) -> None:
        self.lock = threading.Lock()
        self._limit = limit
        self._free: list[bytearray] = []
        self._free_bytes = 0

    def lend(self, pages: list[Segments]) -> _Staging:
        sizes = [segments_size(segments) for segments in pages]
        total = sum(sizes)
        buffer = None
        with self.lock:
            # The smallest free buffer that fits, unless it would waste most of itself. Found by
            # position, never by equality: two free buffers may hold equal bytes.
            fitting = [i for i, b in enumerate(self._free) if total <= len(b) <= 4 * total]
            if fitting:
                buffer = self._free.pop(min(fitting, key=lambda i: len(self._free[i])))
                self._free_bytes -= len(buffer)
        return _Staging(self, buffer if buffer is not None else bytearray(total), sizes)

    def give_back(self, buffer: bytearray) -> None:
        with self.lock:
            if buffer and self._free_bytes + len(buffer) <= self._limit:
                self._free.append(buffer)
                self._free_bytes += len(buffer)


class _Job:
    """One inner call handed to a worker; ``lock`` makes 'finished' and 'abandoned' exclusive."""

    __slots__ = ("fn", "staging", "lock", "done", "abandoned", "result", "error")

    def __init__(self, fn: Callable[[], Any], staging: _Staging | None) -> None:
        self.fn = fn
        self.staging = staging
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.abandoned = False
        self.result: Any = None
        self.error: BaseException | None = None


class TimeoutWrapper(BackendWrapper):
    """Bounds every call's wait to ``seconds``; see the module docstring for the guarantees."""

    kind = "timeout"
    Config = TimeoutConfig
    extra_stats = ("timeouts", "timeout_busy", "timeout_late_completions")
    config: TimeoutConfig

    def __init__(self, inner: StorageBackend, config: TimeoutConfig | dict[str, Any] | str | None = None) -> None:
        super().__init__(inner, config)
        self._slots = threading.BoundedSemaphore(self.config.workers)
        self._queue: SimpleQueue[_Job | None] = SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._threads_lock = threading.Lock()
        self._idle = threading.Condition()
        self._in_flight = 0
        self._staging = _StagingPool(self.config.staging_cache_bytes)

    def adjust_capabilities(self, inner: Capabilities) -> Capabilities:
        return inner.replace(zero_copy_read=False, zero_copy_write=False, buffer_registration=False)

    # --- hooks --------------------------------------------------------------------------------

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        return self._call("exists", lambda: super(TimeoutWrapper, self)._exists(keys))

    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        staging = self._staging.lend(targets)
        try:
            staged = staging.pages
            results = self._call("get", lambda: super(TimeoutWrapper, self)._get_into(keys, staged), staging=staging)
            # Only here, on the caller's thread and after an in-time finish, do caller buffers change.
            for hit, target, stage in zip(results, targets, staged):
                if hit:
                    fill_segments(target, stage[0])
            return results
        finally:
            staging.release()

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        staging = self._staging.lend(sources)
        try:
            staged = staging.pages
            for source, stage in zip(sources, staged):
                offset = 0
                for view in source:
                    stage[0][offset : offset + view.nbytes] = view
                    offset += view.nbytes
            return self._call("put", lambda: super(TimeoutWrapper, self)._put_from(keys, staged), staging=staging)
        finally:
            staging.release()

    def _delete(self, keys: list[PageKey]) -> list[bool]:
        return self._call("delete", lambda: super(TimeoutWrapper, self)._delete(keys))

    def _clear(self, namespace: Namespace) -> None:
        seconds = self.config.clear_seconds or self.config.seconds
        self._call("clear", lambda: super(TimeoutWrapper, self)._clear(namespace), seconds)

    def _register_buffer(self, view: memoryview) -> None:
        """Nothing to do: the inner backend only ever sees staging buffers (module docstring)."""

    def _close(self) -> None:
        """Close the inner backend within ``seconds``, then let idle workers exit.

        If the inner close does not finish in time it is left running on its worker (logged);
        workers stuck in hung calls exit when those calls return.
        """
        try:
            self._call("close", self.inner.close)
        except StorageTimeoutError as exc:
            log.warning("closing %s did not finish in time; leaving it to a worker thread: %s", self.inner.name, exc)
        finally:
            with self._threads_lock:
                for _ in self._threads:
                    self._queue.put(None)

    # --- introspection ------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Inner calls that have not returned yet, including those whose callers timed out."""
        with self._idle:
            return self._in_flight

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no inner call is in flight; ``False`` if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)

    # --- the runner ---------------------------------------------------------------------------

    def _call(self, operation: str, fn: Callable[[], T], seconds: float | None = None, staging: _Staging | None = None) -> T:
        """Run ``fn`` on a worker and wait for it at most ``seconds``; ``staging`` goes with the job.

        The job's reference to ``staging`` is released when ``fn`` returns (or when the job is
        dropped unrun); the caller releases its own after using the results.
        """
        seconds = self.config.seconds if seconds is None else seconds
        deadline = time.monotonic() + seconds
        if not self._slots.acquire(timeout=seconds):
            if staging is not None:
                staging.release()  # the job that would have held it never existed
            self._count(timeout_busy=1, timeouts=1)
            raise StorageTimeoutError(
                f"no worker became free within {seconds:g}s: all {self.config.workers} workers are still waiting "
                f"on calls to {self.inner.name} that have not returned (the store may be hanging); "
                "raise the timeout's 'workers' if this is load, not a hang",
                backend=self.name,
                operation=operation,
            )
        job = _Job(fn, staging)
        with self._idle:
            self._in_flight += 1
        self._start_workers()
        self._queue.put(job)
        job.done.wait(max(0.0, deadline - time.monotonic()))
        with job.lock:
            if not job.done.is_set():
                job.abandoned = True
        if job.abandoned:
            self._count(timeouts=1)
            raise StorageTimeoutError(
                f"{self.inner.name} did not answer within {seconds:g}s",
                backend=self.name,
                operation=operation,
            )
        if job.error is not None:
            error, job.error = job.error, None  # drop the job's reference: no traceback cycle
            raise error
        return job.result  # type: ignore[no-any-return]

    def _start_workers(self) -> None:
        if len(self._threads) == self.config.workers:
            return
        with self._threads_lock:
            while len(self._threads) < self.config.workers:
                thread = threading.Thread(
                    target=self._work, name=f"hicache-{self.name}-{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                with job.lock:
                    skip = job.abandoned  # its caller gave up before we started: never run it late
                if not skip:
                    try:
                        job.result = job.fn()
                    except BaseException as exc:  # handed to the caller, who re-raises it
                        job.error = exc
                    with job.lock:
                        job.done.set()
                        late = job.abandoned
                    if late:
                        self._count(timeout_late_completions=1)
                        job.result = job.error = None
            finally:
                if job.staging is not None:
                    job.staging.release()
                self._slots.release()
                with self._idle:
                    self._in_flight -= 1
                    self._idle.notify_all()

