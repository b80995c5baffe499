"""Caller-owned page buffers, normalized to flat byte views.

A page travels as a list of *segments*: contiguous byte ranges whose concatenation is the page's
value. A page-first MHA host pool gives two segments per page (its K and V halves), an MLA pool
one, a layer-first pool one per layer and half. Connectors receive ``list[memoryview]`` per page,
each view 1-D, format ``"B"``, C-contiguous; for reads, writable.

Accepted inputs, per page: any object with the buffer protocol (bytes, bytearray, memoryview,
numpy arrays, mmap), a contiguous CPU ``torch.Tensor``, a :class:`RawBuffer` (address + size, as
SGLang's ``get_page_buffer_meta`` returns), or a list/tuple of those.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, NamedTuple, Union

from hicache_storage.errors import InvalidArgumentError

Segments = list[memoryview]


class RawBuffer(NamedTuple):
    """A region of memory the caller owns and keeps alive for the duration of the call."""

    ptr: int
    size: int


BufferLike = Union[Any, RawBuffer]


def as_view(obj: BufferLike, *, writable: bool) -> memoryview:
    """One flat byte view over ``obj`` without copying; raises ``InvalidArgumentError`` otherwise."""
    if isinstance(obj, memoryview) and obj.format == "B" and obj.ndim == 1 and obj.c_contiguous:
        view = obj
    elif isinstance(obj, RawBuffer):
        if obj.ptr <= 0 or obj.size < 0:
            raise InvalidArgumentError(f"RawBuffer needs a non-null address and a size >= 0, got {obj}")
        view = memoryview((ctypes.c_ubyte * obj.size).from_address(obj.ptr)).cast("B")
    elif type(obj).__module__.startswith("torch"):
        view = _tensor_view(obj)
    else:
        try:
            view = memoryview(obj)
        except TypeError:
            raise InvalidArgumentError(
                f"a page buffer must support the buffer protocol (bytes, bytearray, memoryview, numpy array), "
                f"be a CPU torch.Tensor or a RawBuffer; got {type(obj).__name__}"
            ) from None
        if not view.c_contiguous:
            raise InvalidArgumentError("a page buffer must be C-contiguous; pass a contiguous copy or view")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
    if writable and view.readonly:
        raise InvalidArgumentError(f"a read target must be writable; got a read-only {type(obj).__name__}")
    return view


def _tensor_view(tensor: Any) -> memoryview:
    if tensor.device.type != "cpu":
        raise InvalidArgumentError(
            f"page buffers must be in host memory; got a tensor on {tensor.device}. Stage it in the host pool first."
        )
    if not tensor.is_contiguous():
        raise InvalidArgumentError("a page buffer tensor must be contiguous")
    import torch

    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def as_segments(page: BufferLike | Sequence[BufferLike], *, writable: bool) -> Segments:
    """Normalize one page's buffer(s) to a list of flat byte views (see the module docstring)."""
    if isinstance(page, (list, tuple)) and not isinstance(page, RawBuffer):
        return [as_view(part, writable=writable) for part in page]
    return [as_view(page, writable=writable)]


def segments_size(segments: Segments) -> int:
    return sum(view.nbytes for view in segments)


def fill_segments(segments: Segments, data: bytes | bytearray | memoryview) -> None:
    """Copy ``data`` across ``segments`` in order; ``len(data)`` must equal their total size."""
    source = memoryview(data).cast("B")
    offset = 0
    for view in segments:
        n = view.nbytes
        view[:] = source[offset : offset + n]
        offset += n


def join_segments(segments: Segments) -> bytes | memoryview:
    """The page's bytes as one object; a single segment is returned as is (no copy)."""
    if len(segments) == 1:
        return segments[0]
    return b"".join(segments)
