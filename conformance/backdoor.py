"""An independent path into a store, so a write is checked without trusting the same connector's read.

As zarr's ``StoreTests`` do with their backdoor ``get``/``set``, a connector's conformance
fixture may return a :class:`Backdoor` from the ``backdoor`` fixture: an object that reads and
writes one page's stored bytes the way the store keeps them (a dict lookup, a file, a raw
client ``GET``), bypassing the connector under test. The backdoor clauses then prove that what
``put`` stored is the caller's bytes under the caller's key, and that ``get`` and ``exists``
serve bytes the connector did not write itself. A connector that is wrong both ways (it
scrambles, truncates or re-keys on write and undoes it on read) passes every round trip and
fails these.

The suite provides a backdoor for the built-in ``memory`` and ``file`` connectors when they are
tested bare; stores with layers (integrity adds a checksum to the stored value) get none.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

from hicache_storage.store import Store
from hicache_storage.keys import PageKey

if TYPE_CHECKING:
    from hicache_storage.connectors.memory import MemoryBackend


class Backdoor(Protocol):
    """Reads and writes one page's stored bytes without going through the connector under test."""

    def get(self, key: PageKey) -> bytes | None:
        """The bytes stored under ``key``, or ``None`` if there is no page."""

    def set(self, key: PageKey, value: bytes) -> None:
        """Store ``value`` under ``key`` the way the connector itself would."""


class MemoryBackdoor:
    """The memory connector's dict, read and written under its lock."""

    def __init__(self, connector: MemoryBackend) -> None:
        self._store = connector._store

    def get(self, key: PageKey) -> bytes | None:
        with self._store.lock:
            value = self._store.pages.get(key)
        return None if value is None else bytes(value)

    def set(self, key: PageKey, value: bytes) -> None:
        with self._store.lock:
            old = self._store.pages.pop(key, None)
            if old is not None:
                self._store.size -= len(old)
            self._store.pages[key] = bytes(value)
            self._store.size += len(value)


class FileBackdoor:
    """The file connector's page files: ``<root>/<namespace>/<shard>/<part>/<hash[:2]>/<hash>``."""

    def __init__(self, root: str) -> None:
        self._root = root

    def _path(self, key: PageKey) -> str:
        namespace, shard, part, page_hash = key.render("/").split("/")
        return os.path.join(self._root, namespace, shard, part, page_hash[:2], page_hash)

    def get(self, key: PageKey) -> bytes | None:
        try:
            with open(self._path(key), "rb") as page:
                return page.read()
        except FileNotFoundError:
            return None

    def set(self, key: PageKey, value: bytes) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        temp = f"{path}.backdoor-{os.getpid()}"
        with open(temp, "wb") as page:
            page.write(value)
        os.replace(temp, path)


def builtin_backdoor(store: Store) -> Backdoor | None:
    """The backdoor of a store that is a bare built-in connector (or a subclass of one); ``None`` for anything else."""
    from hicache_storage.connectors.memory import MemoryBackend

    levels = store.levels()
    if len(levels) != 1:
        return None
    connector = levels[0]
    if isinstance(connector, MemoryBackend):
        return MemoryBackdoor(connector)
    try:
        from hicache_storage.connectors.file import FileBackend
    except ImportError:
        return None
    if isinstance(connector, FileBackend):
        return FileBackdoor(getattr(connector, "_root", connector.config.root))
    return None
