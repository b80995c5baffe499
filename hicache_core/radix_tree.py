"""The radix tree over token ids that knows where each cached page lives (device, host).

Every node holds a page-aligned run of tokens and, for them: the device slots (L1) or ``None``,
the host slots (L2) or ``None``, the SGLang page hashes (the L3 keys, computed once at insert and
kept right by splits), a lock count (a running request uses the device copy), a host-reference
count (host pages with storage I/O in flight), a hit count and the
last access time. L3 presence is never recorded here: it is asked live from the store.

Invariants (``check_invariants`` verifies them in tests):

* device copies are prefix-closed: a node on the device has its parent on the device;
* ``lock_ref`` and ``host_ref`` count the node's own references plus all its descendants'
  (both are taken along the path to the root), so a referenced node's ancestors stay too;
* a node with neither copy exists only transiently (buffer-only staging) and ends a match.

Not thread-safe: the scheduler thread owns the tree. Freed slots go to the ``free_device`` /
``free_host`` callbacks; the tree never touches pool memory.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from hicache_storage.keys import page_hashes

_ids = itertools.count()


class TreeNode:
    __slots__ = (
        "id",
        "parent",
        "children",
        "key",
        "page_hashes",
        "device_value",
        "host_value",
        "lock_ref",
        "host_ref",
        "hit_count",
        "last_access",
    )

    def __init__(self, key: tuple[int, ...], parent: TreeNode | None, hashes: list[str], now: float) -> None:
        self.id = next(_ids)
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.key = key
        self.page_hashes = hashes
        self.device_value: torch.Tensor | None = None
        self.host_value: torch.Tensor | None = None
        self.lock_ref = 0
        self.host_ref = 0
        self.hit_count = 0
        self.last_access = now

    @property
    def last_hash(self) -> str | None:
        return self.page_hashes[-1] if self.page_hashes else None

    def __repr__(self) -> str:
        where = ("D" if self.device_value is not None else "") + ("H" if self.host_value is not None else "")
        return f"<TreeNode {self.id} tokens={len(self.key)} {where or '-'} lock={self.lock_ref} host_ref={self.host_ref}>"


@dataclass
class MatchResult:
    """What ``match_prefix`` found for a token sequence (all lengths in tokens, page-aligned)."""

    device_indices: torch.Tensor
    device_node: TreeNode
    host_hit_length: int
    host_node: TreeNode
    backed_up_node: TreeNode

    @property
    def device_hit_length(self) -> int:
        return int(self.device_indices.numel())

    @property
    def matched_length(self) -> int:
        return self.device_hit_length + self.host_hit_length


@dataclass
class InsertResult:
    """``duplicate_length``: leading tokens already on the device (the caller frees its copies)."""

    duplicate_length: int
    last_node: TreeNode
    new_nodes: list[TreeNode] = field(default_factory=list)
    existing_nodes: list[TreeNode] = field(default_factory=list)


@dataclass
class HostInsertResult:
    """Host pages placed in the tree (``inserted_tokens``) and those the caller must free (``unused``)."""

    inserted_tokens: int
    unused: list[torch.Tensor]


class RadixTree:
    def __init__(
        self,
        page_size: int,
        free_device: Callable[[torch.Tensor], None],
        free_host: Callable[[torch.Tensor], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.page_size = page_size
        self._free_device = free_device
        self._free_host = free_host or _no_host
        self._clock = clock
        self.root = TreeNode((), None, [], clock())
        self.root.device_value = torch.empty(0, dtype=torch.int64)
        self.root.lock_ref = 1

    # --- lookup -------------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], *, count_host: bool = True) -> MatchResult:
        """Longest cached prefix of ``tokens``: the device part, then the host part after it.

        Splits a node where the match ends inside it, and refreshes ``last_access`` on the path.
        With ``count_host=False`` (buffer-only mode) host copies are not hits.
        """
        device_parts: list[torch.Tensor] = []
        device_node = host_node = backed_up = self.root
        host_length = 0
        now = self._clock()
        for node in self._walk(tokens):
            if node.device_value is not None and device_node is node.parent:
                device_parts.append(node.device_value)
                device_node = node
            elif node.host_value is not None and count_host:
                host_length += len(node.key)
            else:
                break
            host_node = node
            if node.host_value is not None:
                backed_up = node
            node.last_access = now
        device_indices = torch.cat(device_parts) if device_parts else self.root.device_value
        return MatchResult(device_indices, device_node, host_length, host_node, backed_up)

    # --- insertion ----------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], device_indices: torch.Tensor) -> InsertResult:
        """Cache ``tokens`` (a whole number of pages) whose KV sits in ``device_indices``.

        The tree takes the slots of every page it did not have on the device; the caller frees
        its own copy of the first ``duplicate_length`` tokens (those were already cached).
        Existing nodes on the path get a hit (``hit_count``) and an access time.
        """
        self._check_aligned(len(tokens))
        now = self._clock()
        result = InsertResult(0, self.root)
        position = 0
        for node in self._walk(tokens):
            span = slice(position, position + len(node.key))
            if node.device_value is not None:
                result.duplicate_length = span.stop
            else:
                node.device_value = device_indices[span].clone()
            node.hit_count += 1
            node.last_access = now
            result.existing_nodes.append(node)
            result.last_node = node
            position = span.stop
        if position < len(tokens):
            leaf = self._new_leaf(result.last_node, tokens[position:], now)
            leaf.device_value = device_indices[position : len(tokens)].clone()
            result.new_nodes.append(leaf)
            result.last_node = leaf
        return result

    def insert_host(self, tokens: Sequence[int], start: int, host_indices: torch.Tensor) -> HostInsertResult | None:
        """Place host pages holding ``tokens[start:]`` (prefetched from storage) under the cached prefix.

        Returns ``None`` (the caller frees all of ``host_indices``) when ``tokens[:start]`` is no
        longer in the tree. Pages already cached on either tier are handed back in ``unused``.
        """
        self._check_aligned(len(tokens))
        self._check_aligned(start)
        now = self._clock()
        unused: list[torch.Tensor] = []
        inserted = 0
        position = 0
        parent = self.root
        for node in self._walk(tokens, split_at=start):
            end = position + len(node.key)
            if end > start:
                pages = host_indices[position - start : end - start]
                if node.device_value is None and node.host_value is None:
                    node.host_value = pages.clone()
                    inserted += len(node.key)
                else:
                    unused.append(pages)
            node.last_access = now
            parent, position = node, end
        if position < start:
            return None
        if position < len(tokens):
            leaf = self._new_leaf(parent, tokens[position:], now)
            leaf.host_value = host_indices[position - start :].clone()
            inserted += len(tokens) - position
        return HostInsertResult(inserted, unused)

    def _new_leaf(self, parent: TreeNode, tokens: Sequence[int], now: float) -> TreeNode:
        key = tuple(tokens)
        leaf = TreeNode(key, parent, page_hashes(key, self.page_size, parent.last_hash), now)
        parent.children[key[: self.page_size]] = leaf
        return leaf

    def _walk(self, tokens: Sequence[int], split_at: int | None = None) -> Iterator[TreeNode]:
        """Nodes along ``tokens`` (whole pages only), splitting the last one where the match ends
        and any node straddling ``split_at``."""
        ps = self.page_size
        limit = len(tokens) - len(tokens) % ps
        node, position = self.root, 0
        while position < limit:
            child = node.children.get(tuple(tokens[position : position + ps]))
            if child is None:
                return
            common = ps
            while common < len(child.key) and position + common < limit and tuple(
                tokens[position + common : position + common + ps]
            ) == child.key[common : common + ps]:
                common += ps
            if split_at is not None and position < split_at < position + common:
                common = split_at - position
            if common < len(child.key):
                child = self._split(child, common)
            yield child
            node, position = child, position + len(child.key)

    def _split(self, child: TreeNode, length: int) -> TreeNode:
        """Cut ``child`` after ``length`` tokens; returns the new upper node."""
        pages = length // self.page_size
        upper = TreeNode(child.key[:length], child.parent, child.page_hashes[:pages], child.last_access)
        upper.lock_ref, upper.host_ref, upper.hit_count = child.lock_ref, child.host_ref, child.hit_count
        if child.device_value is not None:
            upper.device_value, child.device_value = child.device_value[:length], child.device_value[length:]
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:length], child.host_value[length:]
        assert child.parent is not None
        child.parent.children[child.key[: self.page_size]] = upper
        child.key, child.page_hashes, child.parent = child.key[length:], child.page_hashes[pages:], upper
        upper.children[child.key[: self.page_size]] = child
        return upper

    # --- references ---------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Keep ``node`` and its ancestors on the device (a running request reads them)."""
        for n in self._path_up(node):
            n.lock_ref += 1

    def unlock(self, node: TreeNode) -> None:
        for n in self._path_up(node):
            n.lock_ref -= 1
            assert n.lock_ref >= 0, n

    def protect_host(self, node: TreeNode) -> None:
        """Keep the host copies (and the nodes) of ``node`` and its ancestors: I/O is in flight."""
        for n in self._path_up(node):
            n.host_ref += 1

    def release_host(self, node: TreeNode) -> None:
        for n in self._path_up(node):
            n.host_ref -= 1
            assert n.host_ref >= 0, n

    def _path_up(self, node: TreeNode) -> Iterator[TreeNode]:
        while node is not self.root and node is not None:
            yield node
            node = node.parent  # type: ignore[assignment]

    # --- eviction -----------------------------------------------------------------------------

    def evict_device(self, num_tokens: int, backup: Callable[[TreeNode], bool] | None = None) -> int:
        """Free at least ``num_tokens`` device slots from least recently used unlocked leaves.

        A node without a host copy is first offered to ``backup`` (write-back); if it still has
        none it is deleted with its host-only descendants, unless host I/O protects them.
        Returns the number of device tokens freed (less than asked when too much is locked).
        """
        heap = [(n.last_access, n.id, n) for n in self.nodes() if self._device_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if not self._device_evictable(node):
                continue
            if node.host_value is None and backup is not None:
                backup(node)
            assert node.device_value is not None
            size, parent = len(node.key), node.parent
            if node.host_value is not None:
                self._free_device(node.device_value)
                node.device_value = None
            elif node.host_ref == 0:
                self._free_device(node.device_value)
                node.device_value = None
                self._delete_subtree(node)
            else:
                continue
            freed += size
            if parent is not None and self._device_evictable(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host slots; never a node with host I/O in flight or locked.

        Host-only leaves go first (the node is deleted), then host copies of device-resident
        nodes (the node stays on the device); each group least recently used first.
        """
        heap = [self._host_rank(n) for n in self.nodes() if self._host_evictable(n)]
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
                    heapq.heappush(heap, self._host_rank(parent))
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
            del parent.children[node.key[: self.page_size]]
            node.parent = None
            node = parent

    def _device_evictable(self, node: TreeNode) -> bool:
        return (
            node is not self.root
            and node.parent is not None
            and node.device_value is not None
            and node.lock_ref == 0
            and not any(c.device_value is not None for c in node.children.values())
        )

    def _host_evictable(self, node: TreeNode) -> bool:
        return (
            node is not self.root
            and node.parent is not None
            and node.host_value is not None
            and node.host_ref == 0
            and node.lock_ref == 0
            and (node.device_value is not None or not node.children)
        )

    @staticmethod
    def _host_rank(node: TreeNode) -> tuple[int, float, int, TreeNode]:
        return (0 if node.device_value is None else 1, node.last_access, node.id, node)

    def _delete_subtree(self, node: TreeNode) -> None:
        """Remove ``node`` (no device copy left) and its descendants, freeing their host copies."""
        for child in list(node.children.values()):
            assert child.device_value is None and child.lock_ref == 0 and child.host_ref == 0, child
            if child.host_value is not None:
                self._free_host(child.host_value)
                child.host_value = None
            self._delete_subtree(child)
        if node.host_value is not None:
            self._free_host(node.host_value)
            node.host_value = None
        parent = node.parent
        if parent is not None:
            del parent.children[node.key[: self.page_size]]
            node.parent = None
        node.children = {}

    # --- inspection ---------------------------------------------------------------------------

    def nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def token_counts(self) -> dict[str, int]:
        counts = {"device": 0, "host": 0, "nodes": 0}
        for node in self.nodes():
            counts["nodes"] += 1
            counts["device"] += len(node.key) if node.device_value is not None else 0
            counts["host"] += len(node.key) if node.host_value is not None else 0
        return counts

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the tree breaks an invariant (tests call this)."""

        def visit(node: TreeNode, path: tuple[int, ...]) -> tuple[int, int]:
            locks, host_refs = 0, 0
            for first, child in node.children.items():
                assert child.parent is node and child.key[: self.page_size] == first, child
                assert len(child.key) % self.page_size == 0 and child.key, child
                full = path + child.key
                assert child.page_hashes == page_hashes(full, self.page_size)[len(path) // self.page_size :], child
                if child.device_value is not None:
                    assert node.device_value is not None, f"{child} on device under {node} off device"
                    assert child.device_value.numel() == len(child.key)
                if child.host_value is not None:
                    assert child.host_value.numel() == len(child.key)
                sub_locks, sub_host = visit(child, full)
                assert child.lock_ref >= sub_locks and child.host_ref >= sub_host, child
                locks += child.lock_ref
                host_refs += child.host_ref
            return locks, host_refs

        visit(self.root, ())

    def _check_aligned(self, length: int) -> None:
        if length % self.page_size:
            raise ValueError(f"length {length} is not a whole number of {self.page_size}-token pages")


def _no_host(_: torch.Tensor) -> None:
    raise AssertionError("this tree has no host tier, yet a host copy was freed")
