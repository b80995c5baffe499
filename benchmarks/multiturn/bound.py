"""The bound a bench run is held to: how fast its legs allow it to be, measured in the same run.

Before the tier configurations run and again after them (the faster of the two counts, and
of the store speeds a run's own backups and prefetches reached: :meth:`Legs.reached_by`),
:func:`measure_legs` times the legs the engine uses, on the bench's own page size and KV geometry:

* **storage**: ``put_from`` then ``get_into`` of whole pages, straight from and into host-pool
  page views, in the engine's batch size, through the same store stack the controller builds;
* **copies**: the controller's own transfers, a device -> host backup (every layer) and a
  layer-wise host -> device load, between pools of the run's layout;
* **compute**: the modeled prefill rate and decode step (given, not measured: the engine sleeps
  for them). A run of the real reference model has no modeled compute and gets no bound.

Each configuration's bound is then the time of its busiest leg, from what the run itself moved::

    compute = computed tokens / prefill rate + decode steps x decode step
    storage = bytes read / read speed + bytes written / write speed
    copies  = bytes loaded / load speed + bytes backed up / backup speed
    bound   = max(compute, storage, copies)

The legs run on different resources (GPU, PCIe, NIC or disk; here the sleeping scheduler and
two cores), so the bound assumes they overlap perfectly: it is the shortest wall time the run
could have had with the same hits. ``efficiency = bound / wall``; the highest ratio over L1 those
speeds allow at the run's hit rate is ``L1 wall / bound``. A slow result then shows where it
comes from: the leg that sets the bound (the backend, the copies, compute) or the engine
(efficiency well below 1).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from hicache_storage.errors import StorageError
from hicache_storage.keys import KeyScope, Namespace, PageKey
from hicache_storage.registry import create_backend
from hicache_storage.store import Store

from hicache_core.controller import CacheController
from hicache_core.engine import EngineConfig
from hicache_core.metrics import CacheMetrics
from hicache_core.model import ModelConfig
from hicache_core.pools import DevicePool, HostPool
from hicache_core.radix_tree import RadixTree

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Legs:
    """Speeds in bytes per second (``None``: not measured), and the modeled compute."""

    storage_write: float | None
    storage_read: float | None
    backup: float
    load: float
    prefill_tokens_per_s: float | None
    decode_step_s: float | None
    #: How much the machine's data movements overlap: 1 + the share of the shorter of a store read
    #: and a host -> device load of the same size that is hidden under the longer when they run at
    #: once (1: they share one resource, such as this machine's memory bandwidth; 2: independent,
    #: as a NIC and PCIe are). Without a store, a backup and a load. See :func:`overlap_of`.
    overlap: float = 1.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def fastest(self, other: Legs) -> Legs:
        """Each speed the faster of two measurements (the compute is the same model's)."""

        def best(a: float | None, b: float | None) -> float | None:
            return b if a is None else a if b is None else max(a, b)

        return replace(
            self,
            storage_write=best(self.storage_write, other.storage_write),
            storage_read=best(self.storage_read, other.storage_read),
            backup=max(self.backup, other.backup),
            load=max(self.load, other.load),
            overlap=max(self.overlap, other.overlap),
        )

    def reached_by(self, metrics: dict[str, float]) -> Legs:
        """Each store speed the faster of this measurement and what a run reached (``metrics``:
        its engine's counters): the bytes its storage backups wrote over the seconds those
        operations took, and the bytes its prefetches read over theirs. An operation's time
        holds more than its calls (an exists lookup, a backup's rest while reads are pending, a
        read's wait for pinned pages), so these speeds are never above the store's, and a run
        that reached one shows the store allows it. The timings alone read a file store's writes
        at 0.30-0.52 GB/s in the recurrent long-history runs whose backups wrote at 0.46-0.72,
        and one such run's bound stood above its wall time (efficiency 1.34)."""

        def rate(done: float, seconds: float) -> float | None:
            return done / seconds if done > 0 and seconds > 0 else None

        reached = replace(
            self,
            storage_write=rate(metrics.get("storage_backup_bytes", 0.0), metrics.get("storage_backup_seconds", 0.0)),
            storage_read=rate(metrics.get("prefetch_bytes", 0.0), metrics.get("prefetch_seconds", 0.0)),
        )
        return self.fastest(reached)


def measure_legs(config: EngineConfig, repeats: int = 5) -> Legs:
    """Time the copies and (when ``config`` has L3) the store the engine of ``config`` would use,
    each alone and two at once (``Legs.overlap``).

    Each speed is the fastest of ``repeats`` timings: the bound is the least time the legs allow,
    so a slow repeat (another process, the kernel writing back a previous configuration's files)
    must not lower it. With the median of three, the store's write speed read 0.18-0.33 GB/s in
    the recurrent shape's runs (0.57 GB/s measured alone) and runs came out faster than their
    "bound" (efficiency 1.06-1.26).

    Each timed call moves what one of the engine's does: a full storage batch
    (``config.controller.batch_pages`` pages), between slots scattered over both pools as the
    allocators hand them out once a run has churned them. Timed with consecutive host pages and
    half a batch, a load read 5.4-7.2 GB/s where the file bench at h200-7b copied 4.3-5.4 GB/s,
    and a file-store read 7.3-12 GB/s against the run's 6.4 in 120-page calls: the bound held
    the run to speeds no call of it could reach.

    Uses its own pools (a batch's pages each way) and its own namespace in the store (a fresh
    tenant), so it leaves the run's cache untouched. The timing's pages are removed on a thread
    of its own once the store allows it (:func:`_remove_timing_pages`); the call does not wait.
    """
    if not isinstance(config.model, ModelConfig):
        raise TypeError(f"the legs are timed on a full-attention pool, not a {type(config.model).__name__}: pass the full pool's model")
    geometry = config.model.geometry
    pages = config.controller.batch_pages
    device = DevicePool(geometry, 2 * pages, config.page_size, config.device)
    host = HostPool(geometry, config.page_size, config.layout, num_pages=2 * pages, device_pool=device)
    tree = RadixTree(config.page_size, device.allocator.free, host.allocator.free)
    controller = CacheController(config.controller, tree, device, host, metrics=CacheMetrics())
    transfers = controller.transfers
    assert transfers is not None
    generator = torch.Generator().manual_seed(0)
    device_slots = device.allocator.slots_of(torch.randperm(device.allocator.num_pages, generator=generator)[:pages])
    # the copies' host pages and the store's, scattered and apart (a read must not land in pages a load reads)
    host_pages = torch.randperm(host.allocator.num_pages, generator=generator)
    copy_slots = host.allocator.slots_of(host_pages[:pages])
    store_slots = host.allocator.slots_of(host_pages[pages:])
    size = pages * host.page_bytes

    def backup() -> None:
        transfers.backup(device_slots, copy_slots).synchronize()

    def load() -> None:
        transfers.load(device_slots, copy_slots, lambda load: None).wait_all()

    try:
        backup_s, load_s = _fastest(backup, repeats), _fastest(load, repeats)
        write = read = None
        if config.tiers.storage and config.storage_backend is not None:
            write, read, overlap = _storage_speeds(controller, config.storage_backend, config, host, store_slots, repeats, load, load_s)
        else:
            overlap = _overlap(backup, backup_s, load, load_s, repeats)
    finally:
        controller.close()
        host.close()
    compute = config.compute
    return Legs(
        storage_write=write,
        storage_read=read,
        backup=size / backup_s,
        load=size / load_s,
        prefill_tokens_per_s=compute.prefill_tokens_per_s if compute else None,
        decode_step_s=compute.decode_step_s if compute else None,
        overlap=overlap,
    )


def _fastest(call: Callable[[], object], repeats: int) -> float:
    """The least seconds ``call`` took in ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times)


def _overlap(first: Callable[[], object], first_s: float, second: Callable[[], object], second_s: float, repeats: int) -> float:
    """How much two calls overlap when run at once (:func:`overlap_of` of their least times alone
    and the least time both took together)."""

    def both() -> None:
        other = threading.Thread(target=first)
        other.start()
        second()
        other.join()

    return overlap_of(first_s, second_s, _fastest(both, repeats))


def overlap_of(first_s: float, second_s: float, both_s: float) -> float:
    """1 + the share of the shorter of two movements hidden under the longer when run at once
    (between 1 and 2; timing noise past either end is held to it).

    Not the times summed over the time at once: two movements of the same size at different speeds
    (a store read ten times slower than a load) that run fully at once take the longer's time, and
    that ratio reads 11 / 10, not 2. The reachable bound's machine leg, (store + copies) / overlap,
    would then hold a round whose store and copies are equal to about their sum, though on
    independent resources they take half of it: a "bound" above what the run could reach.
    """
    shorter = min(first_s, second_s)
    if shorter <= 0:
        return 2.0  # a movement that takes no time hides under anything
    return min(2.0, max(1.0, 1.0 + (first_s + second_s - both_s) / shorter))


def _storage_speeds(
    controller: CacheController,
    backend: str,
    config: EngineConfig,
    host: HostPool,
    slots: torch.Tensor,
    repeats: int,
    load: Callable[[], None],
    load_s: float,
) -> tuple[float, float, float]:
    """Write and read speeds of whole pages between the host pool's ``slots`` and ``backend``
    (``config``'s store), as the controller calls it, and how much a read overlaps ``load`` (a
    copy from other host pages)."""
    connector = Store(create_backend(backend, config.storage_config))
    store = controller.storage_stack(connector)
    handed_over = False
    try:
        store.register_buffer(host.as_buffer())
        scope = KeyScope(
            Namespace(f"bench-legs-{config.model.name}", host.geometry.dtype_name, config.page_size,
                      config.layout, tenant=f"legs-{uuid.uuid4().hex[:12]}")
        )
        segments = host.segments_for(slots)
        pages = len(segments)
        size = pages * host.page_bytes
        writes, reads = [], []
        written: list[PageKey] = []
        for attempt in range(repeats):
            keys = scope.keys([f"{attempt:08x}{page:056x}" for page in range(pages)])
            written += keys
            started = time.perf_counter()
            stored = store.put_from(keys, segments)
            writes.append(time.perf_counter() - started)
            started = time.perf_counter()
            read = store.get_into(keys, segments)
            reads.append(time.perf_counter() - started)
            if not (all(stored) and all(read)):
                raise RuntimeError(
                    f"measuring the store: {stored.count(False)} of {pages} writes and {read.count(False)} reads "
                    "failed; a store that refuses pages of this size cannot back the bench (see its capacity)"
                )
        last = written[-pages:]
        overlap = _overlap(lambda: store.get_into(last, segments), min(reads), load, load_s, repeats)
        cleanup = threading.Thread(
            target=_remove_timing_pages, args=(connector, store, written, scope), name=CLEANUP_THREAD, daemon=False
        )
        cleanup.start()
        handed_over = True
        return size / min(writes), size / min(reads), overlap
    finally:
        if not handed_over:
            store.close()


#: The name of the thread that removes a timing's pages (:func:`_remove_timing_pages`).
CLEANUP_THREAD = "bench-legs-cleanup"


def _remove_timing_pages(connector: Store, store: Store, keys: list[PageKey], scope: KeyScope) -> None:
    """Remove the pages a timing wrote, then close ``store`` (the timed stack over ``connector``).

    Runs on a thread of its own, through the connector without the controller's call timeout: a
    store with read leases refuses a delete until the lease a read took expires (Mooncake's own
    master holds one 10 s, its connector retries that long; behind the 5 s call timeout every
    delete failed, the bench waited for it, and each timing left 1.2 GB in a Mooncake node).
    Every timing writes fresh keys under its own tenant, so ``clear`` of that namespace removes
    them all where the store can; a failure leaves them there, with a warning naming the tenant."""
    try:
        capabilities = connector.capabilities
        if capabilities.clear:
            connector.clear(scope.namespace)
        elif capabilities.delete:
            connector.delete(keys)
    except StorageError as exc:
        log.warning(
            "measuring the store: removing %d timing pages failed (%s); they stay in the store under tenant %r",
            len(keys), exc, scope.namespace.tenant,
        )
    finally:
        store.close()


def wait_for_cleanups(timeout_s: float | None = None) -> None:
    """Wait until the timings' pages are removed (:data:`CLEANUP_THREAD`), each removal at most
    ``timeout_s``: before the store's server stops, or to see the store emptied."""
    for thread in threading.enumerate():
        if thread.name == CLEANUP_THREAD:
            thread.join(timeout_s)


@dataclass(frozen=True)
class Bound:
    """One configuration's legs (seconds of work at the measured speeds) and what they allow."""

    compute_s: float
    storage_s: float
    copies_s: float
    bound_s: float
    #: Which leg sets the bound: ``compute``, ``storage`` or ``copies``.
    limit: str
    wall_s: float
    efficiency: float
    #: The highest input-throughput ratio over L1 these speeds allow at this run's hits.
    bound_vs_l1: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def bound_of(
    metrics: dict[str, float], wall_s: float, legs: Legs, page_bytes: int, l1_wall_s: float | None, side: dict[str, float] | None = None
) -> Bound | None:
    """The bound of one configuration's run from its counters; ``None`` without modeled compute.

    ``side``: a hybrid model's other pools' bytes (``load``, ``backup``, ``storage_read``; the
    engine's counters hold the FULL pool's, and its L3 writes of every pool), charged at the
    speeds measured on the FULL pool.
    """
    if legs.prefill_tokens_per_s is None or legs.decode_step_s is None:
        return None
    side = side or {"load": 0.0, "backup": 0.0, "storage_read": 0.0}
    compute = metrics["computed_tokens"] / legs.prefill_tokens_per_s + metrics["decode_steps"] * legs.decode_step_s
    storage = _seconds(metrics["prefetch_bytes"] + side["storage_read"], legs.storage_read) + _seconds(metrics["storage_backup_bytes"], legs.storage_write)
    copies = (metrics["load_back_bytes"] + side["load"]) / legs.load + (metrics["host_backup_pages"] * page_bytes + side["backup"]) / legs.backup
    legs_s = {"compute": compute, "storage": storage, "copies": copies}
    limit = max(legs_s, key=legs_s.__getitem__)
    bound = legs_s[limit]
    return Bound(
        compute_s=compute,
        storage_s=storage,
        copies_s=copies,
        bound_s=bound,
        limit=limit,
        wall_s=wall_s,
        efficiency=bound / wall_s if wall_s > 0 else 0.0,
        bound_vs_l1=l1_wall_s / bound if l1_wall_s is not None and bound > 0 else None,
    )


def _seconds(size: float, speed: float | None) -> float:
    if not size:
        return 0.0
    if speed is None:
        raise ValueError("the run moved storage bytes but the store's speed was not measured")
    return size / speed
