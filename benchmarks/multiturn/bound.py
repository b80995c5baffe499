"""The bound a bench run is held to: how fast its legs allow it to be, measured in the same run.

Before the tier configurations run and again after them (the faster of the two counts),
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

import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from hicache_storage.keys import KeyScope, Namespace
from hicache_storage.registry import create_backend

from hicache_core.controller import CacheController
from hicache_core.engine import EngineConfig
from hicache_core.metrics import CacheMetrics
from hicache_core.model import ModelConfig
from hicache_core.pools import DevicePool, HostPool
from hicache_core.radix_tree import RadixTree

#: Pages per timed call: one full storage batch of the engine, and the size of one copy.
LEG_PAGES = 64


@dataclass(frozen=True)
class Legs:
    """Speeds in bytes per second (``None``: not measured), and the modeled compute."""

    storage_write: float | None
    storage_read: float | None
    backup: float
    load: float
    prefill_tokens_per_s: float | None
    decode_step_s: float | None

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
        )


def measure_legs(config: EngineConfig, repeats: int = 5) -> Legs:
    """Time the copies and (when ``config`` has L3) the store the engine of ``config`` would use.

    Each speed is the fastest of ``repeats`` timings: the bound is the least time the legs allow,
    so a slow repeat (another process, the kernel writing back a previous configuration's files)
    must not lower it. With the median of three, the store's write speed read 0.18-0.33 GB/s in
    the recurrent shape's runs (0.57 GB/s measured alone) and runs came out faster than their
    "bound" (efficiency 1.06-1.26).

    Uses its own pools (``LEG_PAGES`` pages) and its own namespace in the store (a fresh tenant;
    pages deleted afterwards where the store can), so it leaves the run's cache untouched.
    """
    if not isinstance(config.model, ModelConfig):
        raise TypeError(f"the legs are timed on a full-attention pool, not a {type(config.model).__name__}: pass the full pool's model")
    geometry = config.model.geometry
    device = DevicePool(geometry, 2 * LEG_PAGES, config.page_size, config.device)
    host = HostPool(geometry, config.page_size, config.layout, num_pages=LEG_PAGES, device_pool=device)
    tree = RadixTree(config.page_size, device.allocator.free, host.allocator.free)
    controller = CacheController(config.controller, tree, device, host, metrics=CacheMetrics())
    try:
        backup, load = _copy_speeds(controller, device, host, repeats)
        write = read = None
        if config.tiers.storage and config.storage_backend is not None:
            write, read = _storage_speeds(controller, config.storage_backend, config, host, repeats)
    finally:
        controller.close()
        host.close()
    compute = config.compute
    return Legs(
        storage_write=write,
        storage_read=read,
        backup=backup,
        load=load,
        prefill_tokens_per_s=compute.prefill_tokens_per_s if compute else None,
        decode_step_s=compute.decode_step_s if compute else None,
    )


def _copy_speeds(controller: CacheController, device: DevicePool, host: HostPool, repeats: int) -> tuple[float, float]:
    """Backup and load speeds over ``LEG_PAGES`` pages scattered in the device pool, as the engine moves them."""
    assert controller.transfers is not None
    generator = torch.Generator().manual_seed(0)
    device_pages = torch.randperm(device.allocator.num_pages, generator=generator)[:LEG_PAGES]
    device_slots = device.allocator.slots_of(device_pages)
    host_slots = host.allocator.slots_of(torch.arange(LEG_PAGES))
    size = LEG_PAGES * host.page_bytes
    backups, loads = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        controller.transfers.backup(device_slots, host_slots).synchronize()
        backups.append(size / (time.perf_counter() - started))
        started = time.perf_counter()
        controller.transfers.load(device_slots, host_slots, lambda load: None).wait_all()
        loads.append(size / (time.perf_counter() - started))
    return max(backups), max(loads)


def _storage_speeds(controller: CacheController, backend: str, config: EngineConfig, host: HostPool, repeats: int) -> tuple[float, float]:
    """Write and read speeds of whole pages between host-pool views and ``backend`` (``config``'s
    store), as the controller calls it."""
    store = controller.storage_stack(create_backend(backend, config.storage_config))
    try:
        store.register_buffer(host.as_buffer())
        scope = KeyScope(
            Namespace(f"bench-legs-{config.model.name}", host.geometry.dtype_name, config.page_size,
                      config.layout, tenant=f"legs-{uuid.uuid4().hex[:12]}")
        )
        segments = host.segments_for(host.allocator.slots_of(torch.arange(LEG_PAGES)))
        size = LEG_PAGES * host.page_bytes
        writes, reads = [], []
        for attempt in range(repeats):
            keys = scope.keys([f"{attempt:08x}{page:056x}" for page in range(LEG_PAGES)])
            started = time.perf_counter()
            stored = store.put_from(keys, segments)
            writes.append(size / (time.perf_counter() - started))
            started = time.perf_counter()
            read = store.get_into(keys, segments)
            reads.append(size / (time.perf_counter() - started))
            if not (all(stored) and all(read)):
                raise RuntimeError(
                    f"measuring the store: {stored.count(False)} of {LEG_PAGES} writes and {read.count(False)} reads "
                    "failed; a store that refuses pages of this size cannot back the bench (see its capacity)"
                )
            if store.capabilities.delete:
                store.delete(keys)
        return max(writes), max(reads)
    finally:
        store.close()


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
