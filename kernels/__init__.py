"""Triton transfer kernels between device and host KV layouts, with a torch fallback."""
