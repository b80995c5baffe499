"""Local-disk (NVMe) connector: one file per page under a root directory.

Modules, one concept each: ``connector`` (configuration, the hooks, writing and publishing one
page, :class:`FileBackend`), ``tree`` (paths and the checked directory tree), ``temp`` (temp file
names and cleanup after dead writers), ``direct`` (page I/O and O_DIRECT alignment) and ``lru``
(the capacity index).
"""

from hicache_storage.connectors.file.connector import FileBackend, FileConfig

__all__ = ["FileBackend", "FileConfig"]
