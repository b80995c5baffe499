"""One error hierarchy for every connector and wrapper.

Everything a backend raises on purpose is a :class:`StorageError`. Two kinds matter to callers:

* :class:`RetryableError`: the same call may succeed later (a dropped connection, a timeout, a
  throttled request). The retry wrapper retries these, and only these.
* :class:`PermanentError`: retrying cannot help (bad input, bad credentials, an operation the
  backend does not support). Fix the cause.

A miss is never an error: reads and exists return per-key results.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any


class StorageError(Exception):
    """Base of every error this SDK raises on purpose.

    ``backend``, ``operation`` and ``key`` say where it happened (each may be ``None``).
    Messages never contain credentials: connectors redact URLs and secrets before raising.
    """

    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        backend: str | None = None,
        operation: str | None = None,
        key: object | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.backend = backend
        self.operation = operation
        self.key = key

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
    """The operation may succeed if tried again later."""

    retryable = True


class PermanentError(StorageError):
    """Retrying will not help; the cause must be fixed."""


# --- retryable ----------------------------------------------------------------------------------


class BackendUnavailableError(RetryableError):
    """The store cannot be reached (connection refused or dropped, server restarting)."""


class StorageTimeoutError(RetryableError):
    """The store did not answer within the configured time.

    ``settled`` says when the inner call the caller gave up on has really returned. It is
    ``None`` when the caller's buffers are already safe to reuse: the call never started, it had
    no buffers, or the layer that timed out handed the store private copies. Otherwise (a
    zero-copy timeout, see :mod:`hicache_storage.wrappers.timeout`) the store may still write
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
    """The store is full and cannot make room (nothing evictable)."""


class BackendContractError(PermanentError):
    """A backend broke the contract: wrong result count, non-boolean result, and so on.

    Seeing this means the connector has a bug; the conformance suite should catch it.
    """


class BackendClosedError(PermanentError):
    """The backend was closed; create a new one."""


class ConfigError(PermanentError, ValueError):
    """A configuration value is invalid. The message names the field, the value and what is allowed."""

    def __init__(self, message: str, *, field: str | None = None, backend: str | None = None) -> None:
        super().__init__(message, backend=backend)
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
