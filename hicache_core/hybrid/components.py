"""The components of a hybrid model's cache, each with its own rules on the one radix tree.

The tree's own values are the full-attention KV (FULL): every token of a path, on the device
and/or the host. Beside it:

* :class:`SlidingWindow` (SWA): sliding-window layers read only the ``context_tokens`` tokens
  before a position, so resuming at a boundary needs the SWA KV of just that tail. Each node
  holds its tokens' SWA slots per tier or nothing (a tombstone): the node stays on the FULL
  path, and only boundaries whose window reaches into it are rejected.
* :class:`RecurrentState` (MAMBA): a recurrent layer's state is valid only at the exact boundary
  where it was taken. Each node holds at most one checkpoint per tier, the state after its last
  token. A request copies it to a private slot before running on (the checkpoint stays intact).

Both keep their state per node in :class:`Copies` (slots on the device and host pools they own)
and evict it themselves in the tree's order (unreferenced by sessions, then least recently used
first), never from a locked node. The FULL KV decides where a node exists; a component's state
without it is freed with the node.

Single-threaded, like the tree: the engine's scheduler owns both.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hicache_core.pools import PageAllocator
from hicache_core.radix_tree import RadixTree, TreeNode


@dataclass
class Copies:
    """A component's state in one node: its slots on the device and on the host (``None``: absent)."""

    device: torch.Tensor | None = None
    host: torch.Tensor | None = None

    def on(self, device: bool) -> torch.Tensor | None:
        return self.device if device else self.host


class PooledComponent:
    """State in slots of a device allocator and a host allocator, kept per node and evicted LRU.

    Subclasses say how a split divides the slots (``split``) and when a boundary is usable
    (``accepts``). ``free_*`` hand slots back to the allocators; the tree calls ``release``.
    """

    name = "component"

    def __init__(self, device_allocator: PageAllocator, host_allocator: PageAllocator | None) -> None:
        self.device_allocator = device_allocator
        self.host_allocator = host_allocator
        self.tree: RadixTree | None = None

    # --- per-node state --------------------------------------------------------------------

    def copies(self, node: TreeNode) -> Copies | None:
        return node.components.get(self.name)  # type: ignore[return-value]

    def slots(self, node: TreeNode, device: bool) -> torch.Tensor | None:
        copies = self.copies(node)
        return None if copies is None else copies.on(device)

    def present(self, node: TreeNode, device: bool) -> bool:
        """Whether ``node`` holds this state on the device (``device``) or on either tier."""
        copies = self.copies(node)
        return copies is not None and (copies.device is not None or (not device and copies.host is not None))

    def set(self, node: TreeNode, slots: torch.Tensor, device: bool) -> None:
        """Give ``node`` these slots on a tier where it holds none (the node owns them from now on)."""
        copies = node.components.setdefault(self.name, Copies())
        assert isinstance(copies, Copies) and copies.on(device) is None, f"{node} already holds {self.name} there"
        if device:
            copies.device = slots
        else:
            copies.host = slots

    def drop(self, node: TreeNode, device: bool) -> int:
        """Free ``node``'s slots on one tier (a tombstone: the node stays); returns the slots freed."""
        copies = self.copies(node)
        slots = None if copies is None else copies.on(device)
        if copies is None or slots is None:
            return 0
        if device:
            copies.device = None
            self.device_allocator.free(slots)
        else:
            copies.host = None
            assert self.host_allocator is not None
            self.host_allocator.free(slots)
        if copies.device is None and copies.host is None:
            del node.components[self.name]
        return int(slots.numel())

    # --- the tree's hooks ------------------------------------------------------------------

    def split(self, upper: TreeNode, lower: TreeNode, length: int) -> None:
        raise NotImplementedError

    def accepts(self, node: TreeNode, on_device: bool) -> bool:
        raise NotImplementedError

    def release(self, node: TreeNode) -> None:
        self.drop(node, True)
        self.drop(node, False)

    # --- memory ----------------------------------------------------------------------------

    def alloc(self, count: int, device: bool) -> torch.Tensor | None:
        """``count`` slots on a tier, evicting this component's least recently used state if needed."""
        allocator = self.device_allocator if device else self.host_allocator
        assert allocator is not None
        return allocator.alloc_evicting(count, lambda _: self.evict(count, device))

    def evict(self, count: int, device: bool) -> int:
        """Tombstone unlocked nodes' state on one tier until ``count`` slots are free: nodes no
        session references first, each group least recently used first (as the tree evicts)."""
        assert self.tree is not None, f"{self.name} is not attached to a tree"
        allocator = self.device_allocator if device else self.host_allocator
        assert allocator is not None
        referenced = self.tree.settle_recency()
        candidates = sorted(
            (n for n in self._holders(device) if n.lock_ref == 0 and (device or n.host_ref == 0)),
            key=lambda n: (n in referenced, n.last_access, n.id),
        )
        freed = 0
        for node in candidates:
            if allocator.free_pages * allocator.page_size >= count:
                break
            freed += self.drop(node, device)
        return freed

    def _holders(self, device: bool) -> Iterator[TreeNode]:
        assert self.tree is not None
        return (n for n in self.tree.nodes() if self.slots(n, device) is not None)


