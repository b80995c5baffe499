"""The store: the caller's API over a stack of layers and a connector.

A :class:`Store` is what every caller holds (the HiCache core, the engine adapters, the
benchmark, the conformance suite), and what :func:`~hicache_storage.spec.open_store` returns. It
owns everything that is the same for every connector:

* **validation**: keys are :class:`~hicache_storage.keys.PageKey`, one buffer per key, the store
  is open, the operation is declared (``UnsupportedOperationError`` otherwise), pages are within
  ``max_value_size`` (``ValueTooLargeError``);
* **buffers**: anything buffer-like (bytes, numpy, CPU tensors, ``RawBuffer``, lists of them)
  becomes a list of flat segments;
* **batch splitting** to ``max_batch``, and ``prefix_exists`` stopping at the first batch with a
  miss;
* **empty batches**: answered here, after validation (``[]``, or ``0`` from ``prefix_exists``);
  no level of the stack ever sees a call with no keys, so a connector need not handle one;
* **result checking**: one ``bool`` per key from every level of the stack
  (:func:`~hicache_storage.connector.check_results`, applied by each level's public hooks), else
  ``BackendContractError``;
* **statistics**: one :class:`~hicache_storage.counters.OperationCounters` of the calls its
  callers made, and the events every level of the stack counted (:meth:`Store.stats`);
* **description**: :meth:`Store.describe`, the stack as plain data.

The stack below it is reached only through the level interface every connector and layer offers
(the public ``hook_*`` methods, ``capabilities``, ``event_counts()``, ``close()``; see
:mod:`hicache_storage.connector`). Capabilities are read from the top of the stack on every call,
so a connector that refines its capabilities after opening (Redis at connect, 3FS after its
first put) is seen at once, through every layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hicache_storage.batching import write_last_positions
from hicache_storage.buffers import BufferLike, Segments, as_segments, as_view, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.connector import Level
from hicache_storage.counters import OperationCounters, sum_events
from hicache_storage.errors import (
    BackendClosedError,
    InvalidArgumentError,
    InvalidKeyError,
    UnsupportedOperationError,
    ValueTooLargeError,
)
from hicache_storage.keys import Namespace, PageKey

#: What a facade counts, by operation.
COUNTED = ("exists", "get", "put", "delete", "clear", "register_buffer")
#: The names ``stats()`` gives the facade's counts: name -> (operation, field).
STAT_FIELDS = {
    "exists_calls": ("exists", "calls"),
    "exists_keys": ("exists", "keys"),
    "exists_hits": ("exists", "hits"),
    "get_calls": ("get", "calls"),
    "get_keys": ("get", "keys"),
    "get_hits": ("get", "hits"),
    "put_calls": ("put", "calls"),
    "put_keys": ("put", "keys"),
    "put_stored": ("put", "hits"),
    "delete_calls": ("delete", "calls"),
    "delete_keys": ("delete", "keys"),
    "bytes_read": ("get", "bytes"),
    "bytes_written": ("put", "bytes"),
}


class Store:
    """The caller's API over ``top``, the outermost level of a stack. Thread-safe when the stack is.

    :func:`~hicache_storage.spec.open_store` opens one from a spec; ``Store(level)`` holds one
    over a connector or layer built by hand. Closing the store closes the stack.
    """

    #: The first batch :meth:`prefix_exists` asks of a store without ``native_batch_exists``
    #: (the width of the S3 connector's default pool: one round of its requests).
    PROBE_FIRST_KEYS = 16

    def __init__(self, top: Level) -> None:
        if isinstance(top, Store):
            raise InvalidArgumentError("Store() takes a connector or a layer; this is already a store", backend=top.name)
        if not isinstance(top, Level):
            raise InvalidArgumentError(
                f"Store() takes a connector or a layer (a hicache_storage Level), got {type(top).__name__}",
                backend=getattr(top, "name", type(top).__name__),
            )
        self.top = top
        self.counters = OperationCounters(COUNTED)

    # --- what the stack is --------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.top.name

    @property
    def capabilities(self) -> Capabilities:
        """The capabilities of the whole stack, computed from the connector up on every read."""
        return self.top.capabilities

    @property
    def closed(self) -> bool:
        return self.top.closed

    def levels(self) -> list[Level]:
        """Every level of the stack, the outermost layer first and the connector last."""
        return self.top.levels()

    def describe(self) -> dict[str, Any]:
        """This stack as plain data (JSON-serializable), read now: its capabilities, and each level,
        outermost first, with its kind and its own capabilities; the connector's config with
        secrets masked. What ``hicache-storage describe`` prints for an open store."""
        levels = self.levels()
        return {
            "name": self.name,
            "capabilities": self.capabilities.as_dict(),
            "levels": [
                {"name": level.name, "kind": getattr(level, "kind", "connector"), "capabilities": level.capabilities.as_dict()}
                for level in levels
            ],
            "config": levels[-1].config.public_dict(),
        }

    # --- the caller's API ---------------------------------------------------------------------

    def exists(self, keys: Sequence[PageKey]) -> list[bool]:
        """Whether each key holds a complete page (one result per key, in order)."""
        keys = self._prepare_keys(keys, "exists")
        return self.counters.observe(
            "exists", len(keys), lambda: self._run_batches(len(keys), lambda a, b: self.top.hook_exists(keys[a:b]))
        )

    def prefix_exists(self, keys: Sequence[PageKey]) -> int:
        """How many keys, from the first, exist without a gap (SGLang's ``batch_exists``).

        Stops asking as soon as a batch has a miss, so a short hit costs one round trip. On a
        store that asks one key at a time (no ``native_batch_exists``: an object store, a file
        system behind fsspec) the batches grow from ``PROBE_FIRST_KEYS`` keys, doubling: asked
        at once, every key of a long prompt costs a request whatever the first miss, and at the
        long-history bench's H200 point a 211-page lookup on SeaweedFS that found 8 took 230 ms
        (211 HEADs, sixteen at a time) while a request waited on the device memory it held. Growing batches cost a full hit about as many round trips as one batch
        (the connector runs its pool's width of calls at once) plus one per doubling.
        """
        keys = self._prepare_keys(keys, "exists")
        limit = self.capabilities.max_batch or len(keys) or 1
        step = limit if self.capabilities.native_batch_exists else min(limit, self.PROBE_FIRST_KEYS)
        found = start = 0
        while start < len(keys):
            chunk = keys[start : start + step]
            results = self.counters.observe("exists", len(chunk), lambda: self.top.hook_exists(chunk))
            for hit in results:
                if not hit:
                    return found
                found += 1
            start += len(chunk)
            step = min(limit, 2 * step)
        return found

    def get_into(self, keys: Sequence[PageKey], targets: Sequence[BufferLike | Sequence[BufferLike]]) -> list[bool]:
        """Read each key's page into the caller's buffer(s); ``True`` where the target now holds it."""
        keys = self._prepare_keys(keys, "get")
        views = self._prepare_buffers(keys, targets, "get", writable=True)
        return self.counters.observe(
            "get",
            len(keys),
            lambda: self._run_batches(len(keys), lambda a, b: self.top.hook_get_into(keys[a:b], views[a:b])),
            _bytes_moved(views),
        )

    def put_from(self, keys: Sequence[PageKey], sources: Sequence[BufferLike | Sequence[BufferLike]]) -> list[bool]:
        """Store each page from the caller's buffer(s); ``True`` where it is now stored.

        A key named more than once in one batch gets a result at each position, and the **last
        write wins**: afterwards the key holds the value of its last position (as in SGLang and in
        every KV store), also when the batch is split to ``max_batch``. The caller may reuse its
        buffers as soon as this returns: a stored page never follows later changes to them.
        """
        keys = self._prepare_keys(keys, "put")
        views = self._prepare_buffers(keys, sources, "put", writable=False)
        limit = self.capabilities.max_value_size
        if limit is not None:
            for key, segments in zip(keys, views):
                size = segments_size(segments)
                if size > limit:
                    raise ValueTooLargeError(
                        f"page of {size} bytes exceeds this backend's max_value_size of {limit} bytes; "
                        "use a smaller page size or split parts (k/v)",
                        backend=self.name,
                        operation="put",
                        key=key,
                    )
        return self.counters.observe("put", len(keys), lambda: self._put_batches(keys, views), _bytes_moved(views))

    def delete(self, keys: Sequence[PageKey]) -> list[bool]:
        """Remove each key; ``True`` where a page was removed, ``False`` where there was none."""
        self._require("delete")
        keys = self._prepare_keys(keys, "delete")
        return self.counters.observe(
            "delete", len(keys), lambda: self._run_batches(len(keys), lambda a, b: self.top.hook_delete(keys[a:b]))
        )

    def clear(self, namespace: Namespace) -> None:
        """Remove every page of ``namespace`` (all shards and parts); other namespaces are untouched."""
        self._require("clear")
        self._check_open("clear")
        if not isinstance(namespace, Namespace):
            raise InvalidArgumentError(
                f"clear() takes the Namespace to remove, got {type(namespace).__name__}",
                backend=self.name,
                operation="clear",
            )
        self.counters.observe("clear", 0, lambda: self.top.hook_clear(namespace))

    def get(self, keys: Sequence[PageKey], size: int) -> list[bytes | None]:
        """Each key's page as ``bytes`` (``None`` on a miss); ``size`` is the page's length in bytes."""
        if not isinstance(size, int) or size < 0:
            raise InvalidArgumentError(f"size must be a non-negative int, got {size!r}", backend=self.name, operation="get")
        buffers = [bytearray(size) for _ in keys]
        hits = self.get_into(keys, buffers)
        return [bytes(buf) if hit else None for buf, hit in zip(buffers, hits)]

    def put(self, keys: Sequence[PageKey], values: Sequence[bytes | bytearray | memoryview]) -> list[bool]:
        """Store byte strings; the copying counterpart of :meth:`put_from`."""
        return self.put_from(keys, values)

    def register_buffer(self, buffer: BufferLike) -> None:
        """Announce long-lived memory (a host KV pool) that later calls will read into and write from."""
        self._check_open("register_buffer")
        view = as_view(buffer, writable=False)
        self.counters.observe("register_buffer", 0, lambda: self.top.hook_register_buffer(view))

    def stats(self) -> dict[str, int]:
        """Counters since creation: this facade's calls, keys, hits and bytes per operation, and the
        events of every level of the stack (``timeouts``, ``retries``, ``integrity_miss_*``, a
        connector's own counters...); an event counted at several levels is their sum."""
        ops = self.counters.snapshot()
        counts = {name: ops[operation][field] for name, (operation, field) in STAT_FIELDS.items()}
        return {**sum_events(level.event_counts() for level in reversed(self.levels())), **counts}

    def close(self) -> None:
        """Close the stack (the top closes what is below it). Idempotent; later calls raise ``BackendClosedError``."""
        self.top.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------------------

    def _check_open(self, operation: str) -> None:
        if self.top.closed:
            raise BackendClosedError("backend is closed", backend=self.name, operation=operation)

    def _require(self, capability: str) -> None:
        if not getattr(self.capabilities, capability):
            raise UnsupportedOperationError(
                f"{self.name!r} does not support {capability}; check backend.capabilities.{capability} first",
                backend=self.name,
                operation=capability,
            )

    def _prepare_keys(self, keys: Sequence[PageKey], operation: str) -> list[PageKey]:
        self._check_open(operation)
        if isinstance(keys, (str, bytes, PageKey)):
            raise InvalidArgumentError(
                "keys must be a sequence of PageKey (wrap a single key in a list)", backend=self.name, operation=operation
            )
        keys = list(keys)
        for key in keys:
            if type(key) is not PageKey:
                raise InvalidKeyError(
                    f"keys must be PageKey objects (see hicache_storage.keys), got {type(key).__name__}: {key!r}",
                    backend=self.name,
                    operation=operation,
                )
        return keys

    def _prepare_buffers(self, keys: list[PageKey], buffers: Sequence[Any], operation: str, *, writable: bool) -> list[Segments]:
        buffers = list(buffers)
        if len(buffers) != len(keys):
            raise InvalidArgumentError(
                f"got {len(keys)} keys but {len(buffers)} buffers; pass one buffer (or list of segments) per key",
                backend=self.name,
                operation=operation,
            )
        return [as_segments(buffer, writable=writable) for buffer in buffers]

    def _run_batches(self, count: int, call: Callable[[int, int], list[bool]]) -> list[bool]:
        """``call(start, stop)`` over the positions ``[0, count)`` of a batch, in chunks of
        ``max_batch``; the results in order. An empty batch runs no chunk: the stack never sees a
        call with no keys."""
        step = self.capabilities.max_batch or count or 1
        results: list[bool] = []
        for start in range(0, count, step):
            results.extend(call(start, start + step))
        return results

    def _put_batches(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        """Put a batch larger than ``max_batch`` in chunks, the last chunk first.

        Within one put the first pages count as the most recent (``capacity_bytes``), so the
        chunk holding the head is written last and a store that evicts the least recent writes
        drops a prefix's tail, not its head. In that order a key named in two chunks would end
        with its earlier value, so only each key's last position is written, and every position
        gets its key's result. A batch within ``max_batch`` reaches the connector as given.
        """
        if not keys:
            return []  # answered here: the stack never sees a call with no keys
        step = self.capabilities.max_batch
        if not step or len(keys) <= step:
            return self.top.hook_put_from(keys, sources)

        def write(written: list[int]) -> list[bool]:
            stored: dict[int, bool] = {}
            for start in reversed(range(0, len(written), step)):
                chunk = written[start : start + step]
                results = self.top.hook_put_from([keys[i] for i in chunk], [sources[i] for i in chunk])
                stored.update(zip(chunk, results))
            return [stored[p] for p in written]

        return write_last_positions(keys, write)

    def __repr__(self) -> str:
        return f"<Store {self.name!r} levels={len(self.levels())}>"


def _bytes_moved(views: list[Segments]) -> Any:
    return lambda results: sum(segments_size(v) for v, ok in zip(views, results) if ok)
