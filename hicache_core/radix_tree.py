"""The radix tree over token ids that knows where each cached page lives (device, host).

Every node holds a page-aligned run of tokens and, for them: the device slots (L1) or ``None``,
the host slots (L2) or ``None``, the SGLang page hashes (the L3 keys, computed once at insert and
kept right by splits), a lock count (a running request uses the device copy), a host-reference
count (host pages with storage I/O in flight), a hit count and the
last access time. L3 presence is never recorded here: it is asked live from the store.

A node's recency is the latest access time in its subtree: a match stamps only the deepest node
it reaches, and eviction settles the path's times first (``settle_recency``); inserts stamp
their whole path. Lookups by :class:`~hicache_core.token_sequence.TokenSequence` jump to the
deepest cached page through a page-hash index, so their cost does not grow with the length of
the conversation (see ``RadixTree``).

Invariants (``check_invariants`` verifies them in tests):

* device copies are prefix-closed: a node on the device has its parent on the device;
* ``lock_ref`` and ``host_ref`` count the node's own references plus all its descendants'
  (both are taken along the path to the root), so a referenced node's ancestors stay too;
  ``host_io`` counts only the I/O on the node's own host pages (``host_io <= host_ref``);
* a node with neither copy exists only transiently (buffer-only staging) and ends a match.

The records (nodes, match and insert results, the component protocol) are in
:mod:`hicache_core.tree_node`. Eviction is a collaborator the tree holds and forwards to
(``evictor``, a :class:`~hicache_core.tree_eviction.TreeEvictor`): it chooses what to free, and
deletes nodes through ``remove_leaf``, which keeps the page-hash index and the components right.

Not thread-safe: the scheduler thread owns the tree. Freed slots go to the ``free_device`` /
``free_host`` callbacks (through the evictor); the tree never touches pool memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch

from hicache_storage.keys import page_hashes

from hicache_core.token_sequence import TokenSequence, chain_page_hashes
from hicache_core.tree_eviction import TreeEvictor
from hicache_core.tree_node import (
    Component,
    HostInsertResult,
    InsertResult,
    MatchResult,
    TreeNode,
    descendants,
    path_nodes,
    path_device_slots,
)

__all__ = ["Component", "HostInsertResult", "InsertResult", "MatchResult", "RadixTree", "TreeNode", "path_device_slots"]

#: Tokens between two pages in the page-hash index (see ``RadixTree.__init__``).
INDEX_STRIDE_TOKENS = 256


class RadixTree:
    """Radix tree over whole pages of token ids.

    Lookups take any ``Sequence[int]``. A :class:`~hicache_core.token_sequence.TokenSequence` with
    the tree's page size is the fast path: its cached page hashes find the deepest cached indexed
    page (one every ``index_stride_tokens``) by a binary search of dictionary lookups, and the
    last stride is compared as token runs. A match then costs the same whatever the length of
    the conversation; an insert adds one pass over the nodes of its path (hit counts and access
    times are kept per node). Other sequences are compared node by node from the root, each
    node's tokens in one C-level comparison. No per-token Python work on either path.
    """

    def __init__(
        self,
        page_size: int,
        free_device: Callable[[torch.Tensor], None],
        free_host: Callable[[torch.Tensor], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        index_stride_tokens: int = INDEX_STRIDE_TOKENS,
        components: Sequence[Component] = (),
    ) -> None:
        self.page_size = page_size
        #: Hybrid models' extra state (see :class:`Component`); empty for plain attention.
        self.components = tuple(components)
        self._clock = clock
        self.root = TreeNode((), None, [], clock())
        self.root.device_value = torch.empty(0, dtype=torch.int64)
        self.root.lock_ref = 1
        # Page hash -> the node holding that page, for every ``_stride``-th page (global page
        # index ``stride - 1``, ``2 * stride - 1``, ...). A page hash names its whole prefix, so one
        # lookup answers "is this prefix cached?"; a binary search over these pages finds the
        # deepest one, and at most a stride of tokens is left to compare. Indexing every page
        # would cost a dictionary insert per token with page size 1.
        self._stride = max(1, index_stride_tokens // page_size)
        self._by_hash: dict[str, TreeNode] = {}
        #: How many unlocks and host releases there were: what may make memory evictable.
        self.releases = 0
        #: Chooses what to free when memory is short; the freed slots go to the callbacks.
        self.evictor = TreeEvictor(self.root, self.remove_leaf, free_device, free_host or _no_host)

    # --- lookup -------------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], *, count_host: bool = True) -> MatchResult:
        """Longest cached prefix of ``tokens``: the device part, then the host part after it.

        Splits a node where the match ends inside it, and refreshes the access time of the
        matched path (stamped on its deepest node only; see ``settle_recency``).
        With ``count_host=False`` (buffer-only mode) host copies are not hits.
        """
        node, matched = self._locate(tokens)
        root = self.root
        # Device copies are prefix-closed: the path is device nodes, then a tail without them.
        tail: list[TreeNode] = []
        device_node = node
        while device_node is not root and device_node.device_value is None:
            tail.append(device_node)
            device_node = device_node.parent  # type: ignore[assignment]  # below the root, every node has a parent
        if not tail and matched < len(node.key):
            device_node = self._split(node, matched)
        host_node, host_length = device_node, 0
        for candidate in reversed(tail):
            if candidate is node and matched < len(node.key):
                candidate = self._split(node, matched)
            if candidate.host_value is None or not count_host:
                break
            host_length += len(candidate.key)
            host_node = candidate
        now = self._clock()
        if host_node is not root:
            host_node.last_access = now  # the path above it is as recent: see settle_recency
        return MatchResult(device_node, host_length, host_node, root)

    def device_hit_length(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` are cached on the device. Changes nothing (no
        split, no access time): for ordering waiting requests, not for using the match."""
        node, matched = self._locate(tokens)
        if node is self.root:
            return 0
        if node.device_value is not None:
            return node.end - len(node.key) + matched
        while node is not self.root and node.device_value is None:
            node = node.parent  # type: ignore[assignment]  # below the root, every node has a parent
        return node.end

    def resume_point(self, node: TreeNode, *, on_device: bool) -> TreeNode:
        """The deepest node at or above ``node`` whose end every component accepts.

        ``node`` ends a matched path (``MatchResult.host_node``, or ``device_node`` with
        ``on_device``). A rejection does not stop the walk: the boundary above is tried next, so
        a recurrent checkpoint missing at the end of a match still lets the request resume from
        an earlier one. The root (nothing cached) is always accepted.
        """
        components = self.components
        while node is not self.root and not all(c.accepts(node, on_device) for c in components):
            node = node.parent  # type: ignore[assignment]  # below the root, every node has a parent
        return node

    def boundary(self, node: TreeNode, position: int) -> TreeNode:
        """The node ending exactly at ``position`` on the path to ``node``, cutting one if needed.

        ``position`` is page-aligned and at most ``node.end``; components use a boundary to hold
        state that starts or ends there (a checkpoint, the start of a window).
        """
        self._check_aligned(position)
        if not 0 <= position <= node.end:
            raise ValueError(f"position {position} is outside the path ending at {node.end}")
        while node is not self.root and node.end - len(node.key) >= position:
            if node.end == position:
                return node
            node = node.parent  # type: ignore[assignment]  # below the root, every node has a parent
        if node is self.root or node.end == position:
            return node
        return self._split(node, position - (node.end - len(node.key)))

    # --- insertion ----------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], device_indices: torch.Tensor, *, counted: int = 0) -> InsertResult:
        """Cache ``tokens`` (a whole number of pages) whose KV sits in ``device_indices``.

        The tree takes the slots of every page it did not have on the device; the caller frees
        its own copy of the first ``duplicate_length`` tokens (those were already cached).
        Existing nodes on the path get a hit (``hit_count``) and an access time; those within
        the first ``counted`` tokens only the access time (the same request inserted them
        before, and its hit was counted then: a request's prompt, inserted after its prefill).
        """
        self._check_aligned(len(tokens))
        now = self._clock()
        node, matched = self._locate(tokens)
        if matched < len(node.key):
            node = self._split(node, matched)
        existing: list[TreeNode] = []
        root, step = self.root, node
        # Device copies are prefix-closed: fill the tail without one, then the rest is cached.
        while step is not root and step.device_value is None:
            step.device_value = device_indices[step.end - len(step.key) : step.end].clone()
            if step.end > counted:
                step.hit_count += 1
            step.last_access = now
            existing.append(step)
            step = step.parent  # type: ignore[assignment]  # below the root, every node has a parent
        result = InsertResult(step.end, node, [], existing)
        while step is not root:
            if step.end > counted:
                step.hit_count += 1
            step.last_access = now
            existing.append(step)
            step = step.parent  # type: ignore[assignment]  # below the root, every node has a parent
        existing.reverse()
        if node.end < len(tokens):
            leaf = self._new_leaf(node, tokens, now)
            leaf.device_value = device_indices[node.end : len(tokens)].clone()
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
        node, matched = self._locate(tokens)
        # Cut the node straddling ``start`` first, then the one where the match ends (this
        # order keeps node ids, the eviction tie-break, as a top-down walk would create them).
        matched_end = node.end - len(node.key) + matched
        step = node
        while step is not self.root and step.end - len(step.key) >= start:
            step = step.parent  # type: ignore[assignment]  # below the root, every node has a parent
        if step is not self.root and start < min(step.end, matched_end):
            cut = start - (step.end - len(step.key))
            self._split(step, cut)
            if step is node:
                matched -= cut
        if matched < len(node.key):
            node = self._split(node, matched)
        path: list[TreeNode] = []
        step = node
        while step is not self.root:
            path.append(step)
            step = step.parent  # type: ignore[assignment]  # below the root, every node has a parent
        unused: list[torch.Tensor] = []
        inserted = 0
        for step in reversed(path):
            if step.end > start:
                pages = host_indices[step.end - len(step.key) - start : step.end - start]
                if step.device_value is None and step.host_value is None:
                    step.host_value = pages.clone()
                    step.stored = True
                    inserted += len(step.key)
                else:
                    unused.append(pages)
            step.last_access = now
        if node.end < start:
            return None
        if node.end < len(tokens):
            leaf = self._new_leaf(node, tokens, now)
            leaf.host_value = host_indices[node.end - start :].clone()
            leaf.stored = True
            inserted += len(tokens) - node.end
        return HostInsertResult(inserted, unused)

    def _new_leaf(self, parent: TreeNode, tokens: Sequence[int], now: float) -> TreeNode:
        """A child of ``parent`` holding ``tokens[parent.end:]``, with its page hashes."""
        ps, start, end = self.page_size, parent.end, len(tokens)
        if isinstance(tokens, TokenSequence) and tokens.page_size == ps:
            hashes = tokens.known_page_hashes()[start // ps : end // ps]
            key = tuple(tokens[start:end])
        else:
            key = tuple(tokens[start:end])
            hashes = chain_page_hashes(key, ps, parent.last_hash)
        leaf = TreeNode(key, parent, hashes, now, end)
        parent.children[key[:ps]] = leaf
        self._index(leaf)
        return leaf

    def _locate(self, tokens: Sequence[int]) -> tuple[TreeNode, int]:
        """The deepest node along the whole pages of ``tokens`` and how many of its tokens match
        (``len(node.key)`` when all do; ``(root, 0)`` when nothing is cached). Changes nothing."""
        if isinstance(tokens, TokenSequence) and tokens.page_size == self.page_size:
            return self._locate_by_hash(tokens)
        return self._descend(tokens, self.root, 0)

    def _locate_by_hash(self, tokens: TokenSequence) -> tuple[TreeNode, int]:
        stride = self._stride
        points = tokens.num_pages // stride
        hashes = tokens.known_page_hashes()
        index = self._by_hash
        # Cached prefixes are prefix-closed, so "indexed page j is cached" holds up to some j.
        cached, bound = 0, points
        if points and hashes[points * stride - 1] in index:
            cached = points
        else:
            bound = points - 1
        while cached < bound:
            middle = (cached + bound + 1) // 2
            if hashes[middle * stride - 1] in index:
                cached = middle
            else:
                bound = middle - 1
        if not cached:
            return self._descend(tokens, self.root, 0)
        return self._descend(tokens, index[hashes[cached * stride - 1]], cached * stride * self.page_size)

    def _descend(self, tokens: Sequence[int], node: TreeNode, position: int) -> tuple[TreeNode, int]:
        """Continue a match known to hold for ``tokens[:position]``, which ends inside or at the
        end of ``node``, by comparing tokens (each node's run in one C-level comparison)."""
        ps = self.page_size
        limit = len(tokens) - len(tokens) % ps
        start = node.end - len(node.key)
        if position < node.end:
            offset = position - start
            if node.end <= limit and tuple(tokens[position : node.end]) == node.key[offset:]:
                position = node.end
            else:
                return node, offset + self._common_pages(tokens, position, node.key, offset, min(node.end, limit) - position) * ps
        while position < limit:
            child = node.children.get(tuple(tokens[position : position + ps]))
            if child is None:
                break
            length = len(child.key)
            if position + length <= limit and tuple(tokens[position : position + length]) == child.key:
                node, position = child, position + length
                continue
            return child, ps * self._common_pages(tokens, position, child.key, 0, min(length, limit - position), known=1)
        return node, len(node.key)

    def _common_pages(self, tokens: Sequence[int], position: int, key: tuple[int, ...], offset: int, span: int, known: int = 0) -> int:
        """Whole pages of ``tokens[position:]`` equal to ``key[offset:]``, within ``span`` tokens
        (at least ``known``): a binary search of slice comparisons, no per-token Python."""
        ps = self.page_size
        low, high = known, span // ps
        while low < high:
            middle = (low + high + 1) // 2
            if tuple(tokens[position : position + middle * ps]) == key[offset : offset + middle * ps]:
                low = middle
            else:
                high = middle - 1
        return low

    def _split(self, child: TreeNode, length: int) -> TreeNode:
        """Cut ``child`` after ``length`` tokens; returns the new upper node."""
        pages = length // self.page_size
        upper = TreeNode(child.key[:length], child.parent, child.page_hashes[:pages], child.last_access, child.end - len(child.key) + length)
        # I/O on ``child``'s pages reads all of them, the upper part's too: it keeps every count.
        upper.lock_ref, upper.host_ref, upper.host_io = child.lock_ref, child.host_ref, child.host_io
        upper.hit_count = child.hit_count
        upper.stored = child.stored
        upper.backup_deferred = child.backup_deferred
        if child.device_value is not None:
            upper.device_value, child.device_value = child.device_value[:length], child.device_value[length:]
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:length], child.host_value[length:]
        assert child.parent is not None
        child.parent.children[child.key[: self.page_size]] = upper
        child.key, child.page_hashes, child.parent = child.key[length:], child.page_hashes[pages:], upper
        upper.children[child.key[: self.page_size]] = child
        self._index(upper)
        for component in self.components:
            component.split(upper, child, length)
        return upper

    def _indexed_hashes(self, node: TreeNode) -> list[str]:
        """The hashes of ``node``'s pages that the index holds (every ``_stride``-th global page)."""
        stride, first_page = self._stride, (node.end - len(node.key)) // self.page_size
        return node.page_hashes[(stride - 1 - first_page) % stride :: stride]

    def _index(self, node: TreeNode) -> None:
        self._by_hash.update(dict.fromkeys(self._indexed_hashes(node), node))

    def remove_leaf(self, node: TreeNode) -> None:
        """Take a childless node out of the tree (the evictor deletes nodes through this): out of
        its parent's children and the page-hash index, its components' state released, its
        access time handed to the parent (see ``settle_recency``)."""
        parent = node.parent
        assert parent is not None and not node.children, node
        del parent.children[node.key[: self.page_size]]
        index = self._by_hash
        for page_hash in self._indexed_hashes(node):
            del index[page_hash]
        for component in self.components:
            component.release(node)
        if parent.last_access < node.last_access:
            parent.last_access = node.last_access
        node.parent = None

    # --- eviction (see hicache_core.tree_eviction) --------------------------------------------

    def device_evictable_tokens(self, keep: TreeNode) -> int:
        """See :meth:`~hicache_core.tree_eviction.TreeEvictor.device_evictable_tokens`."""
        return self.evictor.device_evictable_tokens(keep)

    def evict_device(self, num_tokens: int, backup: Callable[[TreeNode], bool] | None = None) -> int:
        """Free at least ``num_tokens`` device slots; see :meth:`~hicache_core.tree_eviction.TreeEvictor.evict_device`."""
        return self.evictor.evict_device(num_tokens, backup)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host slots; see :meth:`~hicache_core.tree_eviction.TreeEvictor.evict_host`."""
        return self.evictor.evict_host(num_tokens)

    def drop_host_value(self, node: TreeNode) -> None:
        """Free ``node``'s host copy now (buffer-only staging done); prunes it if nothing is left."""
        self.evictor.drop_host_value(node)

    def prune(self, node: TreeNode) -> None:
        """Delete ``node`` and valueless ancestors that have no children and no references."""
        self.evictor.prune(node)

    def settle_recency(self) -> set[TreeNode]:
        """Give every node its subtree's latest access time; return the session-referenced nodes.

        Every eviction starts here, a component's too; see
        :meth:`~hicache_core.tree_eviction.TreeEvictor.settle_recency`.
        """
        return self.evictor.settle_recency()

    # --- references ---------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Keep ``node`` and its ancestors on the device (a running request reads them)."""
        for n in self._path_up(node):
            n.lock_ref += 1

    def move_lock(self, node: TreeNode, below: TreeNode) -> None:
        """Move a lock from ``node`` to ``below``, a node of the path through it: the path stays
        locked, so nothing is given back (``releases`` does not change)."""
        self.lock(below)
        for n in self._path_up(node):
            n.lock_ref -= 1
            assert n.lock_ref >= 0, n

    def unlock(self, node: TreeNode) -> None:
        self.releases += 1
        for n in self._path_up(node):
            n.lock_ref -= 1
            assert n.lock_ref >= 0, n

    def on_device(self, node: TreeNode) -> bool:
        """Whether any node of the path to ``node`` holds device slots."""
        return any(n.device_value is not None for n in self._path_up(node))

    def protect_host(self, node: TreeNode, begin: int) -> None:
        """I/O is in flight on the host pages of the path's tokens from ``begin`` (where a node of
        the path starts) to ``node``'s end: those pages are not freed (``host_io``) and ``node``
        and its ancestors stay in the tree (``host_ref``). The ancestors' own host copies may
        still go: a storage backup of the newest turn no longer holds the whole conversation.
        A split keeps both counts on both parts, so :meth:`release_host` with the same
        ``begin`` walks the same range whatever was split meanwhile."""
        for n in self._path_up(node):
            n.host_ref += 1
            if n.end > begin:
                n.host_io += 1

    def release_host(self, node: TreeNode, begin: int) -> None:
        self.releases += 1
        for n in self._path_up(node):
            n.host_ref -= 1
            if n.end > begin:
                n.host_io -= 1
                assert n.host_io >= 0, n
            assert n.host_ref >= 0, n

    def path(self, node: TreeNode, below: TreeNode | None = None) -> list[TreeNode]:
        """The nodes from the root's child (or ``below``'s, an ancestor of ``node``) down to ``node``.

        Empty when ``node`` is the root (or ``below`` itself).
        """
        return path_nodes(node, self.root if below is None else below)

    def device_slots(self, node: TreeNode) -> torch.Tensor:
        """The device slots of the whole path to ``node``, in token order (every node on it must be on the device)."""
        return path_device_slots(node, self.root)

    def _path_up(self, node: TreeNode) -> Iterator[TreeNode]:
        step: TreeNode | None = node  # None past the top of a detached path
        while step is not self.root and step is not None:
            yield step
            step = step.parent

    # --- session references (see hicache_core.sessions) ---------------------------------------

    def in_tree(self, node: TreeNode) -> bool:
        """Whether ``node`` is a live non-root node (a deleted node has lost its parent)."""
        return node is not self.root and node.parent is not None

    def add_session_ref(self, node: TreeNode) -> bool:
        """One more session references ``node`` directly; False (nothing counted) if it is the root or deleted.

        Unlike a lock, only ``node`` is counted (O(1)): eviction works out which ancestors lead to a
        referenced node once per eviction (``settle_recency``). A reference never blocks eviction.
        """
        if not self.in_tree(node):
            return False
        node.session_refs += 1
        return True

    def drop_session_ref(self, node: TreeNode) -> None:
        """Undo one ``add_session_ref``; a no-op for a node deleted since (its count died with it)."""
        if self.in_tree(node):
            node.session_refs -= 1
            assert node.session_refs >= 0, node

    # --- inspection ---------------------------------------------------------------------------

    def nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        return descendants(self.root)

    def token_counts(self) -> dict[str, int]:
        counts = {"device": 0, "host": 0, "nodes": 0}
        for node in self.nodes():
            counts["nodes"] += 1
            counts["device"] += len(node.key) if node.device_value is not None else 0
            counts["host"] += len(node.key) if node.host_value is not None else 0
        return counts

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the tree breaks an invariant (see the module docstring; tests call this)."""
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

    def _check_aligned(self, length: int) -> None:
        if length % self.page_size:
            raise ValueError(f"length {length} is not a whole number of {self.page_size}-token pages")


def _no_host(_: torch.Tensor) -> None:
    raise AssertionError("this tree has no host tier, yet a host copy was freed")
