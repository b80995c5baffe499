"""Device <-> host movement: layer-wise loads with per-layer completion, and device -> host backups.

Both go through :mod:`hicache_storage.kernels`. On CUDA a load runs on its own stream and records
one event per layer; on the CPU a loader thread copies layer after layer and sets one
``threading.Event`` per layer. Either way the model calls :meth:`LayerLoad.wait` before computing
layer ``i`` and waits for layer ``i`` only, so loading overlaps computing the layers before it.

A backup runs off the scheduler thread too: on a CUDA side stream, or on the CPU on a copier
thread (backups in submission order). It returns the copy's completion (a CUDA event or a
:class:`CopyDone`, both with ``query`` and ``synchronize``); the caller keeps the source slots
(locked in the tree) and the destination pages unused until it completes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from hicache_storage import kernels

from hicache_core.op_thread import Wakeup
from hicache_core.pools import DevicePool, HostPool

log = logging.getLogger(__name__)


class LayerLoad:
    """A host -> device load in progress; ``wait(i)`` returns once layer ``i`` has landed."""

    def __init__(self, layers: int, tokens: int, cuda: bool) -> None:
        self.layers = layers
        self.tokens = tokens
        self.cuda = cuda
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._events: list[threading.Event] = [threading.Event() for _ in range(layers)]
        self._cuda_events: list[torch.cuda.Event] = []
        #: When each layer landed (``time.perf_counter``; on CUDA, when it was first seen landed).
        self._landed_at: list[float | None] = [None] * layers

    def ready(self, layer: int) -> bool:
        """Whether layer ``layer`` has landed (or failed: ``wait`` then raises)."""
        if self.cuda:
            return self._cuda_events[layer].query()
        return self._events[layer].is_set()

    def wait(self, layer: int) -> None:
        if self.cuda:
            torch.cuda.current_stream().wait_event(self._cuda_events[layer])
            return
        self._events[layer].wait()
        if self.error is not None:
            raise RuntimeError(f"loading layer {layer} from the host pool failed") from self.error

    def wait_all(self) -> None:
        for layer in range(self.layers):
            self.wait(layer)

    def landed(self) -> bool:
        """Whether every layer has landed (they land in order)."""
        return self.ready(self.layers - 1) if self.layers else True

    def landed_at(self, layer: int) -> float:
        """When layer ``layer`` landed (call once it has: ``ready``)."""
        stamp = self._landed_at[layer]
        if stamp is None:
            stamp = self._landed_at[layer] = time.perf_counter()
        return stamp

    def _land(self, layer: int) -> None:
        self._landed_at[layer] = time.perf_counter()
        self._events[layer].set()


class CopyDone:
    """Completion of a copy run on a CPU thread: the CPU counterpart of a recorded CUDA event."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._done = threading.Event()

    def query(self) -> bool:
        """Whether the copy has finished (successfully or not: see ``error``)."""
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def _set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()


class SerialWorker:
    """One daemon thread running submitted jobs in order (started on first use), notifying
    ``wakeup`` after each."""

    def __init__(self, name: str, wakeup: Wakeup | None = None) -> None:
        self.name = name
        self.wakeup = wakeup
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()
            if self.wakeup is not None:
                self.wakeup.notify()

    def run(self, copy: Callable[[], object]) -> CopyDone:
        """Run ``copy`` on the thread; its completion (an error it raised is kept, never lost)."""
        done = CopyDone()

        def job() -> None:
            started = time.perf_counter()
            try:
                copy()
            except BaseException as exc:
                log.exception("copy on %s failed", self.name)
                done.seconds = time.perf_counter() - started
                done._set(exc)
            else:
                done.seconds = time.perf_counter() - started
                done._set()

        self.submit(job)
        return done

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()


class Transfers:
    """Runs the kernels between one device pool and one host pool; on the CPU, each copy that
    ends notifies ``wakeup``."""

    def __init__(self, device: DevicePool, host: HostPool, kernel_backend: str | None = None, wakeup: Wakeup | None = None) -> None:
        self.device = device
        self.host = host
        self.kernel_backend = kernel_backend
        self.cuda = device.kv.is_cuda
        self._load_stream = torch.cuda.Stream(device.device) if self.cuda else None
        self._write_stream = torch.cuda.Stream(device.device) if self.cuda else None
        self._loader = SerialWorker("hicache-load", wakeup)
        self._copier = SerialWorker("hicache-backup-copy", wakeup)

    def backup(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> torch.cuda.Event | CopyDone:
        """Start copying every layer of the slots device -> host; returns the copy's completion.

        On CUDA the copy runs on a side stream (a CUDA event); on the CPU on the copier thread
        (a :class:`CopyDone`). Neither the source slots nor the destination pages may be reused
        before it completes.
        """
        if not self.cuda:
            return self._copier.run(lambda: self._backup(device_indices, host_indices))
        assert self._write_stream is not None
        self._write_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._write_stream):
            self._backup(device_indices, host_indices)
            event = torch.cuda.Event()
            event.record()
        return event

    def _backup(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        kernels.backup(
            self.device.kv,
            self.host.kv,
            device_indices=device_indices,
            host_indices=host_indices,
            layout=self.host.layout,
            page_size=self.host.page_size,
            backend=self.kernel_backend,
        )

    def load(self, device_indices: torch.Tensor, host_indices: torch.Tensor, on_done: Callable[[LayerLoad], None]) -> LayerLoad:
        """Start loading the slots host -> device, layer by layer; ``on_done`` gets the finished load."""
        layers = self.device.geometry.layers
        load = LayerLoad(layers, int(device_indices.numel()), self.cuda)
        if self.cuda:
            self._load_cuda(load, device_indices, host_indices)
            on_done(load)
            return load

        def job() -> None:
            started = time.perf_counter()
            try:
                for layer in range(layers):
                    self._load_layer(layer, device_indices, host_indices)
                    load._land(layer)
            except BaseException as exc:  # the waiting forward must not hang: release every layer
                log.exception("layer-wise load failed")
                load.error = exc
            finally:
                load.seconds = time.perf_counter() - started
                for layer, event in enumerate(load._events):
                    if not event.is_set():
                        load._land(layer)
                on_done(load)

        self._loader.submit(job)
        return load

    def load_now(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        """Load every layer of the slots host -> device in one kernel call on this thread (on CUDA:
        queued on the current stream, before the compute that reads them). For small loads waited
        for at once, such as a sliding window at a resume point: a layer-wise load there costs a
        thread hand-off and a call per layer, more than the bytes (43 layers of a 3-page window took
        30 ms on the 2-core bench machine, the bytes alone about 2)."""
        kernels.load(
            self.device.kv,
            self.host.kv,
            device_indices=device_indices,
            host_indices=host_indices,
            layout=self.host.layout,
            page_size=self.host.page_size,
            backend=self.kernel_backend,
        )

    def _load_cuda(self, load: LayerLoad, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        assert self._load_stream is not None
        started = time.perf_counter()
        # Slots may have just been freed by requests whose kernels are still queued on the compute stream.
        self._load_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._load_stream):
            for layer in range(load.layers):
                self._load_layer(layer, device_indices, host_indices)
                event = torch.cuda.Event()
                event.record()
                load._cuda_events.append(event)
        load.seconds = time.perf_counter() - started

    def _load_layer(self, layer: int, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        kernels.load_layer(
            self.device.kv,
            self.host.kv,
            layer=layer,
            device_indices=device_indices,
            host_indices=host_indices,
            layout=self.host.layout,
            page_size=self.host.page_size,
            backend=self.kernel_backend,
        )

    def close(self) -> None:
        self._loader.close()
        self._copier.close()
