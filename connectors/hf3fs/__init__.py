"""3FS connector: pages in pre-sized per-rank files of fixed-size slots, plus a slot index.

Modules, one concept each: ``connector`` (configuration and the hooks, :class:`HF3FSBackend`),
``index`` (where a page lives, the in-process slot index), ``redis_index`` (the slot index in
Redis, its Lua scripts and its typed errors) and ``io`` (POSIX and usrbio I/O on the data files).
"""

from hicache_storage.connectors.hf3fs.connector import HF3FSBackend, HF3FSConfig
from hicache_storage.connectors.hf3fs.io import UsrbioFiles, usrbio_available

__all__ = ["HF3FSBackend", "HF3FSConfig", "UsrbioFiles", "usrbio_available"]
