"""Fault injection: make any backend misbehave on purpose, reproducibly, to rehearse failures.

Configured per operation (``exists``, ``get``, ``put``, ``delete``, ``clear``,
``register_buffer``), each with its own :class:`FaultSpec`::

    {"kind": "faults", "seed": 7,
     "get": {"corrupt_rate": 0.05, "short_read_rate": 0.05, "hang_rate": 0.01},
     "put": {"error_rate": 0.1, "errors": ["unavailable", "throttled"]}}

What can happen to a call, decided before the inner backend is asked:

* **hang**: the call blocks until :meth:`FaultInjectionLayer.release_hangs` is called, the
  layer is closed, or ``hang_seconds`` pass (``None``: no limit). A timeout layer above must
  bound it; tests release hangs through the event instead of waiting.
* **error**: one of ``errors`` (see :data:`ERROR_KINDS`, e.g. ``unavailable``, ``timeout``,
  ``authentication``, or ``runtime`` for a connector bug that is no ``StorageError``) is raised
  instead of calling the store.
* **latency**: ``latency_seconds`` of sleep before the call.
* **wrong count**: the call returns one result too many or too few (the SDK must reject it).

and, for ``exists``, to each page the store reports as present:

* **vanish**: the page is deleted from the store (through the inner backend's ``delete``) right
  after ``exists`` reported it, so the read that follows finds it gone, as when another client or
  the store's own eviction removes a page between a reader's ``exists`` and its ``get``. Needs an
  inner backend that can delete.

and, for ``get``, to each page the store reports as found:

* **corrupt**: ``corrupt_bytes`` bytes of the page (trailer included, if one is below) are flipped.
* **short read**: only a prefix of the page arrives; the rest of the caller's buffer keeps
  whatever it held before, yet the store reports a hit.

and, for ``put``, to each page (the caller's buffer is never changed; a private copy is):

* **corrupt**: the page is stored with ``corrupt_bytes`` bytes flipped, and reported stored.
* **truncated write**: only a prefix of the page is stored, and reported stored.

These deliver or keep wrong data as a success, which is what the integrity layer turns into
misses: stack faults *below* integrity (``integrity(faults(store))``) to rehearse them.

On and off at runtime: :meth:`FaultInjectionLayer.pause` lets every call through untouched
until :meth:`FaultInjectionLayer.resume` (``"enabled": false`` in the config starts paused), so
one layer can stand for a store that breaks mid-run and recovers. Pausing does not free calls
already hanging: :meth:`FaultInjectionLayer.release_hangs` does.

Replay: call number n of an operation (counting only calls made while enabled) draws its fate from
``Random(f"{seed}:{op}:{n}")``, so a single-threaded run with the same seed and the same calls
replays exactly; with several threads the n-th call of each operation still gets the same fate.
:attr:`events` lists the last ``event_log_size`` faults injected (1,000 by default: the log is
for looking at what happened, and must not grow through a long run); ``stats()`` counts them all.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Annotated, Any

import pydantic

from hicache_storage.connector import Level
from hicache_storage.buffers import Segments, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.errors import (
    AuthenticationError,
    BackendClosedError,
    BackendContractError,
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    InvalidKeyError,
    PermanentError,
    PermissionDeniedError,
    RetryableError,
    StorageError,
    StorageTimeoutError,
    ThrottledError,
    UnsupportedOperationError,
    ValueTooLargeError,
)
from hicache_storage.keys import Namespace, PageKey
from hicache_storage.layers.base import OPERATIONS, Layer, Operation

#: The errors a fault can raise, by the name used in ``errors``.
ERROR_KINDS: dict[str, type[Exception]] = {
    "unavailable": BackendUnavailableError,
    "timeout": StorageTimeoutError,
    "throttled": ThrottledError,
    "retryable": RetryableError,
    "authentication": AuthenticationError,
    "permission": PermissionDeniedError,
    "unsupported": UnsupportedOperationError,
    "value_too_large": ValueTooLargeError,
    "invalid_key": InvalidKeyError,
    "invalid_argument": InvalidArgumentError,
    "capacity": CapacityError,
    "contract": BackendContractError,
    "closed": BackendClosedError,
    "permanent": PermanentError,
    "storage": StorageError,
    "runtime": RuntimeError,
}
#: Page faults and the operations they apply to.
_PAGE_FAULTS = {
    "corrupt_rate": ("get", "put"),
    "short_read_rate": ("get",),
    "truncate_write_rate": ("put",),
    "vanish_rate": ("exists",),
}
_Rate = Annotated[float, pydantic.Field(ge=0.0, le=1.0)]


class FaultSpec(pydantic.BaseModel):
    """The faults of one operation; every rate is a probability per call (per page for get's)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    error_rate: _Rate = 0.0
    errors: list[str] = pydantic.Field(default_factory=lambda: ["unavailable"], min_length=1)
    latency_rate: _Rate = 0.0
    latency_seconds: float = pydantic.Field(0.0, ge=0.0)
    hang_rate: _Rate = 0.0
    hang_seconds: float | None = pydantic.Field(None, gt=0.0)
    wrong_count_rate: _Rate = 0.0
    corrupt_rate: _Rate = 0.0
    corrupt_bytes: int = pydantic.Field(1, ge=1)
    short_read_rate: _Rate = 0.0
    truncate_write_rate: _Rate = 0.0
    vanish_rate: _Rate = 0.0

    @pydantic.model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                raise ValueError(f"unknown fault field(s) {', '.join(unknown)}; valid: {', '.join(sorted(cls.model_fields))}")
        return data

    @pydantic.field_validator("errors")
    @classmethod
    def _known_errors(cls, errors: list[str]) -> list[str]:
        unknown = [e for e in errors if e not in ERROR_KINDS]
        if unknown:
            raise ValueError(f"unknown error kind(s) {', '.join(unknown)}; valid: {', '.join(ERROR_KINDS)}")
        return errors


class FaultsConfig(BackendConfig):
    seed: int = pydantic.Field(0, description="seed that makes a run's faults replayable")
    enabled: bool = pydantic.Field(True, description="inject from the start; false: start paused (see resume())")
    event_log_size: int = pydantic.Field(1000, ge=0, description="how many of the latest fault events `events` keeps")
    exists: FaultSpec = pydantic.Field(default_factory=FaultSpec, description="faults of exists()")
    get: FaultSpec = pydantic.Field(default_factory=FaultSpec, description="faults of reads")
    put: FaultSpec = pydantic.Field(default_factory=FaultSpec, description="faults of writes")
    delete: FaultSpec = pydantic.Field(default_factory=FaultSpec, description="faults of delete()")
    clear: FaultSpec = pydantic.Field(default_factory=FaultSpec, description="faults of clear()")
    register_buffer: FaultSpec = pydantic.Field(default_factory=FaultSpec, description="faults of register_buffer()")

    @pydantic.model_validator(mode="after")
    def _applicable(self) -> FaultsConfig:
        for op in OPERATIONS:
            spec: FaultSpec = getattr(self, op)
            for name, applies in _PAGE_FAULTS.items():
                if getattr(spec, name) and op not in applies:
                    raise ValueError(f"{op}.{name}: this fault applies only to {' and '.join(applies)}")
            if op in ("clear", "register_buffer") and spec.wrong_count_rate:
                raise ValueError(f"{op}.wrong_count_rate: {op} returns no per-key results")
        return self


@dataclass(frozen=True)
class FaultEvent:
    """One injected fault: which operation, its call number, what, and for which page of the batch."""

    operation: str
    call: int
    fault: str
    page: int | None = None
    detail: str = ""


@dataclass
class _Fate:
    call: int
    hang: bool
    error: str | None
    latency: bool
    wrong_count: int  # 0, +1 or -1
    short_cuts: dict[int, float]  # page index -> fraction of the page that arrives or is stored
    corruptions: dict[int, list[tuple[float, int]]]  # page index -> (position fraction, xor byte)
    vanishing: set[int]  # page indices deleted after exists reports them


#: The fate of a call made while the layer is paused: nothing happens to it.
_UNHARMED = _Fate(-1, False, None, False, 0, {}, {}, set())


class FaultInjectionLayer(Layer):
    """Injects the configured faults; see the module docstring. Thread-safe."""

    kind = "faults"
    Config = FaultsConfig
    extra_stats = (
        "faults_hang",
        "faults_error",
        "faults_latency",
        "faults_wrong_count",
        "faults_corrupt",
        "faults_short_read",
        "faults_truncate_write",
        "faults_vanish",
    )
    config: FaultsConfig

    def __init__(self, inner: Level, config: FaultsConfig | dict[str, Any] | str | None = None) -> None:
        super().__init__(inner, config)
        if self.config.exists.vanish_rate and not inner.capabilities.delete:
            raise ConfigError(
                f"exists.vanish_rate deletes pages through the inner backend, and {inner.name} cannot delete; "
                "use another fault or a backend with the delete capability",
                field="exists.vanish_rate",
                backend=self.name,
            )
        self._enabled = self.config.enabled
        self._calls = dict.fromkeys(OPERATIONS, 0)
        self._calls_lock = threading.Lock()
        self._hangs = threading.Condition()
        self._gate = threading.Event()
        self._hanging = 0
        self._events: deque[FaultEvent] = deque(maxlen=self.config.event_log_size)

    def adjust_capabilities(self, inner: Capabilities) -> Capabilities:
        """Injected hangs and latency can stall any call: this stack no longer bounds its calls."""
        return inner.replace(bounded_calls=False)

    # --- control ------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """Whether calls starting now may suffer faults (see :meth:`pause` and :meth:`resume`)."""
        return self._enabled

    def pause(self) -> None:
        """Let every call from now on through untouched (calls already hanging stay so)."""
        self._enabled = False

    def resume(self) -> None:
        """Inject faults again, in the same sequence of fates as if the paused calls never happened."""
        self._enabled = True

    @property
    def events(self) -> list[FaultEvent]:
        """The latest faults injected (at most ``event_log_size``), oldest first."""
        return list(self._events)

    @property
    def hanging(self) -> int:
        """Calls blocked in an injected hang right now."""
        with self._hangs:
            return self._hanging

    def wait_for_hangs(self, count: int = 1, timeout: float | None = None) -> bool:
        """Wait until at least ``count`` calls are hanging; ``False`` if ``timeout`` passed first."""
        with self._hangs:
            return self._hangs.wait_for(lambda: self._hanging >= count, timeout)

    def release_hangs(self) -> None:
        """Let every call hanging now go on; later hangs block again (until closed)."""
        with self._hangs:
            gate = self._gate
            if not self.closed:
                self._gate = threading.Event()
        gate.set()

    # --- hooks --------------------------------------------------------------------------------

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        fate = self._suffer("exists", len(keys))
        results = super()._exists(keys)
        vanishing = [page for page in sorted(fate.vanishing) if results[page]]
        if vanishing:
            deleted = self.inner.hook_delete([keys[page] for page in vanishing])
            for page, gone in zip(vanishing, deleted):
                if gone:
                    self._record(FaultEvent("exists", fate.call, "vanish", page, "deleted after exists"), "faults_vanish")
        return self._miscount(fate, "exists", results)

    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        fate = self._suffer("get", len(keys))
        kept = {}
        for page, fraction in fate.short_cuts.items():
            size = segments_size(targets[page])
            start = int(fraction * size)
            kept[page] = (start, _read_range(targets[page], start, size))
        results = super()._get_into(keys, targets)
        for page, (start, before) in kept.items():
            if results[page]:
                _write_range(targets[page], start, before)
                self._record(FaultEvent("get", fate.call, "short_read", page, f"{start} bytes arrived"), "faults_short_read")
        for page, flips in fate.corruptions.items():
            size = segments_size(targets[page])
            if results[page] and size:
                positions = [_flip(targets[page], fraction, xor) for fraction, xor in flips]
                self._record(FaultEvent("get", fate.call, "corrupt", page, f"bytes {positions} flipped"), "faults_corrupt")
        return self._miscount(fate, "get", results)

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        fate = self._suffer("put", len(keys))
        sources = list(sources)
        for page, fraction in fate.short_cuts.items():
            kept = int(fraction * segments_size(sources[page]))
            sources[page] = [memoryview(_read_range(sources[page], 0, kept))]
            self._record(FaultEvent("put", fate.call, "truncate_write", page, f"{kept} bytes stored"), "faults_truncate_write")
        for page, flips in fate.corruptions.items():
            size = segments_size(sources[page])
            if size:
                copy = [memoryview(bytearray(_read_range(sources[page], 0, size)))]
                positions = [_flip(copy, fraction, xor) for fraction, xor in flips]
                sources[page] = copy
                self._record(FaultEvent("put", fate.call, "corrupt", page, f"bytes {positions} flipped"), "faults_corrupt")
        return self._miscount(fate, "put", super()._put_from(keys, sources))

    def _delete(self, keys: list[PageKey]) -> list[bool]:
        fate = self._suffer("delete", len(keys))
        return self._miscount(fate, "delete", super()._delete(keys))

    def _clear(self, namespace: Namespace) -> None:
        self._suffer("clear", 0)
        super()._clear(namespace)

    def _register_buffer(self, view: memoryview) -> None:
        self._suffer("register_buffer", 0)
        super()._register_buffer(view)

    def _close(self) -> None:
        with self._hangs:
            gate = self._gate  # stays set: nothing hangs after close
        gate.set()
        super()._close()

    # --- deciding and applying ----------------------------------------------------------------

    def _fate(self, operation: Operation, pages: int) -> _Fate:
        if not self._enabled:
            return _UNHARMED
        with self._calls_lock:
            call = self._calls[operation]
            self._calls[operation] += 1
        spec: FaultSpec = getattr(self.config, operation)
        rng = random.Random(f"{self.config.seed}:{operation}:{call}")
        hang = rng.random() < spec.hang_rate
        error = rng.choice(spec.errors) if rng.random() < spec.error_rate else None
        latency = rng.random() < spec.latency_rate
        wrong_count = rng.choice((-1, 1)) if rng.random() < spec.wrong_count_rate else 0
        short_cuts, corruptions = {}, {}
        shorten = spec.short_read_rate or spec.truncate_write_rate
        if shorten or spec.corrupt_rate:
            for page in range(pages):
                if rng.random() < shorten:
                    short_cuts[page] = rng.random()
                if rng.random() < spec.corrupt_rate:
                    corruptions[page] = [(rng.random(), rng.randrange(1, 256)) for _ in range(spec.corrupt_bytes)]
        # Drawn last, and only when configured, so configs without it replay as they always did.
        vanishing = {page for page in range(pages) if rng.random() < spec.vanish_rate} if spec.vanish_rate else set()
        return _Fate(call, hang, error, latency, wrong_count, short_cuts, corruptions, vanishing)

    def _suffer(self, operation: Operation, pages: int) -> _Fate:
        """Decide this call's fate and apply what happens before the store is asked."""
        fate = self._fate(operation, pages)
        spec: FaultSpec = getattr(self.config, operation)
        if fate.hang:
            self._record(FaultEvent(operation, fate.call, "hang"), "faults_hang")
            self._hang(spec.hang_seconds)
        if fate.latency and spec.latency_seconds:
            self._record(FaultEvent(operation, fate.call, "latency", detail=f"{spec.latency_seconds:g}s"), "faults_latency")
            time.sleep(spec.latency_seconds)
        if fate.error is not None:
            self._record(FaultEvent(operation, fate.call, "error", detail=fate.error), "faults_error")
            error = ERROR_KINDS[fate.error]
            message = f"injected fault: {fate.error} (call {fate.call} of {operation}, seed {self.config.seed})"
            if issubclass(error, StorageError):
                raise error(message, backend=self.name, operation=operation)
            raise error(message)
        return fate

    def _miscount(self, fate: _Fate, operation: str, results: list[bool]) -> list[bool]:
        if not fate.wrong_count:
            return results
        wrong = results[:-1] if fate.wrong_count < 0 and results else [*results, False]
        self._record(FaultEvent(operation, fate.call, "wrong_count", detail=f"{len(wrong)} for {len(results)}"), "faults_wrong_count")
        return wrong

    def _hang(self, seconds: float | None) -> None:
        with self._hangs:
            gate = self._gate
            self._hanging += 1
            self._hangs.notify_all()
        try:
            gate.wait(seconds)
        finally:
            with self._hangs:
                self._hanging -= 1
                self._hangs.notify_all()

    def _record(self, event: FaultEvent, counter: str) -> None:
        self._events.append(event)
        self._count(**{counter: 1})


# --- byte ranges across a page's segments -----------------------------------------------------


def _pieces(segments: Segments, start: int, end: int) -> list[tuple[memoryview, int, int]]:
    """``(segment, lo, hi)`` slices covering bytes ``[start, end)`` of the concatenated segments."""
    pieces, offset = [], 0
    for view in segments:
        lo, hi = max(start - offset, 0), min(end - offset, view.nbytes)
        if lo < hi:
            pieces.append((view, lo, hi))
        offset += view.nbytes
    return pieces


def _read_range(segments: Segments, start: int, end: int) -> bytes:
    return b"".join(bytes(view[lo:hi]) for view, lo, hi in _pieces(segments, start, end))


def _write_range(segments: Segments, start: int, data: bytes) -> None:
    consumed = 0
    for view, lo, hi in _pieces(segments, start, start + len(data)):
        view[lo:hi] = data[consumed : consumed + hi - lo]
        consumed += hi - lo


def _flip(segments: Segments, fraction: float, xor: int) -> int:
    """XOR the byte at ``fraction`` of the page with ``xor`` (never 0); returns its position."""
    position = int(fraction * segments_size(segments))
    for view, lo, _ in _pieces(segments, position, position + 1):
        view[lo] ^= xor
    return position
