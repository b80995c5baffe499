"""Helpers for tests that drive a RadixTree directly: freed-slot recorders and slot ranges."""

from __future__ import annotations

import torch

from hicache_core.radix_tree import RadixTree


class Frees:
    """Records the slots a tree frees, per tier; ``tree()`` builds one with a ticking clock."""

    def __init__(self) -> None:
        self.device: list[int] = []
        self.host: list[int] = []

    def tree(self, page_size: int = 2) -> RadixTree:
        ticks = iter(range(10**6))
        return RadixTree(page_size, self.device.extend, self.host.extend, clock=lambda: float(next(ticks)))


def slots(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)