class SlidingWindow(PooledComponent):
    """Sliding-window KV: a boundary is usable when the ``context_tokens`` tokens before it have it.

    Slots are per token, like the FULL KV; a split cuts a node's slots where it cuts its tokens.
    """

    name = "swa"

    def __init__(self, context_tokens: int, device_allocator: PageAllocator, host_allocator: PageAllocator | None) -> None:
        super().__init__(device_allocator, host_allocator)
        self.context_tokens = context_tokens

    def split(self, upper: TreeNode, lower: TreeNode, length: int) -> None:
        copies = self.copies(lower)
        if copies is None:
            return
        upper.components[self.name] = Copies(
            None if copies.device is None else copies.device[:length],
            None if copies.host is None else copies.host[:length],
        )
        copies.device = None if copies.device is None else copies.device[length:]
        copies.host = None if copies.host is None else copies.host[length:]

    def accepts(self, node: TreeNode, on_device: bool) -> bool:
        return all(self.present(n, on_device) for n in self.window(node))

    def insert(self, path: list[TreeNode], start: int, slots: torch.Tensor) -> list[torch.Tensor]:
        """Give each node of ``path`` from position ``start`` on its tokens' part of ``slots``
        (device SWA slots of positions ``start, start + 1, ...``) where it holds none on the
        device; returns the parts not taken, for the caller to free."""
        unused = []
        for node in path:
            begin = node.end - len(node.key)
            if begin < start:
                continue
            part = slots[begin - start : node.end - start]
            if self.present(node, device=True):
                unused.append(part)
            else:
                self.set(node, part, device=True)
        return unused

    def window(self, node: TreeNode) -> list[TreeNode]:
        """The nodes holding the ``context_tokens`` tokens before ``node.end``, top down."""
        assert self.tree is not None
        start = node.end - self.context_tokens
        nodes: list[TreeNode] = []
        while node is not self.tree.root and node.end > start:
            nodes.append(node)
            node = node.parent  # type: ignore[assignment]
        nodes.reverse()
        return nodes


class RecurrentState(PooledComponent):
    """Recurrent-state checkpoints: one slot per node per tier, valid only at the node's end.

    A split leaves the checkpoint on the lower node (it keeps the end); the new upper node has
    none. The root needs none (the state before any token is the model's initial state).
    """

    name = "mamba"

    def split(self, upper: TreeNode, lower: TreeNode, length: int) -> None:
        return None

    def accepts(self, node: TreeNode, on_device: bool) -> bool:
        return self.present(node, on_device)

    def insert(self, last: TreeNode, snapshots: dict[int, torch.Tensor], device_states: torch.Tensor) -> None:
        """Keep each snapshot (the state after ``position`` tokens of ``last``'s path) as the
        device checkpoint of the node ending there, cutting a node if needed; a boundary that
        has one already keeps it, and one whose slot cannot be found stays without."""
        assert self.tree is not None
        for position, state in sorted(snapshots.items()):
            holder = self.tree.boundary(last, position)
            if self.present(holder, device=True):
                continue
            slot = self.alloc(1, device=True)
            if slot is None:
                continue
            device_states[slot] = state
            self.set(holder, slot, device=True)


def attach(tree: RadixTree, components: tuple[PooledComponent, ...]) -> None:
    """Let each component find the tree it is part of (for its window walks and eviction)."""
    for component in components:
        component.tree = tree
