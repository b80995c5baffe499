"""The radix tree's records: nodes, what a match and an insert return, and the component protocol.

See :mod:`hicache_core.radix_tree` for the tree that holds them and its invariants.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

_ids = itertools.count()


class Component(Protocol):
    """State a hybrid model keeps beside the full-attention KV, with its own rules.

    The tree's own values (``device_value``/``host_value``) are the full-attention KV: every
    token of a path. A component (a sliding-window KV pool, a recurrent-state checkpoint) keeps
    its per-node state in ``node.components[name]`` and tells the tree three things: how a split
    divides it, whether a request may resume at a node's end with it, and how to free it when
    the node leaves the tree. Eviction of its own memory is the component's business.
    """

    name: str

    def split(self, upper: TreeNode, lower: TreeNode, length: int) -> None:
        """``lower`` was cut after ``length`` tokens and ``upper`` now holds those (and has no state yet)."""

    def accepts(self, node: TreeNode, on_device: bool) -> bool:
        """Whether a request can resume at ``node.end`` with this component's state (from the
        device alone when ``on_device``, else from the device or the host)."""

    def release(self, node: TreeNode) -> None:
        """``node`` leaves the tree: free whatever state it holds on every tier."""


class TreeNode:
    __slots__ = (
        "id",
        "parent",
        "children",
        "key",
        "page_hashes",
        "end",
        "device_value",
        "host_value",
        "lock_ref",
        "host_ref",
        "host_io",
        "hit_count",
        "last_access",
        "components",
        "session_refs",
        "stored",
        "backup_deferred",
    )

    def __init__(self, key: tuple[int, ...], parent: TreeNode | None, hashes: list[str], now: float, end: int = 0) -> None:
        self.id = next(_ids)
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.key = key
        self.page_hashes = hashes
        #: Tokens from the root through this node: its prefix length. Fixed for the node's life
        #: (a split gives the upper part to a new node; this one keeps its end).
        self.end = end
        self.device_value: torch.Tensor | None = None
        self.host_value: torch.Tensor | None = None
        self.lock_ref = 0
        self.host_ref = 0
        #: I/O in flight on this node's own host pages (a load, a device -> host copy, a storage
        #: backup): they are not freed. ``host_ref`` counts the same I/O along the whole path.
        self.host_io = 0
        self.hit_count = 0
        self.last_access = now
        #: Per-component state of hybrid models, by component name (see ``RadixTree.components``).
        self.components: dict[str, object] = {}
        #: Sessions referencing this node directly (see :mod:`hicache_core.sessions`).
        self.session_refs = 0
        #: Its pages were handed to L3 (a storage backup was queued) or read from it.
        self.stored = False
        #: Its host copy is complete and its storage backup waits for its next hit (write-through
        #: degraded to selective while the store lags; see ``CacheController.on_insert``).
        self.backup_deferred = False

    @property
    def last_hash(self) -> str | None:
        return self.page_hashes[-1] if self.page_hashes else None

    def __repr__(self) -> str:
        where = ("D" if self.device_value is not None else "") + ("H" if self.host_value is not None else "")
        return f"<TreeNode {self.id} tokens={len(self.key)} {where or '-'} lock={self.lock_ref} host_ref={self.host_ref} host_io={self.host_io}>"


class MatchResult:
    """What ``match_prefix`` found for a token sequence (all lengths in tokens, page-aligned).

    ``device_indices`` (the device slots of the device part, in order) and ``backed_up_node``
    (the deepest matched node with a host copy) are worked out on first read, by walking up from
    ``device_node`` / ``host_node``: a match does no work proportional to the matched length
    unless they are asked for. Read them before the tree changes (an eviction of the matched
    nodes, which a caller prevents by locking ``device_node``).
    """

    __slots__ = ("device_node", "host_hit_length", "host_node", "device_hit_length", "_root", "_indices", "_backed_up")

    def __init__(self, device_node: TreeNode, host_hit_length: int, host_node: TreeNode, root: TreeNode) -> None:
        self.device_node = device_node
        self.device_hit_length = device_node.end
        self.host_hit_length = host_hit_length
        self.host_node = host_node
        self._root = root
        self._indices: torch.Tensor | None = None
        self._backed_up: TreeNode | None = None

    @property
    def device_indices(self) -> torch.Tensor:
        if self._indices is None:
            self._indices = path_device_slots(self.device_node, self._root)
        return self._indices

    @property
    def backed_up_node(self) -> TreeNode:
        if self._backed_up is None:
            node = self.host_node
            while node is not self._root and node.host_value is None:
                node = node.parent  # type: ignore[assignment]  # below the root, every node has a parent
            self._backed_up = node
        return self._backed_up

    @property
    def matched_length(self) -> int:
        return self.device_hit_length + self.host_hit_length

    def __repr__(self) -> str:
        return (
            f"MatchResult(device_hit_length={self.device_hit_length}, host_hit_length={self.host_hit_length}, "
            f"device_node={self.device_node!r}, host_node={self.host_node!r})"
        )


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


def descendants(root: TreeNode) -> Iterator[TreeNode]:
    """Every node below ``root``, parents before children."""
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def path_nodes(node: TreeNode, root: TreeNode) -> list[TreeNode]:
    """The nodes below ``root`` down to ``node`` (a descendant), top down."""
    path = []
    while node is not root:
        path.append(node)
        node = node.parent  # type: ignore[assignment]  # below the root, every node has a parent
    path.reverse()
    return path


def path_device_slots(node: TreeNode, root: TreeNode) -> torch.Tensor:
    """The device slots of the path from ``root`` to ``node``, concatenated in token order."""
    parts = []
    for step in path_nodes(node, root):
        assert step.device_value is not None, f"{step} has no device copy (lost after a match, or never loaded)"
        parts.append(step.device_value)
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
