"""Device -> host copies, the first step of every backup: :class:`HostWrites` is that half of
:class:`~hicache_core.controller.CacheController` (which inherits it; the write policies that
call it are described there).

A copy runs off the scheduler thread (a CUDA side stream, or the copier thread on the CPU). Until
it is acknowledged (:meth:`HostWrites._ack_writes`, from ``poll``, in order and agreed across
ranks) the node stays on the device and its host pages are protected; then its storage backup is
queued, or a copy that failed is dropped so that its pages are never served.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hicache_core.metrics import CacheMetrics
from hicache_core.pools import HostPool
from hicache_core.radix_tree import RadixTree, TreeNode
from hicache_core.side_pools import PendingCopy
from hicache_core.tp import TPContext
from hicache_core.transfer import CopyDone, Transfers

if TYPE_CHECKING:
    from hicache_core.controller import ControllerConfig
    from hicache_core.side_pools import TieredComponent

log = logging.getLogger("hicache_core.controller")  # the channel its warnings had before they moved here


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


class HostWrites:
    """The device -> host copies of a controller (see ``CacheController`` for the attributes it reads)."""

    config: ControllerConfig
    tree: RadixTree
    host: HostPool | None
    transfers: Transfers | None
    metrics: CacheMetrics
    tp: TPContext
    page_size: int
    components: tuple[TieredComponent, ...]
    completions: int
    _pending_writes: deque[PendingWrite]
    _warned_host_too_small: bool

    @property
    def io_pending(self) -> bool:
        raise NotImplementedError

    def alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        raise NotImplementedError

    def drain(self, poll_interval_s: float = 0.001) -> None:
        raise NotImplementedError

    def _queue_storage_backup(self, node: TreeNode, *, full: bool = True) -> None:
        raise NotImplementedError

    def write_to_host(self, node: TreeNode, *, wait: bool = False) -> bool:
        """Copy ``node``'s device KV to new host pages; storage backup follows when the copy completes."""
        assert self.transfers is not None and self.host is not None and node.device_value is not None
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
        host_slots = self.alloc_host(len(node.key))
        if host_slots is None and self.config.buffer_only and self.io_pending:
            # Staging is full of pages on their way to storage: wait for them rather than skip the backup.
            self.drain()
            host_slots = self.alloc_host(len(node.key))
        if host_slots is None:
            return False
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
            self._pending_writes.append(PendingWrite(node, done, True, begin, copies))
            return True
        done.synchronize()
        if self._pending_writes:  # complete, but acknowledged in order after the copies before it
            self._pending_writes.append(PendingWrite(node, done, False, begin))
        else:
            self._write_completed(node, done, begin)
        return True

    def _backup_on_evict(self, node: TreeNode) -> bool:
        return self.write_to_host(node, wait=True)

    def _ack_writes(self) -> None:
        """Apply completed device -> host copies, in order, as many as every rank has completed."""
        ready = 0
        for pending in self._pending_writes:
            if not pending.done.query() or not all(copy.done.query() for copy in pending.components):
                break
            ready += 1
        ready = self.tp.scheduler.all_min(ready)
        self.completions += ready
        for _ in range(ready):
            pending = self._pending_writes.popleft()
            for copy in pending.components:
                copy.settle(getattr(copy.done, "error", None) is not None)
            if pending.locked:
                self.tree.unlock(pending.node)
                self.tree.release_host(pending.node, pending.begin)
            self._write_completed(pending.node, pending.done, pending.begin)

    def _write_completed(self, node: TreeNode, done: CopyDone | torch.cuda.Event, begin: int) -> None:
        """A device -> host copy of the tokens from ``begin`` to ``node.end`` finished: queue the
        storage backup of every node now holding them, or drop a copy that failed."""
        copied = [n for n in (self.tree.path(node) if self.tree.in_tree(node) else [node]) if n.end - len(n.key) >= begin]
        if isinstance(done, CopyDone):
            self.metrics.add(host_backup_seconds=done.seconds)
            if done.error is not None:  # the host pages hold a partial copy: never serve them
                self.metrics.add(host_backup_errors=1)
                for part in reversed(copied):
                    self.tree.drop_host_value(part)
                return
        for part in copied:
            self._queue_storage_backup(part)
