"""Where a hybrid component's state lives: slots on the device and the host, and the copies between them.

:class:`KVMemory` is a KV-shaped pool pair (sliding-window KV); :class:`StateMemory` one state
tensor per slot (recurrent checkpoints). Either follows :class:`SlotMemory`, which is all a
component (:mod:`.components`) needs to move its state between the tiers and to hand it to L3.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from hicache_core.op_thread import Wakeup
from hicache_core.pools import DevicePool, HostPool, KVGeometry, PageAllocator
from hicache_core.transfer import SerialWorker, Transfers


class SlotMemory(Protocol):
    """Where a component's slots live: copies between the tiers and the host slots as L3 values."""

    device_allocator: PageAllocator
    host_allocator: PageAllocator | None

    def to_host(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> Any:
        """Start the copy; its completion (``query``, ``synchronize``), or None when it is done."""
        ...

    def to_device(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None: ...

    def host_buffers(self, host_slots: torch.Tensor) -> list[Any]:
        """One L3 value per page (``allocator.page_size`` slots) of ``host_slots``."""
        ...


class KVMemory:
    """A KV-shaped pool on the device and (optionally) the host, with the copies between them."""

    def __init__(
        self,
        geometry: KVGeometry,
        page_size: int,
        device_pages: int,
        host_pages: int | None,
        layout: str,
        device: str | None,
        wakeup: Wakeup | None = None,
    ) -> None:
        self.device = DevicePool(geometry, device_pages, page_size, device)
        self.host = HostPool(geometry, page_size, layout, num_pages=host_pages) if host_pages else None
        self.transfers = Transfers(self.device, self.host, wakeup=wakeup) if self.host is not None else None
        self.device_allocator = self.device.allocator
        self.host_allocator = self.host.allocator if self.host is not None else None

    def to_host(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> Any:
        assert self.transfers is not None
        return self.transfers.backup(device_slots, host_slots)

    def to_device(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        assert self.transfers is not None
        self.transfers.load_now(device_slots, host_slots)

    def host_buffers(self, host_slots: torch.Tensor) -> list[Any]:
        assert self.host is not None
        return self.host.segments_for(host_slots)

    def close(self) -> None:
        if self.transfers is not None:
            self.transfers.close()
        if self.host is not None:
            self.host.close()


class StateMemory:
    """Recurrent-state checkpoints: one ``shape`` tensor per slot, on the device and the host.

    A device -> host copy runs off the calling thread, as the KV pools' backups do: on a CUDA side
    stream (into pinned host memory), or on the CPU on a copier thread. A checkpoint is megabytes
    (4.1 MB for the bench's recurrent shape), and the scheduler backing one up per boundary
    spent seconds of a bench run in these copies when they were synchronous.
    """

    def __init__(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        device_slots: int,
        host_slots: int | None,
        device: torch.device,
        wakeup: Wakeup | None = None,
    ) -> None:
        self.device = torch.zeros((device_slots, *shape), dtype=dtype, device=device)
        cuda = self.device.is_cuda
        self.host = torch.zeros((host_slots or 0, *shape), dtype=dtype, pin_memory=cuda and bool(host_slots))
        self.device_allocator = PageAllocator(device_slots, 1)
        self.host_allocator = PageAllocator(host_slots, 1) if host_slots else None
        self._stream = torch.cuda.Stream(self.device.device) if cuda else None
        self._copier = SerialWorker("hicache-checkpoint-copy", wakeup)

    def to_host(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> Any:
        pairs = list(zip(device_slots.tolist(), host_slots.tolist()))
        if self._stream is not None:
            # Checkpoints written by the compute stream before this call are complete first.
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                for source, target in pairs:
                    self.host[target].copy_(self.device[source], non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            return event
        return self._copier.run(lambda: [self.host[target].copy_(self.device[source]) for source, target in pairs])

    def to_device(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        self.device[device_slots] = self.host[host_slots].to(self.device.device)

    def host_buffers(self, host_slots: torch.Tensor) -> list[Any]:
        return [self.host[int(slot)] for slot in host_slots.tolist()]

    def close(self) -> None:
        self._copier.close()
