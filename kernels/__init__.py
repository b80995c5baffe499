"""Transfers between the device KV (layer-first) and the host KV pool, in any host layout.

``load_layer`` (host -> device, one layer), ``load`` (host -> device, all layers) and ``backup``
(device -> host, all layers) run as Triton kernel launches on CUDA (one per layer moved by a load, one
per backup), or with stock torch/numpy copies elsewhere (runs of slots copied in
place when both tensors are on the CPU); see
``dispatch`` for the selection rules and ``layouts`` for the layouts. Importing this package does
not import triton.
"""

from .dispatch import BACKEND_ENV, BACKENDS, backup, load, load_layer, select_backend
from .layouts import KVLayout, host_shape

__all__ = ["BACKENDS", "BACKEND_ENV", "KVLayout", "backup", "host_shape", "load", "load_layer", "select_backend"]
