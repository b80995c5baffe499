"""Per-call timeout: a hanging store cannot block a caller for longer than ``seconds``.

How a call runs
---------------
Each hook call (one batch chunk) runs on a worker thread while the caller waits for it at most
``seconds``. If it has not finished by then the caller gets a
:class:`~hicache_storage.errors.StorageTimeoutError` (retryable) and the inner call is
*abandoned*: left to finish on its own, its result discarded. A call whose caller gave up before
a worker started it is dropped, never run late.

Hung calls are set aside, boundedly
-----------------------------------
At most ``workers`` calls hold a worker slot. When a caller times out, its call gives the slot
back and a replacement worker may start, so a store that hangs on some calls keeps serving the
others, and serves everything again once it recovers, without waiting for the hung calls to
return. Python cannot stop a thread, so an abandoned call keeps its thread until it returns; at
most ``max_abandoned`` calls are set aside like this. Beyond that bound a timed-out call keeps its
slot until it returns, or until a set-aside call returns and it takes that place. A new call that
finds no free slot then fails at once (``timeout_busy``, "appears hung") instead of waiting; one
that finds every slot busy with calls still in time (load, not a hang) waits for a slot at most
``seconds``, then times out too (``timeout_busy``).

So the layer has at most ``workers + max_abandoned`` threads. When an abandoned call returns,
its thread rejoins the pool if the pool is short of ``workers`` free-running threads, and
otherwise exits. Threads are daemons: a store that never answers cannot keep the process from
exiting. ``in_flight`` counts calls queued or running, abandoned ones included.

Caller buffers: two modes (the correctness-critical part)
---------------------------------------------------------
An abandoned read or write may still complete. If it held the caller's buffers it would write a
page into host memory the caller has already reused for something else (reads), or store bytes
the caller has since overwritten (writes). The mode decides who prevents that.

**Staging (the default): the layer does**, for any caller, including one that reuses its
buffers the moment a call returns, as every caller of a plain backend may. The inner backend
never sees caller memory:

* **reads** go into a private staging buffer owned by the call; only the *caller's* thread copies
  staged pages into the caller's segments, and only after the inner call finished in time. A late
  completion writes into the staging buffer, which nobody reads any more.
* **writes** copy the caller's segments into a private staging buffer before the call is handed
  to a worker; the inner backend reads only that copy, so a write that lands late stores exactly
  the bytes the caller passed, never what the caller wrote into its buffer afterwards.

Staging buffers are reused between calls (up to ``staging_cache_bytes`` kept), and a buffer goes
back for reuse only when both its caller and its worker are done with it: a late completion still
owns its buffer until the inner call returns, so no later call's data can be overwritten either.
A new buffer of 1 MiB or more is not zero-filled first: it is an anonymous mapping, whose pages
the kernel supplies on first touch, so filling it is the only pass over it. Nothing can read what
it held before: a write's staging is overwritten in full by the copy in, and a read's staged page
reaches the caller only when the inner call reported it found in time, that is, filled it (a
reused buffer holds an earlier call's bytes just the same).

The price is one memory copy per page in each direction, so in this mode the layer declares
neither ``zero_copy_read`` nor ``zero_copy_write``, and neither passes ``register_buffer`` on nor
declares ``buffer_registration``: the inner backend never sees the caller's memory, so
registering (pinning) it there would cost and never help.

**Zero-copy (``zero_copy: true``): the caller does.** The inner backend reads and writes the
caller's buffers directly, with no staging and no copy; the layer keeps the inner backend's
``zero_copy_read``, ``zero_copy_write`` and ``buffer_registration``, and passes
``register_buffer`` on, bounded like any call (a registration that outlasts ``seconds``, pinning a
large pool, goes on after its caller was told it timed out; registered memory must outlive the
store anyway). In exchange, the
:class:`~hicache_storage.errors.StorageTimeoutError` of a read or write whose inner call had
started carries ``settled``, an event set when that call has really returned. Until then the
store may still write into the read's targets or read the write's sources, so the caller must
leave them untouched: not reuse, free, or lend them to anyone. ``error.when_settled(callback)``
runs ``callback`` once that is so (at once if it already is). ``settled`` is ``None`` where
nothing can touch the buffers any more: the call got no worker, or was dropped before one
started it. Turn this mode on only for callers that keep the contract; the HiCache core does, by
keeping a timed-out call's host pages pinned until it settles.

Stacking: every layer between a zero-copy timeout and the caller that keeps the contract must keep
it too. The retry layer does not (it catches the timeout and retries into the same buffers, or
returns them to its caller, while the abandoned call may still use them), nor does the integrity
layer (its trailer slots go back to its pool when the call fails). With zero-copy, put them below
this one, ``timeout(retry(integrity(store)))``, where every try runs within the one bounded call.
"""

