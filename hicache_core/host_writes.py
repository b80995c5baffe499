"""Device -> host copies, the first step of every backup: :class:`HostWriter`, which the cache
controller holds (``CacheController.host_writer``; the write policies that call it are described
in :mod:`hicache_core.controller`).

A copy runs off the scheduler thread (a CUDA side stream, or the copier thread on the CPU). Until
it is acknowledged (:meth:`HostWriter.acknowledge`, from the controller's ``poll``, in order and
agreed across ranks) the node stays on the device and its host pages are protected; then the
controller is handed every node now holding the copy (it queues their storage backups), or a
copy that failed is dropped so that its pages are never served.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hicache_core.metrics import CacheMetrics
from hicache_core.pools import HostPool
from hicache_core.radix_tree import RadixTree, TreeNode
from hicache_core.side_pools import PendingCopy, TieredComponent
from hicache_core.tp import RankGroup
from hicache_core.transfer import CopyDone, Transfers

log = logging.getLogger("hicache_core.controller")  # its warnings are the controller's to the user


@dataclass(eq=False)
class PendingWrite:
    node: TreeNode
    done: CopyDone | torch.cuda.Event
    #: Whether the node was locked for the copy (an asynchronous one); a waited-for copy is not.
    locked: bool
    #: Where the copied tokens start: a match may split the node before the copy completes,
    #: and the upper parts (its ancestors now) hold host pages of the same copy.
    begin: int
    #: Components' copies of the node's state started with it (see ``side_pools.PendingCopy``).
    components: list[PendingCopy] = field(default_factory=list)


class HostWriter:
    """Copies nodes' device KV (and their components' state) to new host pages.

    ``alloc_host`` finds host pages (evicting); ``make_room``, when given (buffer-only mode),
    waits for pages on their way to storage when none are free and says whether there were any;
    ``on_copied`` receives each node holding a completed copy. ``ranks`` agrees how many copies
    completed (the scheduler thread's group). Scheduler thread only.
    """

    def __init__(
        self,
        tree: RadixTree,
        host: HostPool,
        transfers: Transfers,
        *,
        page_size: int,
        components: tuple[TieredComponent, ...],
        metrics: CacheMetrics,
        ranks: RankGroup,
        alloc_host: Callable[[int], torch.Tensor | None],
        on_copied: Callable[[TreeNode], None],
        make_room: Callable[[], bool] | None = None,
    ) -> None:
        self.tree = tree
        self.host = host
        self.transfers = transfers
        self.page_size = page_size
        self.components = components
        self.metrics = metrics
        self.ranks = ranks
        self._alloc_host = alloc_host
        self._on_copied = on_copied
        self._make_room = make_room
        #: Copies not yet acknowledged, in the order they started.
        self._pending: deque[PendingWrite] = deque()
        self._warned_host_too_small = False

    @property
    def in_flight(self) -> bool:
        """Whether copies wait to be acknowledged (their completion may make memory evictable)."""
        return bool(self._pending)

    def write(self, node: TreeNode, *, wait: bool = False) -> bool:
        """Copy ``node``'s device KV to new host pages; False when no host pages could be found.

        With ``wait`` the copy completes before this returns (a write-back eviction); it is still
        acknowledged in order. Otherwise the node is locked and its host pages protected until then.
        """
        assert node.device_value is not None
        capacity = self.host.allocator.num_pages * self.page_size
        if 0 < capacity < len(node.key):
            # The node can never fit: back up its head, which is what a later prefix match uses.
            if not self._warned_host_too_small:
                self._warned_host_too_small = True
                log.warning(
                    "a %d-token node is larger than the whole host pool (%d tokens): only its first %d tokens "
                    "are backed up to host and storage; raise the host pool size to back up whole prompts",
                    len(node.key), capacity, capacity,
                )
            node = self.tree.boundary(node, node.end - len(node.key) + capacity)
        host_slots = self._alloc_host(len(node.key))
        if host_slots is None and self._make_room is not None and self._make_room():
            # Staging is full of pages on their way to storage: wait for them rather than skip the backup.
            host_slots = self._alloc_host(len(node.key))
        if host_slots is None:
            return False
        assert node.device_value is not None  # still: a boundary's head keeps its part of the device KV
        done = self.transfers.backup(node.device_value, host_slots)
        begin = node.end - len(node.key)
        node.host_value = host_slots
        copies: list[PendingCopy] = []
        for component in self.components:
            component.back_up(node, None if wait else copies)
        self.metrics.add(host_backup_pages=len(node.key) // self.page_size)
        if not wait:
            self.tree.lock(node)  # the device copy stays until the host copy is complete
            self.tree.protect_host(node, begin)  # and the host pages it is written into
            self._pending.append(PendingWrite(node, done, True, begin, copies))
            return True
        done.synchronize()
        if self._pending:  # complete, but acknowledged in order after the copies before it
            self._pending.append(PendingWrite(node, done, False, begin))
        else:
            self._write_completed(node, done, begin)
        return True

    def acknowledge(self) -> int:
        """Apply completed copies, in order, as many as every rank has completed; returns how many."""
        ready = 0
        for pending in self._pending:
            if not pending.done.query() or not all(copy.done.query() for copy in pending.components):
                break
            ready += 1
        ready = self.ranks.all_min(ready)
        for _ in range(ready):
            pending = self._pending.popleft()
            for copy in pending.components:
                copy.settle(getattr(copy.done, "error", None) is not None)
            if pending.locked:
                self.tree.unlock(pending.node)
                self.tree.release_host(pending.node, pending.begin)
            self._write_completed(pending.node, pending.done, pending.begin)
        return ready

    def _write_completed(self, node: TreeNode, done: CopyDone | torch.cuda.Event, begin: int) -> None:
        """A device -> host copy of the tokens from ``begin`` to ``node.end`` finished: hand
        every node now holding them to ``on_copied``, or drop a copy that failed."""
        copied = [n for n in (self.tree.path(node) if self.tree.in_tree(node) else [node]) if n.end - len(n.key) >= begin]
        if isinstance(done, CopyDone):
            self.metrics.add(host_backup_seconds=done.seconds)
            if done.error is not None:  # the host pages hold a partial copy: never serve them
                self.metrics.add(host_backup_errors=1)
                for part in reversed(copied):
                    self.tree.drop_host_value(part)
                return
        for part in copied:
            self._on_copied(part)
