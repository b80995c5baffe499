"""What a backend can do, declared up front instead of discovered by trial.

The SDK reads the declaration to split batches, check sizes and refuse unsupported operations with
one typed error; the conformance suite checks that the declaration is honest (a backend that
declares ``persistent`` must keep pages across a restart, one that declares ``delete`` must
delete, and so on).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Capabilities:
    #: Reads land directly in the caller's buffers, with no intermediate copy in Python.
    zero_copy_read: bool = False
    #: Writes are taken directly from the caller's buffers, with no intermediate copy in Python.
    zero_copy_write: bool = False
    #: ``exists`` for a batch is one round trip, not one per key.
    native_batch_exists: bool = False
    #: Most pages in one call; the SDK splits larger batches. ``None``: no limit.
    max_batch: int | None = None
    #: Largest page in bytes; larger writes raise ``ValueTooLargeError``. ``None``: no limit.
    max_value_size: int | None = None
    #: ``delete`` removes pages.
    delete: bool = False
    #: ``clear(namespace)`` removes every page of one namespace and nothing else.
    clear: bool = False
    #: Pages can expire after a configured time to live.
    ttl: bool = False
    #: Every call returns or raises within a time the connector bounds itself (client socket or
    #: request timeouts), so a store spec adds no default timeout layer (``hicache_storage.spec``).
    bounded_calls: bool = False
    #: ``register_buffer`` makes later I/O on that memory faster (RDMA, pinned memory).
    buffer_registration: bool = False
    #: Pages survive closing the backend and creating a new one with the same config
    #: (and, for a server, a restart of the client process).
    persistent: bool = False
    #: Another live process with the same config sees this process's pages (while both run).
    shared_across_processes: bool = False
    #: Pages another process wrote stay readable after that process exits (no per-client
    #: segment that leaves with its writer).
    outlives_writer: bool = False
    #: Another host with the same config sees this host's pages.
    shared_across_hosts: bool = False
    #: The backend may drop pages on its own to stay under a capacity (LRU, TTL, server eviction).
    evicts: bool = False
    #: Most bytes of pages this instance keeps (declare ``evicts`` too); ``None``: no bound the
    #: suite can check. Beyond it the store drops least recently used pages, and within one
    #: ``put`` the first pages count as the most recent, so a prefix keeps its head.
    capacity_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_value_size", "capacity_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"Capabilities.{name} must be a positive integer or None, got {value!r}")

    def replace(self, **changes: Any) -> Capabilities:
        return replace(self, **changes)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)