from __future__ import annotations

import enum
import itertools
import logging
import mmap
import threading
import time
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any, TypeVar, Union

import pydantic

from hicache_storage.connector import Level
from hicache_storage.buffers import Segments, fill_segments, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.errors import BackendClosedError, StorageTimeoutError
from hicache_storage.keys import Namespace, PageKey
from hicache_storage.layers.base import Layer

log = logging.getLogger(__name__)

T = TypeVar("T")
StagingBuffer = Union[bytearray, mmap.mmap]

#: Staging buffers from this size are anonymous mappings, not zero-filled bytearrays.
_MAPPED_FROM_BYTES = 2**20


class TimeoutConfig(BackendConfig):
    seconds: float = pydantic.Field(5.0, gt=0, description="longest a caller waits for one call (one batch), in seconds")
    clear_seconds: float | None = pydantic.Field(
        None, gt=0, description="longest a caller waits for clear(), which may scan the store; omit to use seconds"
    )
    workers: int = pydantic.Field(
        8,
        ge=1,
        le=1024,
        description="worker slots: the most calls running at once, besides those set aside after a timeout",
    )
    max_abandoned: int | None = pydantic.Field(
        None,
        ge=0,
        description="the most calls set aside after their callers timed out, each keeping a thread until the store "
        "returns; beyond it calls fail fast while no worker is free. Omit for 4 x workers",
    )
    zero_copy: bool = pydantic.Field(
        False,
        description="hand the caller's buffers to the store (no staging copy); the caller must then leave a timed-out "
        "read's or write's buffers untouched until its error's 'settled' is set (see the module docstring)",
    )
    staging_cache_bytes: int = pydantic.Field(
        256 * 2**20, ge=0, description="staging memory kept for reuse between calls, in bytes; 0 allocates per call"
    )


class _Staging:
    """A private buffer lent to one call, viewed as one segment per page.

    Two references, the caller's and the job's; it returns to the pool when both are released,
    so a buffer a late inner call still writes into is never lent to anyone else.
    """

    def __init__(self, pool: _StagingPool, buffer: StagingBuffer, sizes: list[int]) -> None:
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
        self._free: list[StagingBuffer] = []
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
        return _Staging(self, buffer if buffer is not None else _new_buffer(total), sizes)

    def give_back(self, buffer: StagingBuffer) -> None:
        with self.lock:
            if len(buffer) and self._free_bytes + len(buffer) <= self._limit:
                self._free.append(buffer)
                self._free_bytes += len(buffer)


def _new_buffer(size: int) -> StagingBuffer:
    """A buffer of ``size`` bytes that is not zero-filled in user space (module docstring: Staging)."""
    if size >= _MAPPED_FROM_BYTES:
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    return bytearray(size)


class _Phase(enum.Enum):
    QUEUED = "queued"  # handed to the workers, not started
    RUNNING = "running"
    DONE = "done"  # the inner call returned
    DROPPED = "dropped"  # its caller gave up before a worker started it: never runs


