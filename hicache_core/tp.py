"""Agreement between tensor-parallel ranks, so every rank makes the same cache decisions.

Each TP rank runs its own scheduler, tree and controller over its shard of the KV. Whatever
depends on timing (how many prefetched pages arrived, whether a backup finished) must be agreed
before it changes the tree, or the ranks' trees diverge and their collectives deadlock:

* hit lengths and completed counts: all-reduce **MIN** (use only what every rank has);
* "keep waiting" flags: all-reduce **MAX** (stop only when no rank needs to wait, i.e. terminate
  together).

Collectives must run in the same order on every rank. The scheduler thread and the prefetch
thread each get their own process group, so their collectives never interleave.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class RankGroup:
    """A single process: every reduction is the identity."""

    rank = 0
    size = 1

    def all_min(self, value: int) -> int:
        return value

    def all_max(self, value: int) -> int:
        return value


class TorchRankGroup(RankGroup):
    """Reductions over a ``torch.distributed`` process group (gloo: CPU tensors)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def _reduce(self, value: int, op: Any) -> int:
        import torch

        tensor = torch.tensor([int(value)], dtype=torch.int64)
        self._dist.all_reduce(tensor, op=op, group=self._group)
        return int(tensor.item())

    def all_min(self, value: int) -> int:
        return self._reduce(value, self._dist.ReduceOp.MIN)

    def all_max(self, value: int) -> int:
        return self._reduce(value, self._dist.ReduceOp.MAX)


@dataclass(frozen=True)
class TPContext:
    """This rank's place in the TP group and the groups its two threads reduce over."""

    rank: int = 0
    size: int = 1
    scheduler: RankGroup = RankGroup()
    prefetch: RankGroup = RankGroup()

    @classmethod
    def from_torch_distributed(cls) -> TPContext:
        """Two gloo groups over every rank of the initialized default group (collective: call on all ranks)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
        ranks = list(range(dist.get_world_size()))
        scheduler = TorchRankGroup(dist.new_group(ranks, backend="gloo"))
        prefetch = TorchRankGroup(dist.new_group(ranks, backend="gloo"))
        return cls(dist.get_rank(), dist.get_world_size(), scheduler, prefetch)
