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

Given its memory (:mod:`.memory`: :class:`KVMemory` for SWA KV, :class:`StateMemory` for checkpoints), a
component also moves its state between the tiers for the cache controller and the prefetcher
(:class:`hicache_core.side_pools.TieredComponent`): it backs a node's state up to the host,
names the L3 pages holding it (pool ``swa``: one page per page of the node; pool ``mamba``: one
value under the node's last page), places state fetched from L3 at a cut, and brings a resume
point's state to the device.

Single-threaded, like the tree: the engine's scheduler owns both (the prefetch and backup threads
only read and write host slots they were handed, pinned).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hicache_storage.multipool import HitPolicy, PoolSpec

from hicache_core.hybrid.memory import KVMemory, SlotMemory, StateMemory
from hicache_core.pools import PageAllocator
from hicache_core.radix_tree import RadixTree, TreeNode
from hicache_core.side_pools import PendingCopy


@dataclass
class Copies:
    """A component's state in one node: its slots on the device and on the host (``None``: absent)."""

    device: torch.Tensor | None = None
    host: torch.Tensor | None = None

    def on(self, device: bool) -> torch.Tensor | None:
        return self.device if device else self.host


class PooledComponent(ABC):
    """State in slots of a device allocator and a host allocator, kept per node and evicted LRU.

    Subclasses say how a split divides the slots (``split``), when a boundary is usable
    (``accepts``), and how L3 names and places the state (``pool_spec``, ``stored_hashes``,
    ``place``). ``free_*`` hand slots back to the allocators; the tree calls ``release``.
    """

    name = "component"

    def __init__(
        self, device_allocator: PageAllocator, host_allocator: PageAllocator | None, memory: SlotMemory | None = None
    ) -> None:
        self.device_allocator = device_allocator
        self.host_allocator = host_allocator
        #: The slots' memory; a component without one keeps state in the tree only (no tier copies).
        self.memory = memory
        #: Write-back: device state is copied to the host when it is evicted (as the FULL KV is).
        self.write_back = False
        self.tree: RadixTree | None = None

    # --- per-node state --------------------------------------------------------------------

    def copies(self, node: TreeNode) -> Copies | None:
        return node.components.get(self.name)  # type: ignore[return-value]  # this component keeps only Copies under its name

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

    @abstractmethod
    def split(self, upper: TreeNode, lower: TreeNode, length: int) -> None:
        """``lower`` was cut after ``length`` tokens: give ``upper`` its part of the state."""

    @abstractmethod
    def accepts(self, node: TreeNode, on_device: bool) -> bool:
        """Whether a request can resume at ``node.end`` with this state (see ``Component.accepts``)."""

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
            (n for n in self._holders(device) if self._evictable(n, device)),
            key=lambda n: (n in referenced, n.last_access, n.id),
        )
        freed = 0
        for node in candidates:
            if allocator.free_pages * allocator.page_size >= count:
                break
            if device and self.write_back:
                self.back_up(node)
            freed += self.drop(node, device)
        return freed

    def _evictable(self, node: TreeNode, device: bool) -> bool:
        """Whether ``node``'s state on a tier may be dropped: never from a locked node (a running
        request's path), nor from the host while I/O is in flight."""
        return node.lock_ref == 0 and (device or node.host_ref == 0)

    def _holders(self, device: bool) -> Iterator[TreeNode]:
        assert self.tree is not None
        return (n for n in self.tree.nodes() if self.slots(n, device) is not None)

    # --- tier copies (the controller's and the prefetcher's side of a component) --------------

    @abstractmethod
    def pool_spec(self, page_size: int) -> PoolSpec:
        """How L3 holds this state: its pool's key part and hit policy."""

    @abstractmethod
    def stored_hashes(self, node: TreeNode) -> list[str]:
        """The page hashes naming ``node``'s state in L3, one per value of ``host_buffers``."""

    def back_up(self, node: TreeNode, pending: list[PendingCopy] | None = None) -> bool:
        """Copy ``node``'s device state to new host slots if the host lacks it; whether it did.

        A copy running off this thread is waited for, or, with ``pending``, appended there: its
        device source is kept (``hold``) until the caller ``settle``s it. The caller keeps the
        node's host state from being read or evicted until then (it locks the node).
        """
        copies = self.copies(node)
        if copies is None or copies.device is None or copies.host is not None or self.host_allocator is None:
            return False
        assert self.memory is not None
        slots = self.alloc(int(copies.device.numel()), device=False)
        if slots is None:
            return False
        done = self.memory.to_host(copies.device, slots)
        self.set(node, slots, device=False)
        if done is not None:
            if pending is None:
                done.synchronize()
                self._copied(node, node.end - len(node.key), getattr(done, "error", None) is not None, held=False)
            else:
                begin = node.end - len(node.key)
                self.hold(node)
                pending.append(PendingCopy(done, lambda failed: self._copied(node, begin, failed, held=True)))
        return True

    def hold(self, node: TreeNode) -> None:
        """Keep ``node``'s device state while a copy reads it (nothing to do where locks keep it)."""

    def release_hold(self, node: TreeNode) -> None:
        """Undo one ``hold``."""

    def _copied(self, node: TreeNode, begin: int, failed: bool, *, held: bool) -> None:
        """A copy of the state of positions ``[begin, node.end)`` to the host completed. A split
        meanwhile moved part of it into ancestors: each part is settled."""
        assert self.tree is not None
        parts = self.tree.path(node) if self.tree.in_tree(node) else [node]
        for part in parts:
            if part.end - len(part.key) < begin:
                continue
            if held:
                self.release_hold(part)
            if failed:  # the host slots hold a partial copy: never serve them
                self.drop(part, device=False)

    def stored_pages(self, node: TreeNode) -> tuple[list[str], list[Any], torch.Tensor] | None:
        """``node``'s host state as L3 pages: hashes, one value each, and the host slots they read."""
        slots = self.slots(node, device=False)
        if slots is None:
            return None
        assert self.memory is not None
        return self.stored_hashes(node), self.memory.host_buffers(slots), slots

    def reserve(self, pages: int) -> torch.Tensor | None:
        """Host slots for ``pages`` of this component's L3 values (a fetch reads into them)."""
        assert self.host_allocator is not None
        return self.alloc(pages * self.host_allocator.page_size, device=False)

    def fetch_buffers(self, slots: torch.Tensor) -> list[Any]:
        assert self.memory is not None
        return self.memory.host_buffers(slots)

    @abstractmethod
    def place(self, node: TreeNode, slots: torch.Tensor) -> None:
        """Give state fetched for a cut at ``node.end`` (the trailing pages' values, in
        ``slots``) to the nodes it belongs to; slots a node already has state for are freed."""

    def materialize(self, node: TreeNode) -> bool:
        """Bring to the device what resuming at ``node.end`` needs; False if device memory is short."""
        return True

    def free_host(self, slots: torch.Tensor) -> None:
        assert self.host_allocator is not None
        self.host_allocator.free(slots)