class _Job:
    """One inner call handed to a worker; its phase and flags change only under the layer's lock."""

    __slots__ = ("fn", "staging", "phase", "timed_out", "holds_slot", "settled", "result", "error")

    def __init__(self, fn: Callable[[], Any], staging: _Staging | None) -> None:
        self.fn = fn
        self.staging = staging
        self.phase = _Phase.QUEUED
        self.timed_out = False  # its caller gave up waiting
        self.holds_slot = True  # False once abandoned: it no longer counts against ``workers``
        self.settled = StorageTimeoutError.Settled()  # set once the call returned, or when dropped
        self.result: Any = None
        self.error: BaseException | None = None


class TimeoutLayer(Layer):
    """Bounds every call's wait to ``seconds``; see the module docstring for the guarantees."""

    kind = "timeout"
    Config = TimeoutConfig
    extra_stats = ("timeouts", "timeout_busy", "timeout_late_completions")
    config: TimeoutConfig

    def __init__(self, inner: Level, config: TimeoutConfig | dict[str, Any] | str | None = None) -> None:
        super().__init__(inner, config)
        workers = self.config.workers
        #: The most abandoned calls set aside at once (``max_abandoned``, or 4 x ``workers``).
        self.max_abandoned = 4 * workers if self.config.max_abandoned is None else self.config.max_abandoned
        self._queue: SimpleQueue[_Job | None] = SimpleQueue()
        # One lock for the counts below and every job's phase, so each transition is one step.
        self._lock = threading.Condition()
        self._live = 0  # jobs holding a worker slot: queued, running, or overdue
        self._abandoned = 0  # timed-out jobs still running that gave their slot back
        self._overdue: list[_Job] = []  # timed-out jobs still running that kept their slot (bound reached)
        self._threads = 0  # worker threads started and not yet leaving
        self._in_flight = 0  # jobs queued or running
        self._closing = False  # close() began: no new calls
        self._close_when_idle = False  # close() left the inner close to the last call to return
        self._thread_numbers = itertools.count()
        self._staging = _StagingPool(self.config.staging_cache_bytes)

    def adjust_capabilities(self, inner: Capabilities) -> Capabilities:
        if self.config.zero_copy:
            return inner.replace(bounded_calls=True)
        return inner.replace(zero_copy_read=False, zero_copy_write=False, buffer_registration=False, bounded_calls=True)

    # --- hooks --------------------------------------------------------------------------------

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        return self._call("exists", lambda: super(TimeoutLayer, self)._exists(keys))

    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        if self.config.zero_copy:
            return self._call("get", lambda: super(TimeoutLayer, self)._get_into(keys, targets), lends_buffers=True)
        staging = self._staging.lend(targets)
        try:
            staged = staging.pages
            results = self._call("get", lambda: super(TimeoutLayer, self)._get_into(keys, staged), staging=staging)
            # Only here, on the caller's thread and after an in-time finish, do caller buffers change.
            for hit, target, stage in zip(results, targets, staged):
                if hit:
                    fill_segments(target, stage[0])
            return results
        finally:
            staging.release()

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        if self.config.zero_copy:
            return self._call("put", lambda: super(TimeoutLayer, self)._put_from(keys, sources), lends_buffers=True)
        staging = self._staging.lend(sources)
        try:
            staged = staging.pages
            for source, stage in zip(sources, staged):
                offset = 0
                for view in source:
                    stage[0][offset : offset + view.nbytes] = view
                    offset += view.nbytes
            return self._call("put", lambda: super(TimeoutLayer, self)._put_from(keys, staged), staging=staging)
        finally:
            staging.release()

    def _delete(self, keys: list[PageKey]) -> list[bool]:
        return self._call("delete", lambda: super(TimeoutLayer, self)._delete(keys))

    def _clear(self, namespace: Namespace) -> None:
        seconds = self.config.clear_seconds or self.config.seconds
        self._call("clear", lambda: super(TimeoutLayer, self)._clear(namespace), seconds)

    def _register_buffer(self, view: memoryview) -> None:
        """Passed on in zero-copy mode only: with staging the inner backend never sees caller memory."""
        if self.config.zero_copy:
            self._call("register_buffer", lambda: super(TimeoutLayer, self)._register_buffer(view))

    def _close(self) -> None:
        """Close the inner backend once no call runs in it, then let idle workers exit.

        The inner backend is never closed under a running call: a client library may free what a
        call still uses (Mooncake's does: a segmentation fault). New calls are refused from here
        on; calls still running get ``seconds`` to return. If some do not (a hung store), the
        close is left to the worker whose call returns last (logged). An inner close that does
        not finish in ``seconds`` is left running on its worker (logged); workers stuck in hung
        calls exit when those calls return.
        """
        with self._lock:
            self._closing = True  # no new call from here on (``_call`` refuses them)
            idle = self._lock.wait_for(lambda: self._in_flight == 0, self.config.seconds)
            self._close_when_idle = not idle
            running = self._in_flight
        try:
            if idle:
                self._call("close", self.inner.close, closing=True)
            else:
                log.warning(
                    "%s: %d calls still running after %gs; the inner backend is closed when the last returns",
                    self.name, running, self.config.seconds,
                )
        except StorageTimeoutError as exc:
            log.warning("closing %s did not finish in time; leaving it to a worker thread: %s", self.inner.name, exc)
        finally:
            with self._lock:
                threads = self._threads
            for _ in range(threads):
                self._queue.put(None)

    # --- introspection ------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Inner calls queued or not returned yet, including those whose callers timed out."""
        with self._lock:
            return self._in_flight

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no inner call is in flight; ``False`` if ``timeout`` passed first."""
        with self._lock:
            return self._lock.wait_for(lambda: self._in_flight == 0, timeout)

    # --- the runner ---------------------------------------------------------------------------

    def _call(
        self,
        operation: str,
        fn: Callable[[], T],
        seconds: float | None = None,
        staging: _Staging | None = None,
        lends_buffers: bool = False,
        closing: bool = False,
    ) -> T:
        """Run ``fn`` on a worker and wait for it at most ``seconds`` in all.

        ``staging`` goes with the job: the job's reference is released when ``fn`` returns (or
        when the job is dropped or never made); the caller releases its own after using the
        results. ``lends_buffers``: ``fn`` uses the caller's buffers, so a timeout after it
        started carries ``settled``. ``closing``: ``fn`` is the inner close, the one call
        admitted once closing began.
        """
        seconds = self.config.seconds if seconds is None else seconds
        deadline = time.monotonic() + seconds
        try:
            self._take_slot(operation, seconds, closing)
        except StorageTimeoutError:
            if staging is not None:
                staging.release()  # the job that would have held it never existed
            raise
        job = _Job(fn, staging)
        with self._lock:
            missing = self._threads_missing()
        self._start_threads(missing)
        self._queue.put(job)
        job.settled.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            phase = job.phase
            close_now = False
            if phase is _Phase.QUEUED:
                job.phase = _Phase.DROPPED
                self._live -= 1
                close_now = self._one_less_in_flight()
                self._lock.notify_all()
            elif phase is _Phase.RUNNING:
                job.timed_out = True
                if self._abandoned < self.max_abandoned:
                    self._abandon(job)
                else:
                    self._overdue.append(job)
        if close_now:
            self._close_inner_late()
        if phase is _Phase.DONE:
            if job.error is not None:
                error, job.error = job.error, None  # drop the job's reference: no traceback cycle
                raise error
            return job.result
        self._count(timeouts=1)
        if phase is _Phase.QUEUED:
            del job.fn  # it will never run: the worker that finds it skips it
            if staging is not None:
                staging.release()  # the job's reference
            job.settled.set()
        raise StorageTimeoutError(
            f"{self.inner.name} did not answer within {seconds:g}s",
            backend=self.name,
            operation=operation,
            settled=job.settled if lends_buffers and phase is _Phase.RUNNING else None,
        )

    def _take_slot(self, operation: str, seconds: float, closing: bool = False) -> None:
        """Take a worker slot, waiting at most ``seconds``, or none at all while the store appears hung.

        The slot counts the call as in flight at once, so :meth:`_close` never misses it.
        """
        workers = self.config.workers
        with self._lock:
            def refused() -> bool:
                return self._closing and not closing

            self._lock.wait_for(lambda: refused() or self._live < workers or bool(self._overdue), seconds)
            if refused():
                raise BackendClosedError("backend is closed", backend=self.name, operation=operation)
            if self._live < workers:
                self._live += 1
                self._in_flight += 1
                return
            abandoned, overdue = self._abandoned, len(self._overdue)
        self._count(timeout_busy=1, timeouts=1)
        if overdue:
            raise StorageTimeoutError(
                f"{self.inner.name} appears hung: {abandoned + overdue} calls have not returned after their callers "
                f"timed out ({abandoned} set aside, the most max_abandoned={self.max_abandoned} allows, and {overdue} "
                f"holding workers), and no worker of {workers} is free; calls fail at once until some return. "
                "Fix or restart the store, or raise the timeout's 'max_abandoned' to set more hung calls aside",
                backend=self.name,
                operation=operation,
            )
        raise StorageTimeoutError(
            f"no worker became free within {seconds:g}s: all {workers} workers are busy with calls to "
            f"{self.inner.name} still in time; raise the timeout's 'workers' if this is load, not a hang",
            backend=self.name,
            operation=operation,
        )

    def _abandon(self, job: _Job) -> None:
        """Set a running, timed-out job aside: its slot is free for new calls (lock held)."""
        job.holds_slot = False
        self._live -= 1
        self._abandoned += 1
        self._lock.notify_all()

    def _threads_missing(self) -> int:
        """How many threads to start so that ``workers`` run besides those in abandoned calls.

        Called with the lock held; counts them as started at once.
        """
        missing = self.config.workers + self._abandoned - self._threads
        if missing <= 0:
            return 0
        self._threads += missing
        return missing

    def _start_threads(self, count: int) -> None:
        for _ in range(count):
            number = next(self._thread_numbers)
            threading.Thread(target=self._work, name=f"hicache-{self.name}-{number}", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                with self._lock:
                    self._threads -= 1
                return
            with self._lock:
                if job.phase is _Phase.DROPPED:  # its caller gave up before we started: never run it late
                    continue
                job.phase = _Phase.RUNNING
            try:
                job.result = job.fn()
            except BaseException as exc:  # handed to the caller, who re-raises it
                job.error = exc
            del job.fn  # its closure holds the caller's buffers: keep no reference past the call
            if self._finish(job):
                return

    def _finish(self, job: _Job) -> bool:
        """Account for a returned job and settle it; ``True`` if this thread should exit."""
        leave = False
        with self._lock:
            job.phase = _Phase.DONE
            close_now = self._one_less_in_flight()
            if job.holds_slot:
                self._live -= 1
                if job.timed_out:
                    self._overdue.remove(job)
            else:
                self._abandoned -= 1
                if self._overdue:  # the longest overdue call is set aside in this one's place
                    self._abandon(self._overdue.pop(0))
                elif self._closing or self._threads > self.config.workers + self._abandoned:
                    self._threads -= 1
                    leave = True
            self._lock.notify_all()
        staging, job.staging = job.staging, None
        if staging is not None:
            staging.release()
        if job.timed_out:  # read after DONE, when nothing changes it any more
            self._count(timeout_late_completions=1)
            job.result = job.error = None
        job.settled.set()
        if close_now:
            self._close_inner_late()
        return leave

    def _one_less_in_flight(self) -> bool:
        """Count a call out (lock held); ``True`` if it was the last and the inner close waits for it."""
        self._in_flight -= 1
        if self._close_when_idle and self._in_flight == 0:
            self._close_when_idle = False
            return True
        return False

    def _close_inner_late(self) -> None:
        """The inner close :meth:`_close` left to the call that returned last (this thread's)."""
        try:
            self.inner.close()
        except Exception:  # nobody waits for it any more: say so, never raise into a worker
            log.exception("closing %s after its last running call returned failed", self.inner.name)
        else:
            log.info("%s closed after its last running call returned", self.inner.name)
