"""Transitional: the old home of the connector contract, now :mod:`hicache_storage.connector`
(:class:`Connector`, :class:`Level`) with ``StorageBackend`` in :mod:`hicache_storage.compat`."""

from hicache_storage.compat import StorageBackend
from hicache_storage.connector import Connector, Level, check_results

__all__ = ["Connector", "Level", "StorageBackend", "check_results"]