class SlidingWindow(PooledComponent):
    """Sliding-window KV: a boundary is usable when the ``context_tokens`` tokens before it have it.

    Slots are per token, like the FULL KV; a split cuts a node's slots where it cuts its tokens.
    """

    name = "swa"

    def __init__(
        self,
        context_tokens: int,
        device_allocator: PageAllocator,
        host_allocator: PageAllocator | None,
        memory: SlotMemory | None = None,
    ) -> None:
        super().__init__(device_allocator, host_allocator, memory)
        self.context_tokens = context_tokens
        #: Running requests reading each node's device SWA KV (the window before their resume
        #: point): only those nodes keep it. Other nodes on a running request's (locked) path may
        #: lose it, as sliding-window layers never read it again while the request runs.
        self._readers: dict[TreeNode, int] = {}

    @classmethod
    def on(cls, memory: KVMemory, context_tokens: int) -> SlidingWindow:
        """A window over ``memory``'s pools (their allocators are the component's)."""
        return cls(context_tokens, memory.device_allocator, memory.host_allocator, memory)

    def pool_spec(self, page_size: int) -> PoolSpec:
        return PoolSpec(self.name, HitPolicy.TRAILING_PAGES, max(1, -(-self.context_tokens // page_size)))

    def stored_hashes(self, node: TreeNode) -> list[str]:
        return list(node.page_hashes)

    def place(self, node: TreeNode, slots: torch.Tensor) -> None:
        assert self.tree is not None
        start = node.end - int(slots.numel())
        self.tree.boundary(node, start)  # the fetched pages start a node
        unused = []
        for n in self.tree.path(node):
            begin = n.end - len(n.key)
            if begin < start:
                continue
            part = slots[begin - start : n.end - start]
            if self.slots(n, device=False) is None:
                self.set(n, part, device=False)
            else:
                unused.append(part)
        if unused:
            self.free_host(torch.cat(unused))

    def read(self, node: TreeNode) -> list[TreeNode]:
        """Mark the window before ``node.end`` as read by a running request (``unread`` ends it):
        its device SWA KV stays. The window is cut to start a node; returns its nodes."""
        assert self.tree is not None
        page_size = self.device_allocator.page_size
        self.tree.boundary(node, max(0, node.end - self.context_tokens) // page_size * page_size)
        window = self.window(node)
        for n in window:
            self.hold(n)
        return window

    def materialize(self, node: TreeNode) -> bool:
        """Bring the window before ``node.end`` to the device and ``read`` it; False (nothing
        read) if device memory is short or part of it is nowhere."""
        assert self.memory is not None
        window = self.read(node)
        for n in window:
            if self.present(n, device=True):
                continue
            host_slots = self.slots(n, device=False)
            device_slots = self.alloc(len(n.key), device=True) if host_slots is not None else None
            if device_slots is None or host_slots is None:
                self.unread(node)
                return False
            self.memory.to_device(device_slots, host_slots)
            self.set(n, device_slots, device=True)
        return True

    def unread(self, node: TreeNode) -> None:
        """A request resuming at ``node`` no longer reads the window before it."""
        for n in self.window(node):
            self.release_hold(n)

    def hold(self, node: TreeNode) -> None:
        self._readers[node] = self._readers.get(node, 0) + 1

    def release_hold(self, node: TreeNode) -> None:
        left = self._readers[node] - 1
        if left:
            self._readers[node] = left
        else:
            del self._readers[node]

    def being_read(self, node: TreeNode) -> bool:
        """Whether a running request reads ``node``'s SWA KV (it stays on the device until then)."""
        return node in self._readers

    def _evictable(self, node: TreeNode, device: bool) -> bool:
        if device:
            return node not in self._readers
        return super()._evictable(node, device)

    def device_window(self, node: TreeNode, first: int) -> torch.Tensor:
        """Device slots of positions ``[first, node.end)`` (every node covering them holds them)."""
        parts: list[torch.Tensor] = []
        for covering in self.window(node):
            part = self.slots(covering, device=True)
            assert part is not None, "the window was not brought to the device"
            parts.append(part)
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return slots[slots.numel() - (node.end - first) :]

    def split(self, upper: TreeNode, lower: TreeNode, length: int) -> None:
        if lower in self._readers:
            self._readers[upper] = self._readers[lower]
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

    def window(self, node: TreeNode) -> list[TreeNode]:
        """The nodes holding the ``context_tokens`` tokens before ``node.end``, top down."""
        assert self.tree is not None
        start = node.end - self.context_tokens
        nodes: list[TreeNode] = []
        while node is not self.tree.root and node.end > start:
            nodes.append(node)
            node = node.parent  # type: ignore[assignment]  # below the root, every node has a parent
        nodes.reverse()
        return nodes


class RecurrentState(PooledComponent):
    """Recurrent-state checkpoints: one slot per node per tier, valid only at the node's end.

    A split leaves the checkpoint on the lower node (it keeps the end); the new upper node has
    none. The root needs none (the state before any token is the model's initial state).
    """

    name = "mamba"

    @classmethod
    def on(cls, memory: StateMemory) -> RecurrentState:
        return cls(memory.device_allocator, memory.host_allocator, memory)

    def pool_spec(self, page_size: int) -> PoolSpec:
        return PoolSpec(self.name, HitPolicy.TRAILING_PAGES, 1)

    def stored_hashes(self, node: TreeNode) -> list[str]:
        return [node.page_hashes[-1]]

    def place(self, node: TreeNode, slots: torch.Tensor) -> None:
        if self.slots(node, device=False) is None:
            self.set(node, slots, device=False)
        else:
            self.free_host(slots)

    def state_at(self, node: TreeNode, initial: torch.Tensor) -> torch.Tensor:
        """A private copy of the state at ``node.end`` (``initial`` at the root); the checkpoint stays intact."""
        assert self.tree is not None and isinstance(self.memory, StateMemory)
        if node is self.tree.root:
            return initial
        device_slot = self.slots(node, device=True)
        if device_slot is not None:
            return self.memory.device[int(device_slot)].clone()
        host_slot = self.slots(node, device=False)
        assert host_slot is not None, f"{node} was accepted without a checkpoint"
        # ``copy=True``: on the CPU ``to`` would return the checkpoint itself, and the model mutates it.
        return self.memory.host[int(host_slot)].to(self.memory.device.device, copy=True)

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
