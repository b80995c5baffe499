"""The transfer API the HiCache core calls: validate, pick a backend, move the slots.

Two backends implement the same operations (per-layer and all-layer load host -> device, all-layer
backup device -> host) for every :class:`~.layouts.KVLayout`:

* ``"triton"``: one kernel launch per call, reading/writing the (pinned) host pool in place.
  The default when ``device_kv`` is on CUDA and triton imports.
* ``"torch"``: the default everywhere else. Between two CPU tensors it copies runs of slots in
  place (``cpu_transfer``); with a device KV elsewhere it stages through ``index_select`` +
  ``index_copy_``.

The choice is visible (every call returns the name of the backend it used) and overridable: the
``backend=`` argument first, then the ``HICACHE_KERNEL_BACKEND`` environment variable
(``torch``, ``triton`` or ``auto``). Asking for Triton where it cannot run is an error, never a
silent fallback; ``auto`` on CUDA falls back to torch only with a logged warning (once per reason).

Calls keep no state of their own and may come from several threads (Triton compiles each kernel
variant on first use). On CUDA they are asynchronous on the caller's current stream
(wrap a call in ``torch.cuda.stream(...)`` to overlap it with compute; record an event to wait
for it); on the CPU they complete before returning.

Index contract: ``host_indices[i]`` goes to ``device_indices[i]`` (or back), 1-D integer tensors
of equal length holding token slot numbers, any order, any page alignment. Indices on the CPU are
bounds-checked; indices already on a CUDA device are trusted (checking them would synchronize
the stream on every layer). Destination slots must be distinct.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import operator
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from hicache_storage.errors import InvalidArgumentError

from . import torch_transfer
from .layouts import KVLayout, TransferGeometry, transfer_geometry

BACKEND_ENV = "HICACHE_KERNEL_BACKEND"
BACKENDS = ("torch", "triton")
_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91  # CUdevice_attribute value in cuda.h

_log = logging.getLogger(__name__)
_warned: set[str] = set()  # fallback reasons already logged: one warning each, not one per layer


def select_backend(device_kv: torch.Tensor, host_kv: torch.Tensor, requested: str | None = None) -> str:
    """Name of the backend a transfer between these tensors uses: ``"triton"`` or ``"torch"``.

    ``requested`` (else ``$HICACHE_KERNEL_BACKEND``) may be ``"torch"``, ``"triton"`` or
    ``"auto"``. Raises ``InvalidArgumentError`` (a ``ValueError``) for any other value, and when
    Triton is requested but cannot run on these tensors (the message says why).
    """
    source = "backend argument"
    choice = requested
    if choice is None and os.environ.get(BACKEND_ENV):
        choice, source = os.environ[BACKEND_ENV], f"${BACKEND_ENV}"
    normalized = "auto" if choice is None else str(choice).strip().lower()
    if normalized == "auto":
        if not device_kv.is_cuda:
            return "torch"
        why_not = _triton_unavailable_reason(device_kv, host_kv)
        if why_not is None:
            return "triton"
        if why_not not in _warned:
            _warned.add(why_not)
            _log.warning("transfers use the torch backend: the Triton kernels cannot run here (%s)", why_not)
        return "torch"
    if normalized not in BACKENDS:
        raise InvalidArgumentError(
            f"unknown kernel backend {choice!r} (from {source}); expected 'torch', 'triton' or 'auto'"
        )
    if normalized == "triton":
        why_not = _triton_unavailable_reason(device_kv, host_kv)
        if why_not is not None:
            raise InvalidArgumentError(
                f"the triton kernel backend was requested (from {source}) but cannot run: {why_not}. "
                "Request 'torch' or 'auto' instead."
            )
    return normalized


def load_layer(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    *,
    layer: int,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    layout: KVLayout | str,
    page_size: int,
    backend: str | None = None,
) -> str:
    """Copy one layer of the listed slots host -> device; returns the backend name used.

    ``device_kv`` is ``(halves, layers, device_slots, heads, head_dim)``; ``host_kv`` has the
    shape ``host_shape(layout, ...)`` gives. Bad shapes, dtypes, layer or indices raise
    ``InvalidArgumentError`` before anything is written.
    """
    def triton(kernels: ModuleType, geometry: TransferGeometry, device_idx: torch.Tensor, host_idx: torch.Tensor) -> None:
        number = operator.index(layer)  # validated by _transfer first
        kernels.load_layer(device_kv, host_kv, geometry, layer=number, device_indices=device_idx, host_indices=host_idx)

    def stock(geometry: TransferGeometry, device_idx: torch.Tensor, host_idx: torch.Tensor) -> None:
        number = operator.index(layer)
        torch_transfer.load_layer(device_kv, host_kv, geometry, layer=number, device_indices=device_idx, host_indices=host_idx)

    return _transfer(device_kv, host_kv, device_indices, host_indices, layout, page_size, backend, triton, stock, layer)


def load(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    layout: KVLayout | str,
    page_size: int,
    backend: str | None = None,
) -> str:
    """Copy every layer of the listed slots host -> device; returns the backend name used.

    What :func:`load_layer` does for each layer, validated once and, between two CPU tensors,
    moved in one pass (a small load of many layers, such as a sliding window's, would otherwise
    pay the per-call cost once per layer). Same shapes and errors as :func:`load_layer`.
    """
    def triton(kernels: ModuleType, geometry: TransferGeometry, device_idx: torch.Tensor, host_idx: torch.Tensor) -> None:
        for layer in range(geometry.layers):
            kernels.load_layer(device_kv, host_kv, geometry, layer=layer, device_indices=device_idx, host_indices=host_idx)

    def stock(geometry: TransferGeometry, device_idx: torch.Tensor, host_idx: torch.Tensor) -> None:
        torch_transfer.load(device_kv, host_kv, geometry, device_indices=device_idx, host_indices=host_idx)

    return _transfer(device_kv, host_kv, device_indices, host_indices, layout, page_size, backend, triton, stock)


def backup(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    layout: KVLayout | str,
    page_size: int,
    backend: str | None = None,
) -> str:
    """Copy every layer of the listed slots device -> host; returns the backend name used.

    Same shapes and errors as :func:`load_layer`.
    """
    def triton(kernels: ModuleType, geometry: TransferGeometry, device_idx: torch.Tensor, host_idx: torch.Tensor) -> None:
        kernels.backup(device_kv, host_kv, geometry, device_indices=device_idx, host_indices=host_idx)

    def stock(geometry: TransferGeometry, device_idx: torch.Tensor, host_idx: torch.Tensor) -> None:
        torch_transfer.backup(device_kv, host_kv, geometry, device_indices=device_idx, host_indices=host_idx)

    return _transfer(device_kv, host_kv, device_indices, host_indices, layout, page_size, backend, triton, stock)


def _transfer(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    layout: KVLayout | str,
    page_size: int,
    backend: str | None,
    triton: Callable[[ModuleType, TransferGeometry, torch.Tensor, torch.Tensor], None],
    stock: Callable[[TransferGeometry, torch.Tensor, torch.Tensor], None],
    layer: object = None,
) -> str:
    """Validate (shapes, ``layer`` when given, indices), pick the backend, run its copy; its name."""
    geometry = transfer_geometry(device_kv, host_kv, layout, page_size)
    if layer is not None:
        _layer_number(layer, geometry.layers)
    device_idx, host_idx = _checked_indices(device_indices, host_indices, geometry)
    name = select_backend(device_kv, host_kv, backend)
    if device_idx.numel():
        if name == "triton":
            device_idx, host_idx = _on_kernel_device(device_kv, device_idx, host_idx)
            with _on_device(device_kv):
                triton(_triton(), geometry, device_idx, host_idx)
        else:
            stock(geometry, device_idx, host_idx)
    return name


def _layer_number(layer: Any, layers: int) -> int:
    try:
        number = operator.index(layer)  # accepts numpy and 0-d integer tensors, not floats or bools
    except TypeError:
        number = None
    if number is None or isinstance(layer, bool) or not 0 <= number < layers:
        raise InvalidArgumentError(f"layer must be an int in [0, {layers}), got {layer!r}")
    return number


def _checked_indices(
    device_indices: torch.Tensor, host_indices: torch.Tensor, geometry: TransferGeometry
) -> tuple[torch.Tensor, torch.Tensor]:
    checked = []
    for name, indices, slots in (
        ("device_indices", device_indices, geometry.device_slots),
        ("host_indices", host_indices, geometry.host_slots),
    ):
        if not isinstance(indices, torch.Tensor):
            raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(indices).__name__}")
        if indices.dim() != 1:
            raise InvalidArgumentError(f"{name} must be 1-D, got shape {tuple(indices.shape)}")
        if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
            raise InvalidArgumentError(f"{name} must hold integers (int64 preferred), got {indices.dtype}")
        indices = indices.to(torch.int64)
        if indices.device.type == "cpu" and indices.numel():
            low, high = int(indices.min()), int(indices.max())
            if low < 0 or high >= slots:
                raise InvalidArgumentError(
                    f"{name} must lie in [0, {slots}) (the tensor's slot count), got values in [{low}, {high}]"
                )
        checked.append(indices)
    if checked[0].numel() != checked[1].numel():
        raise InvalidArgumentError(
            f"device_indices ({checked[0].numel()}) and host_indices ({checked[1].numel()}) "
            "must have the same length: slot i of one pairs with slot i of the other"
        )
    return checked[0], checked[1]


def _on_kernel_device(
    device_kv: torch.Tensor, device_idx: torch.Tensor, host_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel reads both index lists from the device the KV lives on."""
    return (
        device_idx.to(device_kv.device, non_blocking=True).contiguous(),
        host_idx.to(device_kv.device, non_blocking=True).contiguous(),
    )


