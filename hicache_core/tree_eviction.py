"""Eviction from the radix tree: least recently used first, sessions' prefixes last, never a locked node.

:class:`TreeEvictor` chooses what leaves the tree's tiers and in what order, and hands the freed
device and host slots to the tree's ``free_device`` / ``free_host`` callbacks. The tree holds one
(``RadixTree.evictor``) and forwards its eviction methods to it; it keeps its own structure: a
node the evictor deletes leaves through the tree's ``remove_leaf``, which keeps the children,
the page-hash index and the components right. The evictor reads nodes from the root down.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch

from hicache_core.tree_node import TreeNode, descendants


class TreeEvictor:
    """Frees device and host copies of a tree's nodes, and deletes nodes left with neither.

    ``root`` is the tree's root; ``remove_leaf`` takes a childless node out of the tree;
    ``free_device`` and ``free_host`` receive every slot freed. Single-threaded, like the tree.
    """

    def __init__(
        self,
        root: TreeNode,
        remove_leaf: Callable[[TreeNode], None],
        free_device: Callable[[torch.Tensor], None],
        free_host: Callable[[torch.Tensor], None],
    ) -> None:
        self.root = root
        self._remove_leaf = remove_leaf
        self._free_device = free_device
        self._free_host = free_host

    def evict_device(self, num_tokens: int, backup: Callable[[TreeNode], bool] | None = None) -> int:
        """Free at least ``num_tokens`` device slots from least recently used unlocked leaves.

        Nodes leading to no session-referenced node go first, then the rest (each group least
        recently used first): a session reference is a preference, never a pin. A node without
        a host copy is first offered to ``backup`` (write-back); if it still has none it is
        deleted with its host-only descendants. Storage backups still writing some of those
        finish detached (see ``_detach_backups``).
        Returns the number of device tokens freed (less than asked when too much is locked).

        A leaf goes whole, even when fewer of its pages would do. Cutting it and freeing only its
        last pages (its head stays, a prefix its conversation could still hit) was measured on
        the long-history bench at the H200 point, two runs each: L1 under ``lpm`` 9.2 -> 8.8 s,
        L1+L2 under ``fcfs`` 16.3 -> 15.3 s, but L1+L2+L3 on S3 under ``fcfs`` 12.4-13.3 ->
        14.9-15.4 s (device hits 585k -> 467-528k). Whole leaves let those rounds settle into two
        conversations kept whole and two recomputed; cut leaves spread the loss over all four,
        and rounds came where every request lost its tail.
        """
        referenced = self.settle_recency()
        heap = [(n in referenced, n.last_access, n.id, n) for n in descendants(self.root) if self._device_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            *_, node = heapq.heappop(heap)
            if not self._device_evictable(node):
                continue
            if node.host_value is None and backup is not None:
                backup(node)
            assert node.device_value is not None
            size, parent = len(node.key), node.parent
            self._free_device(node.device_value)
            node.device_value = None
            if node.host_value is None:
                self._detach_backups(node)
                self._delete_subtree(node)
            freed += size
            if parent is not None and self._device_evictable(parent):
                heapq.heappush(heap, (parent in referenced, parent.last_access, parent.id, parent))
        return freed

    def device_evictable_tokens(self, keep: TreeNode) -> int:
        """At most how many device tokens :meth:`evict_device` could free once ``keep`` and its
        ancestors are locked: every unlocked node on the device off that path (a lock counts on
        every ancestor, so an unlocked node's descendants are all unlocked, and leaves first,
        all of them can go). Walks the whole tree: for a caller about to fail without it."""
        kept = set()
        node: TreeNode | None = keep
        while node is not None:
            kept.add(node)
            node = node.parent
        return sum(len(n.key) for n in descendants(self.root) if n.device_value is not None and n.lock_ref == 0 and n not in kept)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host slots; never a node with host I/O in flight or locked.

        Nodes leading to no session-referenced node go first, then the rest (no pinning), each
        group least recently used first. Unreferenced host-only leaves (the node is deleted) go
        before host copies of unreferenced device-resident nodes (the node stays on the device);
        among referenced nodes it is the other way round (see ``_host_rank``).
        """
        referenced = self.settle_recency()
        heap = [self._host_rank(n, referenced) for n in descendants(self.root) if self._host_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            *_, node = heapq.heappop(heap)
            if not self._host_evictable(node):
                continue
            assert node.host_value is not None
            freed += len(node.key)
            self._free_host(node.host_value)
            node.host_value = None
            if node.device_value is None:
                parent = node.parent
                self._delete_subtree(node)
                if parent is not None and self._host_evictable(parent):
                    heapq.heappush(heap, self._host_rank(parent, referenced))
        return freed

    def drop_host_value(self, node: TreeNode) -> None:
        """Free ``node``'s host copy now (buffer-only staging done); prunes it if nothing is left."""
        if node.host_value is not None:
            self._free_host(node.host_value)
            node.host_value = None
        self.prune(node)

    def prune(self, node: TreeNode) -> None:
        """Delete ``node`` and valueless ancestors that have no children and no references."""
        while (
            node is not self.root
            and node.device_value is None
            and node.host_value is None
            and not node.children
            and node.lock_ref == 0
            and node.host_ref == 0
        ):
            parent = node.parent
            assert parent is not None
            self._remove_leaf(node)
            node = parent

    def settle_recency(self) -> set[TreeNode]:
        """Give every node the latest access time in its subtree; return the session-referenced nodes.

        Every eviction starts here: the tree's own, and a component's (which ranks its holders the
        same way: unreferenced first, then least recently used).

        Whatever reaches a node went through all its ancestors, so an ancestor was used at least
        as recently as any descendant. A match stamps only the deepest node it reached (no walk
        along the path); the path's times are filled in here, once per eviction, which visits
        every node anyway. Deleted nodes hand their time to their parent (the tree's ``remove_leaf``).

        A node is referenced when it or a descendant has ``session_refs``: worked out here in
        the same bottom-up pass, so a session reference costs nothing per match or insert. The
        set is a snapshot for one eviction: a referenced node deleted during it leaves its
        ancestors counted as referenced until the next eviction.
        """
        referenced: set[TreeNode] = set()
        for node in reversed(list(descendants(self.root))):
            parent = node.parent
            if parent is not None and parent.last_access < node.last_access:
                parent.last_access = node.last_access
            if node.session_refs or node in referenced:
                referenced.add(node)
                if parent is not None:
                    referenced.add(parent)
        return referenced

    def _device_evictable(self, node: TreeNode) -> bool:
        return (
            node is not self.root
            and node.parent is not None
            and node.device_value is not None
            and node.lock_ref == 0
            and not any(c.device_value is not None for c in node.children.values())
        )

    def _host_evictable(self, node: TreeNode) -> bool:
        # A node on the device, locked or not, may lose its host copy unless I/O uses those
        # pages (``host_io``: a load, a copy, a backup); its request reads the device KV. A
        # host-only node is deleted with its copy: only a leaf nothing references.
        if node is self.root or node.parent is None or node.host_value is None:
            return False
        if node.device_value is not None:
            return node.host_io == 0
        return node.host_ref == 0 and node.lock_ref == 0 and not node.children

    @staticmethod
    def _host_rank(node: TreeNode, referenced: set[TreeNode]) -> tuple[int, int, float, int, TreeNode]:
        """Host eviction order. A session will read a referenced node again: dropping only the
        host copy of one still on the device keeps it cached, deleting a host-only one does not,
        so referenced nodes lose device-resident host copies first (measured in docs/sessions.md)."""
        on_device = node.device_value is not None
        if node in referenced:
            return (1, 0 if on_device else 1, node.last_access, node.id, node)
        return (0, 1 if on_device else 0, node.last_access, node.id, node)

    def _detach_backups(self, node: TreeNode) -> None:
        """``node`` (unlocked, about to be deleted) stops counting in its ancestors' ``host_ref``
        the I/O in flight below it. Loads and device -> host copies lock their nodes, so that I/O
        is storage backups of host-only descendants: each holds its own copy of the slots and
        hashes and its pages stay pinned in the allocator until it returns, so it completes
        detached (``release_host`` on a deleted node touches only deleted nodes). Keeping the
        conversation on the device for it instead held a finished request's whole history there
        until its newest turn reached storage, while waiting requests needed the memory."""
        held = node.host_ref
        assert node.lock_ref == 0 and node.host_io == 0, node
        if held and node.parent is not None:
            ancestor: TreeNode | None = node.parent
            while ancestor is not self.root and ancestor is not None:
                ancestor.host_ref -= held
                ancestor = ancestor.parent

    def _delete_subtree(self, node: TreeNode) -> None:
        """Remove ``node`` (no device copy left) and its descendants, freeing their host copies
        (pages a storage backup still writes are freed when it returns: they are pinned)."""
        for child in list(node.children.values()):
            assert child.device_value is None and child.lock_ref == 0, child
            if child.host_value is not None:
                self._free_host(child.host_value)
                child.host_value = None
            self._delete_subtree(child)
        if node.host_value is not None:
            self._free_host(node.host_value)
            node.host_value = None
        if node.parent is not None:
            self._remove_leaf(node)
        node.children = {}
