"""The conformance suite's options, checked once before any clause runs.

Every clause opens the backend itself, so a bad config would otherwise fail every clause with the
same error. Used by the pytest plugin and by ``hicache-storage conformance``. It imports no
pytest: the command calls it before ``pytest.main`` without importing the plugin, whose import
registers the suite for pytest's assertion rewriting and must happen inside pytest.
"""

from __future__ import annotations

from typing import Any

from hicache_storage.errors import ErrorStatus, StorageError


def check_options(backend: str, config: Any, layers: Any) -> None:
    """Open ``backend`` once with ``config`` under ``layers``, then close it.

    Raises what every clause would otherwise raise on its own: :class:`ConfigError` for malformed
    JSON, a missing ``@file``, an unknown key, a wrong type or a bad layer spec; the backend's
    own :class:`StorageError` for a store it cannot use (a root that is not a writable directory,
    a server that does not answer). Anything else the backend raises while opening is reported
    as a :class:`StorageError` naming the backend.
    """
    from hicache_storage.spec import open_store, store_spec

    spec = store_spec(backend, config, layers)  # a bad config or layer spec: ConfigError, nothing opened
    try:
        store = open_store(spec)  # as every clause opens it
    except StorageError:
        raise
    except Exception as exc:  # a connector's own bug or a client library's error: still one line
        raise StorageError(
            f"cannot open the backend with this config: {type(exc).__name__}: {exc}", backend=backend, status=ErrorStatus.PERMANENT
        ) from exc
    store.close()


def one_line(message: str) -> str:
    """``message`` with its line breaks and runs of spaces folded into single spaces."""
    return " ".join(message.split())
