"""One error hierarchy for every connector and layer.

Everything a backend raises on purpose is a :class:`StorageError`. Each carries two separate
things: its *kind*, the class, which says what failed (:class:`AuthenticationError`,
:class:`BackendUnavailableError`, ...), and its *status* (:class:`ErrorStatus`), which says
whether trying again can help:

* ``TEMPORARY``: the same call may succeed later (a dropped connection, a timeout, a throttled
  request). The retry layer retries these, and only these; the HiCache core keeps calling.
* ``PERMANENT``: retrying cannot help (bad credentials, bad input, a connector that breaks the
  contract). Fix the cause; the HiCache core stops calling the store and says so once.
* ``PERSISTENT``: it was temporary, but a retry layer gave up on it; callers treat it as
  permanent for this call's purposes (it is not retried again further up).

Every class has a default status (:class:`RetryableError` and its subclasses temporary,
everything else permanent); a raise may override it with ``status=``, as connectors do for
errors whose class does not decide it (an OS error by its errno, an HTTP refusal by its code).
``retryable`` stays as ``status is TEMPORARY``, for code written against the class split.

A miss is never an error: reads and exists return per-key results.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any


class ErrorStatus(str, enum.Enum):
    """Whether trying the failed call again can help (OpenDAL's ``ErrorStatus``)."""

    #: It may succeed later: retry, keep using the store.
    TEMPORARY = "temporary"
    #: It cannot succeed until someone fixes the cause: do not retry, stop using the store.
    PERMANENT = "permanent"
    #: It was temporary, but retries gave up: do not retry it again.
    PERSISTENT = "persistent"


class StorageError(Exception):
    """Base of every error this SDK raises on purpose.

    ``backend``, ``operation`` and ``key`` say where it happened (each may be ``None``).
    ``status`` says whether trying again can help: the class's ``default_status`` unless the
    raise passes ``status=``. Messages never contain credentials: connectors redact URLs and
    secrets before raising.
    """

    #: The status of an error raised without ``status=``; a connector that raises a plain
    #: StorageError for something that may pass should say ``status=ErrorStatus.TEMPORARY``.
    default_status: ErrorStatus = ErrorStatus.PERMANENT

    def __init__(
        self,
        message: str,
        *,
        backend: str | None = None,
        operation: str | None = None,
        key: object | None = None,
        status: ErrorStatus | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.backend = backend
        self.operation = operation
        self.key = key
        self.status = self.default_status if status is None else ErrorStatus(status)

    @property
    def retryable(self) -> bool:
        """Whether trying again may help (``status`` is ``TEMPORARY``)."""
        return self.status is ErrorStatus.TEMPORARY

    @property
    def permanent(self) -> bool:
        """Whether a caller should stop calling the store for now (``PERMANENT`` or ``PERSISTENT``)."""
        return self.status is not ErrorStatus.TEMPORARY

    def __str__(self) -> str:
        where = [
            f"{label}={value}"
            for label, value in (("backend", self.backend), ("operation", self.operation), ("key", self.key))
            if value is not None
        ]
        return f"{self.message} [{', '.join(where)}]" if where else self.message

    def with_context(self, **context: Any) -> StorageError:
        """Fill in context fields that are still unset; returns self for ``raise err.with_context()``."""
        for name in ("backend", "operation", "key"):
            if getattr(self, name) is None and context.get(name) is not None:
                setattr(self, name, context[name])
        return self


class RetryableError(StorageError):
    """The operation may succeed if tried again later (status ``TEMPORARY`` by default)."""

    default_status = ErrorStatus.TEMPORARY


class PermanentError(StorageError):
    """Retrying will not help; the cause must be fixed (status ``PERMANENT`` by default)."""


# --- retryable ----------------------------------------------------------------------------------


class BackendUnavailableError(RetryableError):
    """The store cannot be reached (connection refused or dropped, server restarting)."""


class StorageTimeoutError(RetryableError):
    """The store did not answer within the configured time.

    ``settled`` says when the inner call the caller gave up on has really returned. It is
    ``None`` when the caller's buffers are already safe to reuse: the call never started, it had
    no buffers, or the layer that timed out handed the store private copies. Otherwise (a
    zero-copy timeout, see :mod:`hicache_storage.layers.timeout`) the store may still write
    into the read targets or read the write sources until ``settled`` is set, so the caller must
    leave those buffers untouched until then: wait on it, or use :meth:`when_settled`.
    """

    class Settled(threading.Event):
        """An event set once an abandoned call returned, which also runs callbacks then."""

        def __init__(self) -> None:
            super().__init__()
            self._callbacks: list[Callable[[], object]] = []
            self._callbacks_lock = threading.Lock()

        def set(self) -> None:
            with self._callbacks_lock:
                super().set()
                callbacks, self._callbacks = self._callbacks, []
            for callback in callbacks:
                StorageTimeoutError._run_callback(callback)

        def add_callback(self, callback: Callable[[], object]) -> None:
            """Run ``callback`` once set: on the setting thread, or now on this one if already set."""
            with self._callbacks_lock:
                if not self.is_set():
                    self._callbacks.append(callback)
                    return
            StorageTimeoutError._run_callback(callback)

    def __init__(self, message: str, *, settled: StorageTimeoutError.Settled | None = None, **context: Any) -> None:
        super().__init__(message, **context)
        self.settled = settled

    def when_settled(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` once the store no longer uses the caller's buffers.

        At once, on this thread, if it already does not (``settled`` is ``None`` or set);
        otherwise on the thread where the inner call returns, right after it returned. An
        exception from ``callback`` is logged, never raised into that thread.
        """
        if self.settled is None:
            StorageTimeoutError._run_callback(callback)
        else:
            self.settled.add_callback(callback)

    @staticmethod
    def _run_callback(callback: Callable[[], object]) -> None:
        try:
            callback()
        except Exception:  # a callback's bug must not end the store's worker thread
            logging.getLogger(__name__).exception("a StorageTimeoutError.when_settled callback failed")


class ThrottledError(RetryableError):
    """The store asked the client to slow down."""


# --- permanent ----------------------------------------------------------------------------------


class AuthenticationError(PermanentError):
    """The store rejected the credentials (wrong key, secret or password)."""


class PermissionDeniedError(PermanentError):
    """The credentials are valid but not allowed to do this."""


class UnsupportedOperationError(PermanentError):
    """The backend does not declare the capability this operation needs."""


class ValueTooLargeError(PermanentError):
    """A page is larger than the backend's declared ``max_value_size``."""


class InvalidKeyError(PermanentError, ValueError):
    """A key, or a field of one, is malformed."""


class InvalidArgumentError(PermanentError, ValueError):
    """An argument has the wrong type, length or size (buffers, batches)."""


class CapacityError(PermanentError):
    """The store is full and cannot make room (nothing evictable).

    Temporary by default although a PermanentError by class: retrying at once rarely helps, but
    space comes back (eviction, expiry, another client's deletes, an operator), and reads from a
    full store still work, so a caller should not give the store up over it.
    """

    default_status = ErrorStatus.TEMPORARY


class BackendContractError(PermanentError):
    """A backend broke the contract: wrong result count, non-boolean result, and so on.

    Seeing this means the connector has a bug; the conformance suite should catch it.
    """


class BackendClosedError(PermanentError):
    """The backend was closed; create a new one."""


class ConfigError(PermanentError, ValueError):
    """A configuration value is invalid. The message names the field, the value and what is allowed."""

    def __init__(
        self, message: str, *, field: str | None = None, backend: str | None = None, status: ErrorStatus | None = None
    ) -> None:
        super().__init__(message, backend=backend, status=status)
        self.field = field


class UnknownBackendError(PermanentError, LookupError):
    """No backend is registered under that name."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        known = sorted(known)
        super().__init__(
            f"unknown storage backend {name!r}; known backends: {', '.join(known)}. "
            "Third-party backends register under the entry-point group 'hicache_storage.backends', "
            "or can be named directly as 'package.module:ClassName'."
        )
        self.name = name
        self.known = known


class MissingDependencyError(PermanentError, ImportError):
    """An optional client library a connector needs is not installed."""

    def __init__(self, backend: str, package: str, extra: str | None) -> None:
        hint = f"pip install 'hicache-storage[{extra}]'" if extra else f"pip install {package}"
        super().__init__(
            f"the {backend!r} backend needs the Python package {package!r}, which is not installed; "
            f"install it with: {hint}",
            backend=backend,
        )
        self.package = package
        self.extra = extra
