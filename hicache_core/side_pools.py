"""Components' pools in the controller's operations: one backup or prefetch moves every pool of its pages.

The FULL KV is the tree's own value. A hybrid model's components (sliding-window KV, recurrent
checkpoints: :mod:`hicache_core.hybrid.components`) keep more state per node, each in its own
pool, and each pool has its own L3 hit policy (:class:`~hicache_storage.multipool.PoolSpec`). The
controller and the prefetcher treat a FULL-only model as the case with no component; for a
hybrid one:

* **backup**: copying a node to the host copies every component's state of it, and the storage
  backup of the node stores every pool's pages (:func:`backup_pages`); a component's state that
  appears on a node already backed up is backed up alone (backfill);
* **prefetch**: the restorable cut is the longest one every pool accepts
  (``MultiPoolStore.restorable_pages``); the op reads, beside the FULL pages, each component's
  trailing pages before the cut (:class:`SideFetch`), and its state is placed at the cut only
  when every rank read all of it and all the FULL pages up to the cut;
* **load back**: resuming at a node brings each component's state it needs to the device
  (``materialize``).

A sidecar (a draft model's KV following the FULL slots) is not a component: it is more layers
of the FULL pool, so it moves with the FULL pages by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from hicache_storage.errors import StorageTimeoutError
from hicache_storage.multipool import PoolSpec

from hicache_core.pools import PageAllocator
from hicache_core.radix_tree import TreeNode
from hicache_core.token_sequence import TokenSequence


@dataclass(eq=False)
class PendingCopy:
    """A component's device -> host copy running on a copy thread or stream: ``done`` tells when;
    the caller calls ``settle(failed)`` once, after it completed (the component then lets its
    device source go, and drops the host copy if it failed)."""

    done: Any
    settle: Callable[[bool], None]


@runtime_checkable
class TieredComponent(Protocol):
    """A tree component (``radix_tree.Component``) whose state also lives on the host and in L3."""

    name: str
    host_allocator: PageAllocator | None

    def pool_spec(self, page_size: int) -> PoolSpec: ...

    def back_up(self, node: TreeNode, pending: list[PendingCopy] | None = None) -> bool:
        """Copy ``node``'s device state to the host where the host lacks it; whether it did.
        With ``pending``, a copy that runs off this thread is appended there, not waited for."""
        ...

    def stored_pages(self, node: TreeNode) -> tuple[list[str], list[Any], torch.Tensor] | None:
        """``node``'s host state as L3 pages (hashes, one value each, the host slots read)."""
        ...

    def reserve(self, pages: int) -> torch.Tensor | None:
        """Host slots for ``pages`` L3 values (evicting this component's LRU host state)."""
        ...

    def fetch_buffers(self, slots: torch.Tensor) -> list[Any]: ...

    def place(self, node: TreeNode, slots: torch.Tensor) -> None:
        """Give the trailing pages fetched for a cut at ``node.end`` to their nodes."""
        ...

    def materialize(self, node: TreeNode) -> bool:
        """Bring to the device what resuming at ``node.end`` needs; False if memory is short."""
        ...

    def drop(self, node: TreeNode, device: bool) -> int: ...

    def free_host(self, slots: torch.Tensor) -> None: ...


def tiered(components: Iterable[object]) -> tuple[TieredComponent, ...]:
    """The components that move between tiers (a tree-only component stays out of the I/O)."""
    return tuple(c for c in components if isinstance(c, TieredComponent))


