"""What a redis-py error means for the Redis backend's caller: the typed SDK error to raise.

Every message names the server (or the cluster's nodes) and never a secret: the password and any
URL userinfo password are masked. Errors in a pipeline's per-key reply slots are misses unless
they say the whole server is unusable (connection lost, timeout, cluster down, credentials or
permissions refused).
"""

from __future__ import annotations

from typing import Any

from hicache_storage.connectors.redis.config import USERINFO_RE
from hicache_storage.errors import (
    AuthenticationError,
    BackendUnavailableError,
    CapacityError,
    ConfigError,
    ErrorStatus,
    PermissionDeniedError,
    StorageError,
    StorageTimeoutError,
)

# How servers word a rejected or missing password; the cluster client reports these only as text.
_AUTH_FAILURE_MARKERS = (
    "WRONGPASS",
    "NOAUTH",
    "invalid username-password",
    "invalid password",
    "Authentication required",
    "must be called with the client already authenticated",
)


# Error replies that say the server cannot serve now but will: loading its data, busy with a
# script, a replica during failover, a cluster slot moving.
_PASSING_REPLIES = ("LOADING", "BUSY", "READONLY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "MASTER_DOWN")


def is_auth_failure(message: str) -> bool:
    """Whether a server's error text says the password was rejected or missing."""
    return any(marker in message for marker in _AUTH_FAILURE_MARKERS)


def reply_status(message: str) -> ErrorStatus:
    """Whether a Redis error reply of no other known kind may pass (``LOADING``, ``READONLY``, ...);
    anything else (``WRONGTYPE``, an unknown command, a module's refusal) needs a fix."""
    return ErrorStatus.TEMPORARY if message.lstrip().startswith(_PASSING_REPLIES) else ErrorStatus.PERMANENT


class RedisErrors:
    """Translates redis-py exceptions for one backend instance; stateless after construction, so thread-safe.

    ``redis`` is the imported redis-py module, ``where`` how messages name the server,
    ``secret`` the password to mask (or ``None``).
    """

    def __init__(self, redis: Any, *, backend: str, where: str, secret: str | None, socket_timeout: float) -> None:
        self._redis = redis
        self._backend = backend
        self._where = where
        self._secret = secret
        self._socket_timeout = socket_timeout
        exceptions = redis.exceptions
        # Errors in a per-key reply slot that say the server (or the cluster) is unusable, not the key.
        self._server_wide_errors = (
            exceptions.ConnectionError,
            exceptions.TimeoutError,
            exceptions.ClusterError,
            exceptions.NoPermissionError,
        )

    def check_replies(self, operation: str, replies: list[Any]) -> list[Any]:
        """Raise for an error that concerns the whole server; leave per-key errors as misses."""
        exceptions = self._redis.exceptions
        for reply in replies:
            if isinstance(reply, self._server_wide_errors):
                raise self.translate(reply, operation) from reply
            if isinstance(reply, exceptions.ResponseError) and is_auth_failure(str(reply)):
                raise self.translate(reply, operation) from reply
        return replies

    def translate(self, exc: BaseException, operation: str) -> StorageError:
        """The typed SDK error for a redis-py exception, with the address named and secrets removed."""
        exceptions = self._redis.exceptions
        detail = self.redact(str(exc)) or type(exc).__name__
        where = f"Redis at {self._where}"
        if isinstance(exc, StorageError):
            return exc
        if isinstance(exc, exceptions.AuthenticationError) or is_auth_failure(detail):
            return AuthenticationError(
                f"{where} rejected the credentials ({detail}); check the password (and the user name in the url)",
                backend=self._backend,
                operation=operation,
            )
        if "CERTIFICATE_VERIFY_FAILED" in detail:
            return ConfigError(
                f"the TLS certificate of {where} did not verify ({detail}); "
                "set ssl_ca_certs to the CA bundle that signed it",
                field="ssl_ca_certs",
                backend=self._backend,
            )
        if isinstance(exc, exceptions.NoPermissionError):
            return PermissionDeniedError(
                f"{where} does not allow this user to run the commands the connector needs ({detail}); "
                "grant it GET, SET, EXISTS, UNLINK, SCAN and PING on the key prefix",
                backend=self._backend,
                operation=operation,
            )
        if isinstance(exc, exceptions.TimeoutError):
            return StorageTimeoutError(
                f"{where} did not answer within socket_timeout={self._socket_timeout}s ({detail})",
                backend=self._backend,
                operation=operation,
            )
        if isinstance(exc, exceptions.OutOfMemoryError):
            return CapacityError(
                f"{where} is out of memory and does not evict ({detail}); raise maxmemory or set an eviction policy",
                backend=self._backend,
                operation=operation,
            )
        unavailable = (
            exceptions.ConnectionError,
            exceptions.ClusterError,
            exceptions.TryAgainError,
            exceptions.RedisClusterException,
            OSError,
        )
        if isinstance(exc, unavailable):
            hint = "; check that the server is running and that the url is right" if operation == "connect" else ""
            return BackendUnavailableError(
                f"cannot use {where}: {detail.rstrip('.')}{hint}", backend=self._backend, operation=operation
            )
        return StorageError(
            f"{where} failed: {type(exc).__name__}: {detail}",
            backend=self._backend,
            operation=operation,
            status=ErrorStatus.TEMPORARY if isinstance(exc, exceptions.ReadOnlyError) else reply_status(detail),
        )

    def redact(self, text: str) -> str:
        """``text`` with the password and any URL userinfo password masked."""
        if self._secret:
            text = text.replace(self._secret, "***")
        return USERINFO_RE.sub(r"\1:***@", text)