def _on_device(device_kv: torch.Tensor) -> torch.cuda.device | _NoDevice:
    """Triton launches on the current CUDA device: make it the one holding ``device_kv``."""
    return torch.cuda.device(device_kv.device) if device_kv.is_cuda else _NoDevice()


class _NoDevice:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _triton_unavailable_reason(device_kv: torch.Tensor, host_kv: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot move data between these tensors, or None when they can."""
    try:
        kernels = _triton()
    except ImportError as err:
        return f"triton does not import ({err}); install it with: pip install 'hicache-storage[kernels]'"
    if kernels.is_interpreted():
        if device_kv.is_cuda or host_kv.is_cuda:
            return "TRITON_INTERPRET=1 runs the kernels on CPU tensors only"
        return None
    if not device_kv.is_cuda:
        return (
            f"device_kv is on {device_kv.device}; compiled Triton kernels need a CUDA device_kv "
            "(set TRITON_INTERPRET=1 before importing the kernels to run them on the CPU, slowly)"
        )
    if host_kv.is_cuda:
        if host_kv.device != device_kv.device:
            return f"host_kv is on {host_kv.device} but device_kv on {device_kv.device}"
        return None
    if host_kv.device.type != "cpu" or not host_kv.is_pinned():
        return (
            "host_kv is pageable CPU memory, which the GPU cannot address; allocate the host pool "
            "with pin_memory=True (or register it with cudaHostRegister)"
        )
    if _uses_host_pointers(device_kv.get_device()) is False:
        return (
            f"{device_kv.device} cannot address registered host memory at its host address "
            "(CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM is 0), which the kernel relies on"
        )
    return None


@functools.cache
def _uses_host_pointers(device_index: int) -> bool | None:
    """Whether the GPU reaches page-locked host memory at the host's own addresses (None: unknown).

    The kernel gets one base address for the whole pool (Triton's launcher translates it), so a
    pool registered in several ``cudaHostRegister`` chunks is only addressable as one range when
    device and host addresses coincide. They do on every Linux x86-64 system with a current
    driver; the query guards the rest.
    """
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device, value = ctypes.c_int(), ctypes.c_int()
    if libcuda.cuDeviceGet(ctypes.byref(device), device_index) != 0:
        return None
    if libcuda.cuDeviceGetAttribute(ctypes.byref(value), _CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, device) != 0:
        return None
    return bool(value.value)


@functools.cache
def _triton() -> ModuleType:
    """The Triton backend module, imported on first use (triton is an optional dependency)."""
    from . import triton_transfer

    return triton_transfer