@dataclass(eq=False)
class PoolPages:
    """One pool's pages in a storage backup: keys by ``hashes``, values read from ``buffers``.

    ``slots`` are the host slots the buffers view (pinned in ``allocator`` while the backup
    thread may read them). ``rewrite_suspects``: pages a prefetch found unreadable are written
    again even when reported present (the FULL KV pool's rule).
    """

    pool: str
    hashes: list[str]
    buffers: list[Any]
    slots: torch.Tensor
    allocator: PageAllocator
    rewrite_suspects: bool = False
    #: Pages (indices into ``hashes``) a timed-out put may still read: pinned until it returns.
    abandoned: set[int] = field(default_factory=set)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page's value (every page of a pool has the same)."""
        if not self.buffers:
            return 0
        first = self.buffers[0]
        segments = first if isinstance(first, (list, tuple)) else [first]
        return sum(s.numel() * s.element_size() for s in segments)

    def pin(self) -> None:
        self.allocator.pin_io(self.slots)

    def page_slots(self, pages: list[int]) -> torch.Tensor:
        """The host slots of ``pages`` (indices into ``hashes``)."""
        size = self.allocator.page_size
        return self.slots.view(-1, size)[torch.tensor(pages, dtype=torch.long)].reshape(-1)

    def abandon(self, pages: list[int], call: StorageTimeoutError) -> None:
        """A put of ``pages`` timed out but may still read them: they stay pinned until ``call``
        returns; the op's other pages are released as usual by ``unpin``. (A component whose
        pages are not one allocator page each keeps all of them.)"""
        if self.slots.numel() != len(self.hashes) * self.allocator.page_size:
            pages = [i for i in range(len(self.hashes)) if i not in self.abandoned]
            if pages:
                self.allocator.unpin_io_when_settled(self.slots, call)
        else:
            self.allocator.unpin_io_when_settled(self.page_slots(pages), call)
        self.abandoned.update(pages)

    def unpin(self) -> None:
        """Release the pin of every page no abandoned put still reads."""
        if not self.abandoned:
            self.allocator.unpin_io(self.slots)
            return
        rest = [i for i in range(len(self.hashes)) if i not in self.abandoned]
        if rest:
            self.allocator.unpin_io(self.page_slots(rest))


def unsaved_state(node: TreeNode, components: Sequence[TieredComponent]) -> bool:
    """Whether a component holds state of ``node`` on the device that the host lacks (a
    component that cannot tell is assumed to)."""
    for component in components:
        copies = getattr(component, "copies", None)
        if copies is None:
            return True
        state = copies(node)
        if state is True or (state is not None and state.device is not None and state.host is None):
            return True
    return False


def backup_pages(node: TreeNode, components: Sequence[TieredComponent]) -> list[PoolPages]:
    """Every component's host state of ``node`` as L3 pages."""
    pages = []
    for component in components:
        stored = component.stored_pages(node)
        if stored is not None:
            assert component.host_allocator is not None
            hashes, buffers, slots = stored
            pages.append(PoolPages(component.name, hashes, buffers, slots, component.host_allocator))
    return pages


@dataclass(eq=False)
class SideFetch:
    """One component's part of a prefetch: its trailing pages before the cut, read into ``slots``.

    ``slots`` hold ``trailing`` pages (reserved when the op is issued, in ``allocator``: the
    component's host allocator); the thread reads the ``pages`` the cut needs (fewer near the
    start of the sequence) and sets ``complete``.
    """

    component: TieredComponent
    trailing: int
    slots: torch.Tensor
    allocator: PageAllocator
    pages: int = 0
    complete: bool = False

    @property
    def slots_per_page(self) -> int:
        return self.slots.numel() // self.trailing

    @property
    def read_slots(self) -> torch.Tensor:
        return self.slots[: self.pages * self.slots_per_page]

    def window(self, chain: Sequence[str], lead: int, first_page: int, cut: int) -> list[str]:
        """The hashes of the pages this pool needs for a cut ``cut`` pages after ``first_page``,
        out of ``chain`` (the ``lead`` page hashes before ``first_page``, then the op's)."""
        self.pages = min(self.trailing, first_page + cut)
        return list(chain[lead + cut - self.pages : lead + cut])


def lead_hashes(tokens: Sequence[int], start: int, pages: int, node: TreeNode, page_size: int) -> list[str]:
    """The hashes of the (at most) ``pages`` pages before ``start``: from the sequence when it
    holds them, else from the tree path ending at ``node`` (which ends at ``start``)."""
    first = max(0, start // page_size - pages)
    if isinstance(tokens, TokenSequence) and tokens.page_size == page_size:
        return tokens.page_hashes(start // page_size)[first:]
    hashes: list[str] = []
    while node.parent is not None and len(hashes) < pages:
        hashes[:0] = node.page_hashes
        node = node.parent
    return hashes[len(hashes) - (start // page_size - first) :]
