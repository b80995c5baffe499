"""The radix tree's invariants, checked node by node: :class:`TreeInvariants` is the checking
half of :class:`~hicache_core.radix_tree.RadixTree` (which inherits it; tests call it). The
invariants themselves are listed in :mod:`hicache_core.radix_tree`'s docstring.
"""

from __future__ import annotations

from hicache_storage.keys import page_hashes

from hicache_core.tree_node import TreeNode


class TreeInvariants:
    """The invariant check of a tree (see ``RadixTree`` for the attributes it reads)."""

    root: TreeNode
    page_size: int
    _by_hash: dict[str, TreeNode]

    def _indexed_hashes(self, node: TreeNode) -> list[str]:
        raise NotImplementedError

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the tree breaks an invariant (tests call this)."""
        page_size = self.page_size
        indexed = 0

        def visit(node: TreeNode, path: tuple[int, ...]) -> tuple[int, int]:
            nonlocal indexed
            locks, host_refs = 0, 0
            for first, child in node.children.items():
                assert child.parent is node and child.key[:page_size] == first, child
                assert len(child.key) % page_size == 0 and child.key, child
                full = path + child.key
                assert child.end == len(full), child
                assert child.page_hashes == page_hashes(full, page_size)[len(path) // page_size :], child
                indexed_hashes = self._indexed_hashes(child)
                assert all(self._by_hash.get(h) is child for h in indexed_hashes), f"{child} not indexed by its page hashes"
                indexed += len(indexed_hashes)
                if child.device_value is not None:
                    assert node.device_value is not None, f"{child} on device under {node} off device"
                    assert child.device_value.numel() == len(child.key)
                if child.host_value is not None:
                    assert child.host_value.numel() == len(child.key)
                sub_locks, sub_host = visit(child, full)
                assert child.lock_ref >= sub_locks and child.host_ref >= sub_host, child
                assert 0 <= child.host_io <= child.host_ref, child
                assert child.host_io == 0 or child.host_value is not None, f"{child}: I/O on host pages it lacks"
                locks += child.lock_ref
                host_refs += child.host_ref
            return locks, host_refs

        visit(self.root, ())
        assert indexed == len(self._by_hash), "the page-hash index holds pages of nodes no longer in the tree"
