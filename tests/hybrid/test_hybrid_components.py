"""Hybrid components on one radix tree: FULL, sliding-window (SWA) and recurrent-state (MAMBA) rules.

Pure tree plus page allocators, no model: what a component accepts, how a split divides its
state, how eviction and node deletion hand its slots back, and that ``resume_point`` returns the
deepest boundary every component accepts (walking past rejections). Every scenario ends by
checking the tree's invariants and that each allocator's used pages are exactly the pages the
tree's nodes own (nothing leaked, nothing owned twice). A toy third component, written here
against the tree's ``Component`` protocol alone, plugs into the same tree and votes; a
Hypothesis state machine checks ownership and ``resume_point`` against a brute-force evaluation
of every boundary over random insert/split/evict/tombstone sequences.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache_core.hybrid.components import Copies, RecurrentState, SlidingWindow, attach
from hicache_core.pools import PageAllocator
from hicache_core.radix_tree import RadixTree, TreeNode

PAGE = 4


class Clock:
    """A clock the test moves: access times (and so LRU order) are explicit."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self) -> float:
        self.now += 1.0
        return self.now


class Indexer:
    """A toy third component written against the tree's ``Component`` protocol only.

    Like the key cache of a sparse-attention indexer: per-token slots in its own single-tier
    pool, needed for every token of the path, so a boundary is usable only when every node above
    it holds them. It is not a ``PooledComponent`` and is never ``attach``-ed: the tree needs
    nothing more than ``name``, ``split``, ``accepts`` and ``release``.
    """

    name = "indexer"

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator

    def give(self, node: TreeNode) -> bool:
        if self.name in node.components:
            return True
        slots = self.allocator.alloc(len(node.key))
        if slots is None:
            return False
        node.components[self.name] = slots
        return True

    def take(self, node: TreeNode) -> None:
        slots = node.components.pop(self.name, None)
        if slots is not None:
            self.allocator.free(slots)  # type: ignore[arg-type]

    def split(self, upper: TreeNode, lower: TreeNode, length: int) -> None:
        slots = lower.components.get(self.name)
        if slots is not None:
            upper.components[self.name] = slots[:length]  # type: ignore[index]
            lower.components[self.name] = slots[length:]  # type: ignore[index]

    def accepts(self, node: TreeNode, on_device: bool) -> bool:
        while node.parent is not None:  # up to the root, the only live node without a parent
            if self.name not in node.components:
                return False
            node = node.parent
        return True

    def release(self, node: TreeNode) -> None:
        self.take(node)


class Cache:
    """What the hybrid engine builds around its tree, minus the model: FULL KV slots on both
    tiers, an SWA window, recurrent checkpoints, optionally extra components."""

    def __init__(
        self,
        *,
        window: int = 12,
        full_pages: int = 32,
        swa_pages: int = 32,
        checkpoints: int = 16,
        extra: tuple[object, ...] = (),
    ) -> None:
        self.clock = Clock()
        self.full_device = PageAllocator(full_pages, PAGE)
        self.full_host = PageAllocator(full_pages, PAGE)
        self.swa = SlidingWindow(window, PageAllocator(swa_pages, PAGE), PageAllocator(swa_pages, PAGE))
        self.mamba = RecurrentState(PageAllocator(checkpoints, 1), PageAllocator(checkpoints, 1))
        self.extra = extra
        self.tree = RadixTree(
            PAGE,
            free_device=self.full_device.free,
            free_host=self.full_host.free,
            clock=self.clock,
            components=(self.swa, self.mamba, *extra),  # type: ignore[arg-type]
        )
        attach(self.tree, (self.swa, self.mamba))

    # --- building state --------------------------------------------------------------------

    def insert(self, tokens: list[int]) -> TreeNode:
        """Cache ``tokens`` on the device the way the engine does (the caller's duplicate slots freed)."""
        self.clock.tick()
        slots = self.full_device.alloc(len(tokens))
        assert slots is not None, "the test sized the FULL pool too small"
        result = self.tree.insert(tokens, slots)
        if result.duplicate_length:
            self.full_device.free(slots[: result.duplicate_length])
        return result.last_node

    def chain(self, tokens: list[int], *ends: int) -> list[TreeNode]:
        """Insert growing prefixes of ``tokens`` so that each of ``ends`` ends a node; the nodes, top down."""
        for end in ends:
            self.insert(tokens[:end])
        nodes = path(self.tree, self.tree.match_prefix(tokens[: ends[-1]]).device_node)
        assert [n.end for n in nodes] == list(ends)
        return nodes

    def backup(self, node: TreeNode) -> None:
        """Give every node on the path a host copy of its FULL KV."""
        for n in path(self.tree, node):
            if n.host_value is None:
                slots = self.full_host.alloc(len(n.key))
                assert slots is not None
                n.host_value = slots

    def give_swa(self, nodes: list[TreeNode], device: bool) -> None:
        for n in nodes:
            if self.swa.slots(n, device) is None:
                slots = self.swa.alloc(len(n.key), device)
                assert slots is not None
                self.swa.set(n, slots, device)

    def checkpoint(self, node: TreeNode, device: bool) -> torch.Tensor:
        slot = self.mamba.alloc(1, device)
        assert slot is not None
        self.mamba.set(node, slot, device)
        return slot

    # --- checks ----------------------------------------------------------------------------

    def allocators(self) -> dict[str, tuple[PageAllocator, list[torch.Tensor]]]:
        """Every allocator with the slot tensors the tree's nodes own in it."""
        owned: dict[str, tuple[PageAllocator, list[torch.Tensor]]] = {
            "full device": (self.full_device, []),
            "full host": (self.full_host, []),
            "swa device": (self.swa.device_allocator, []),
            "swa host": (self.swa.host_allocator, []),  # type: ignore[dict-item]
            "mamba device": (self.mamba.device_allocator, []),
            "mamba host": (self.mamba.host_allocator, []),  # type: ignore[dict-item]
        }
        for component in self.extra:
            owned[component.name] = (component.allocator, [])  # type: ignore[attr-defined]
        for n in self.tree.nodes():
            for value, where in ((n.device_value, "full device"), (n.host_value, "full host")):
                if value is not None:
                    owned[where][1].append(value)
            for component in (self.swa, self.mamba):
                copies = n.components.get(component.name)
                if copies is None:
                    continue
                assert isinstance(copies, Copies) and (copies.device is not None or copies.host is not None), (
                    f"{n} keeps an empty {component.name} record"
                )
                for value, tier in ((copies.device, "device"), (copies.host, "host")):
                    if value is not None:
                        owned[f"{component.name} {tier}"][1].append(value)
            for component in self.extra:
                if component.name in n.components:  # type: ignore[attr-defined]
                    owned[component.name][1].append(n.components[component.name])  # type: ignore[attr-defined,arg-type]
        return owned

    def check(self) -> None:
        """Tree invariants, and every allocator's used pages are exactly those the nodes own, once each."""
        self.tree.check_invariants()
        for where, (allocator, parts) in self.allocators().items():
            slots = torch.cat(parts).tolist() if parts else []
            assert len(slots) == len(set(slots)), f"{where}: a slot is owned by two nodes"
            pages = {s // allocator.page_size for s in slots}
            used = allocator.num_pages - allocator.free_pages
            assert len(pages) == used, f"{where}: nodes own {len(pages)} pages, the allocator has {used} in use"

    def all_free(self) -> bool:
        return all(a.free_pages == a.num_pages for a, _ in self.allocators().values())


def path(tree: RadixTree, node: TreeNode) -> list[TreeNode]:
    """The nodes from the root's child down to ``node``."""
    nodes = []
    while node is not tree.root:
        nodes.append(node)
        node = node.parent  # type: ignore[assignment]
    return nodes[::-1]


def seq(n: int, base: int = 0) -> list[int]:
    return list(range(base, base + n))


# --- resume_point ------------------------------------------------------------------------------


def test_resume_point_is_the_deepest_boundary_every_component_accepts():
    cache = Cache(window=12)
    a, b, c = cache.chain(seq(24), 8, 16, 24)
    cache.give_swa([a, b, c], device=True)
    for n in (a, b, c):
        cache.checkpoint(n, device=True)
    assert cache.tree.resume_point(c, on_device=True) is c
    assert cache.tree.resume_point(b, on_device=True) is b, "the walk starts at the node it is given"
    cache.check()


def test_a_rejection_does_not_stop_the_walk():
    """The checkpoint is missing at the end of the match and at the boundary above, present higher up."""
    cache = Cache(window=12)
    a, b, c = cache.chain(seq(24), 8, 16, 24)
    cache.give_swa([a, b, c], device=True)
    cache.checkpoint(a, device=True)
    assert cache.tree.resume_point(c, on_device=True) is a
    cache.check()


def test_components_vote_independently_and_all_must_accept():
    """MAMBA accepts at C and B but SWA rejects both (a tombstone inside their windows); A suits both."""
    cache = Cache(window=12)
    a, b, c = cache.chain(seq(24), 8, 16, 24)
    cache.give_swa([a, b, c], device=True)
    for n in (a, b, c):
        cache.checkpoint(n, device=True)
    cache.swa.drop(b, device=True)
    assert not cache.swa.accepts(c, True), "C's window [12, 24) reaches into B"
    assert cache.mamba.accepts(c, True) and cache.mamba.accepts(b, True)
    assert cache.tree.resume_point(c, on_device=True) is a
    cache.check()


def test_the_root_is_always_accepted():
    cache = Cache()
    (a,) = cache.chain(seq(8), 8)
    assert cache.tree.resume_point(a, on_device=False) is cache.tree.root, "no checkpoint, no SWA: nothing usable"
    assert cache.tree.resume_point(cache.tree.root, on_device=True) is cache.tree.root
    cache.check()


def test_a_tree_without_components_resumes_at_the_match_itself():
    tree = RadixTree(PAGE, free_device=lambda _: None)
    node = tree.insert(seq(8), torch.arange(8)).last_node
    assert tree.resume_point(node, on_device=True) is node


def test_state_only_on_the_host_counts_only_off_the_device():
    cache = Cache(window=12)
    a, b, c = cache.chain(seq(24), 8, 16, 24)
    cache.backup(c)
    cache.give_swa([a, b, c], device=True)
    cache.checkpoint(a, device=True)
    cache.checkpoint(c, device=False)
    assert cache.tree.resume_point(c, on_device=False) is c
    assert cache.tree.resume_point(c, on_device=True) is a, "C's checkpoint is only on the host"
    # SWA on the host only: the window of C needs B on the device when resuming from the device.
    cache.checkpoint(c, device=True)
    cache.give_swa([b], device=False)
    cache.swa.drop(b, device=True)
    assert cache.swa.accepts(c, on_device=False) and not cache.swa.accepts(c, on_device=True)
    assert cache.tree.resume_point(c, on_device=False) is c
    assert cache.tree.resume_point(c, on_device=True) is a
    cache.check()


# --- SlidingWindow -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "context,expected",
    [
        (0, []),
        (4, [24]),  # one page: the last node alone
        (8, [24]),  # exactly the last node
        (12, [16, 24]),  # starts inside B (a partial first node)
        (16, [16, 24]),
        (17, [8, 16, 24]),  # one token into A
        (24, [8, 16, 24]),
        (100, [8, 16, 24]),  # longer than the path: all of it
    ],
)
def test_window_lists_the_nodes_covering_the_context_top_down(context, expected):
    cache = Cache(window=context)
    nodes = cache.chain(seq(24), 8, 16, 24)
    assert [n.end for n in cache.swa.window(nodes[-1])] == expected
    assert cache.swa.window(cache.tree.root) == []


@pytest.mark.parametrize("context", [0, 4, 8, 12, 16, 20, 24, 40])
@pytest.mark.parametrize("tombstoned", range(3))
def test_swa_accepts_iff_every_node_in_the_window_holds_it(context, tombstoned):
    cache = Cache(window=context)
    nodes = cache.chain(seq(24), 8, 16, 24)
    cache.give_swa(nodes, device=True)
    cache.swa.drop(nodes[tombstoned], device=True)
    for boundary in nodes:
        # Brute force: the node is needed when it holds a token of [end - context, end).
        start = max(0, boundary.end - context)
        needed = [n for n in nodes if n.end <= boundary.end and n.end > start]
        assert cache.swa.accepts(boundary, True) == (nodes[tombstoned] not in needed), (context, tombstoned, boundary.end)
    cache.check()


def test_a_tombstone_far_from_the_boundary_does_not_reject_it():
    cache = Cache(window=12)
    a, b, c = cache.chain(seq(24), 8, 16, 24)
    cache.give_swa([a, b, c], device=True)
    cache.checkpoint(c, device=True)
    assert cache.swa.drop(a, device=True) == 8
    assert cache.tree.resume_point(c, on_device=True) is c, "A lies before C's window [12, 24)"
    assert a.parent is cache.tree.root and a.device_value is not None, "a tombstone stays on the FULL path"
    assert cache.tree.match_prefix(seq(24)).device_hit_length == 24
    assert cache.swa.drop(b, device=True) == 8
    assert cache.tree.resume_point(c, on_device=True) is cache.tree.root, "B lies inside C's window"
    cache.check()


@pytest.mark.parametrize("tiers", [(True,), (False,), (True, False)])
def test_split_divides_swa_slots_per_token_on_every_tier(tiers):
    cache = Cache(window=12)
    (node,) = cache.chain(seq(16), 16)
    cache.backup(node)
    for device in tiers:
        cache.give_swa([node], device)
    before = {device: cache.swa.slots(node, device) for device in (True, False)}
    upper = cache.tree.boundary(node, 8)
    assert upper.end == 8 and node.end == 16 and node.parent is upper
    for device in (True, False):
        original, top, bottom = before[device], cache.swa.slots(upper, device), cache.swa.slots(node, device)
        if original is None:
            assert top is None and bottom is None
            continue
        assert top is not None and bottom is not None
        assert top.tolist() == original[:8].tolist() and bottom.tolist() == original[8:].tolist()
        assert top.numel() == len(upper.key) and bottom.numel() == len(node.key)
    cache.check()
    cache.tree.evict_device(1 << 30)
    cache.tree.evict_host(1 << 30)
    assert cache.tree.token_counts()["nodes"] == 0 and cache.all_free(), "both halves were freed, each once"


def test_split_of_a_tombstoned_node_gives_the_upper_node_no_state():
    cache = Cache(window=12)
    (node,) = cache.chain(seq(16), 16)
    upper = cache.tree.boundary(node, 8)
    assert cache.swa.copies(upper) is None and cache.swa.copies(node) is None
    cache.check()


# --- RecurrentState ----------------------------------------------------------------------------


def test_a_checkpoint_is_accepted_only_at_its_own_node():
    cache = Cache(window=0)
    a, b = cache.chain(seq(16), 8, 16)
    cache.checkpoint(b, device=True)
    assert cache.mamba.accepts(b, True) and not cache.mamba.accepts(a, True) and not cache.mamba.accepts(a, False)
    assert cache.tree.resume_point(b, on_device=True) is b
    cache.check()


def test_a_split_leaves_the_checkpoint_on_the_lower_node_and_none_above():
    cache = Cache(window=0)
    (node,) = cache.chain(seq(16), 16)
    cache.backup(node)
    device_slot = cache.checkpoint(node, device=True)
    host_slot = cache.checkpoint(node, device=False)
    upper = cache.tree.boundary(node, 8)  # a boundary created in the middle
    assert node.end == 16, "the lower node keeps its end, where the checkpoint was taken"
    assert cache.mamba.slots(node, True) is device_slot and cache.mamba.slots(node, False) is host_slot
    assert cache.mamba.copies(upper) is None
    assert not cache.mamba.accepts(upper, False)
    assert cache.tree.resume_point(upper, on_device=False) is cache.tree.root
    assert cache.tree.resume_point(node, on_device=False) is node
    cache.check()


def test_a_match_ending_mid_node_splits_and_falls_back_to_an_earlier_checkpoint():
    cache = Cache(window=0)
    a, b = cache.chain(seq(32), 8, 32)
    cache.checkpoint(a, device=True)
    cache.checkpoint(b, device=True)
    match = cache.tree.match_prefix(seq(20) + [999] * 4)  # diverges inside B
    assert match.device_node.end == 20
    assert cache.tree.resume_point(match.device_node, on_device=True) is a
    cache.check()


# --- boundary ----------------------------------------------------------------------------------


def test_boundary_cuts_a_node_at_a_page_aligned_position():
    cache = Cache()
    a, b = cache.chain(seq(24), 8, 24)
    upper = cache.tree.boundary(b, 16)
    assert upper.end == 16 and upper.parent is a and b.parent is upper and upper.key == tuple(seq(8, 8))
    assert cache.tree.token_counts()["nodes"] == 3
    cache.check()


def test_boundary_cuts_an_ancestor_when_the_position_lies_above_the_node():
    cache = Cache(window=12)
    a, b = cache.chain(seq(24), 16, 24)
    cache.give_swa([a, b], device=True)
    cache.checkpoint(a, device=True)
    upper = cache.tree.boundary(b, 4)
    assert upper.end == 4 and upper.parent is cache.tree.root and a.parent is upper
    assert cache.mamba.copies(upper) is None and cache.mamba.accepts(a, True)
    assert cache.swa.slots(upper, True).numel() == 4 and cache.swa.slots(a, True).numel() == 12  # type: ignore[union-attr]
    cache.check()


def test_boundary_returns_an_existing_node_end_without_cutting():
    cache = Cache()
    a, b = cache.chain(seq(24), 8, 24)
    assert cache.tree.boundary(b, 24) is b
    assert cache.tree.boundary(b, 8) is a
    assert cache.tree.boundary(a, 8) is a
    assert cache.tree.token_counts()["nodes"] == 2
    cache.check()


def test_boundary_at_zero_is_the_root():
    cache = Cache()
    a, b = cache.chain(seq(24), 8, 24)
    assert cache.tree.boundary(b, 0) is cache.tree.root
    assert cache.tree.boundary(cache.tree.root, 0) is cache.tree.root
    assert cache.tree.token_counts()["nodes"] == 2


@pytest.mark.parametrize("position", [1, 6, 23])
def test_boundary_rejects_an_unaligned_position(position):
    cache = Cache()
    (_, b) = cache.chain(seq(24), 8, 24)
    with pytest.raises(ValueError, match="whole number"):
        cache.tree.boundary(b, position)
    assert cache.tree.token_counts()["nodes"] == 2
    cache.check()


@pytest.mark.parametrize("position", [28, 32, -4])
def test_boundary_rejects_a_position_outside_the_path(position):
    """Once a bug: a position past the end reached ``_split`` and corrupted the tree."""
    cache = Cache()
    (a, b) = cache.chain(seq(24), 8, 24)
    with pytest.raises(ValueError, match="outside the path"):
        cache.tree.boundary(b, position)
    with pytest.raises(ValueError, match="outside the path"):
        cache.tree.boundary(a, 16)
    assert cache.tree.token_counts()["nodes"] == 2
    cache.check()


# --- release: deleted nodes hand every component's slots back ----------------------------------


def test_device_eviction_of_nodes_without_host_copies_frees_every_component_slot():
    cache = Cache(window=12)
    assert cache.all_free()
    a, b, c = cache.chain(seq(24), 8, 16, 24)
    (d,) = [n for n in path(cache.tree, cache.insert(seq(8) + seq(8, 500))) if n.end == 16]
    cache.give_swa([a, b, c, d], device=True)
    cache.give_swa([b, c], device=False)  # host state on nodes whose FULL KV is only on the device
    for n in (a, c, d):
        cache.checkpoint(n, device=True)
    cache.checkpoint(b, device=False)
    cache.check()
    assert not cache.all_free()
    freed = cache.tree.evict_device(1 << 30)
    assert freed == 32 and cache.tree.token_counts()["nodes"] == 0
    for n in (a, b, c, d):
        assert n.components == {}, f"{n} left the tree still holding state"
    cache.check()
    assert cache.all_free(), {k: a.free_pages for k, (a, _) in cache.allocators().items()}


def test_host_eviction_of_host_only_nodes_frees_every_component_slot():
    cache = Cache(window=12)
    a, b = cache.chain(seq(16), 8, 16)
    cache.backup(b)
    cache.give_swa([a, b], device=True)
    cache.give_swa([a, b], device=False)
    cache.checkpoint(b, device=True)
    cache.checkpoint(b, device=False)
    assert cache.tree.evict_device(1 << 30) == 16
    assert a.device_value is None and b.device_value is None and a.host_value is not None
    # The FULL device copies are gone; the components' device state stays until their own eviction.
    assert cache.swa.slots(b, True) is not None and cache.mamba.slots(b, True) is not None
    assert cache.tree.resume_point(b, on_device=False) is b
    cache.check()
    assert cache.tree.evict_host(1 << 30) == 16
    assert cache.tree.token_counts()["nodes"] == 0
    cache.check()
    assert cache.all_free()


def test_pruning_a_staged_host_node_frees_its_component_state():
    cache = Cache(window=12)
    (a,) = cache.chain(seq(8), 8)
    host = cache.full_host.alloc(8)
    assert host is not None
    placed = cache.tree.insert_host(seq(16), 8, host)
    assert placed is not None and placed.inserted_tokens == 8
    (b,) = a.children.values()
    cache.give_swa([b], device=False)
    cache.checkpoint(b, device=False)
    cache.check()
    cache.tree.drop_host_value(b)
    assert b.parent is None and b.components == {}
    cache.check()


# --- PooledComponent eviction ------------------------------------------------------------------


def three_branches(cache: Cache) -> list[TreeNode]:
    """Three one-node branches inserted at times 1, 2, 3, each holding one page of SWA on the device."""
    nodes = [cache.insert(seq(PAGE, 100 * (i + 1))) for i in range(3)]
    cache.give_swa(nodes, device=True)
    return nodes


def test_alloc_tombstones_the_least_recently_used_holder_first():
    cache = Cache(window=PAGE, swa_pages=3)
    old, middle, new = three_branches(cache)
    cache.clock.tick()
    cache.tree.match_prefix(seq(PAGE, 100))  # touches ``old``: now the most recent
    slots = cache.swa.alloc(PAGE, device=True)
    assert slots is not None
    assert cache.swa.copies(middle) is None, "the least recently used holder loses its state"
    assert cache.swa.present(old, True) and cache.swa.present(new, True)
    assert middle.parent is cache.tree.root and middle.device_value is not None, "a tombstone: the node stays"
    cache.swa.device_allocator.free(slots)
    cache.check()


def test_device_alloc_never_tombstones_a_window_being_read_but_may_take_a_locked_node_outside_it():
    """A running request locks its whole path but reads only the window before its resume point:
    SWA KV elsewhere on the path is never read again while it runs, so it may go."""
    cache = Cache(window=PAGE, swa_pages=3)
    old, middle, new = three_branches(cache)
    assert cache.swa.read(old) == [old]
    cache.tree.lock(middle)
    slots = cache.swa.alloc(2 * PAGE, device=True)
    assert slots is not None
    assert cache.swa.present(old, True) and not cache.swa.present(middle, True) and not cache.swa.present(new, True)
    assert cache.swa.alloc(PAGE, device=True) is None, "only the window being read is left: nothing is taken"
    cache.swa.unread(old)
    more = cache.swa.alloc(PAGE, device=True)
    assert more is not None and not cache.swa.present(old, True)
    cache.tree.unlock(middle)
    cache.swa.device_allocator.free(torch.cat([slots, more]))
    cache.check()


def test_checkpoint_alloc_never_tombstones_a_locked_node():
    cache = Cache(checkpoints=2)
    first, second = cache.insert(seq(8, 100)), cache.insert(seq(8, 200))
    for node in (first, second):
        cache.mamba.set(node, cache.mamba.alloc(1, device=True), device=True)
    cache.tree.lock(first)
    assert cache.mamba.alloc(1, device=True) is not None
    assert cache.mamba.present(first, True) and not cache.mamba.present(second, True)
    assert cache.mamba.alloc(1, device=True) is None, "only a locked checkpoint is left"
    cache.tree.unlock(first)


def test_alloc_on_the_host_never_tombstones_a_node_with_host_io_or_a_lock():
    cache = Cache(window=PAGE, swa_pages=3)
    old, middle, new = [cache.insert(seq(PAGE, 100 * (i + 1))) for i in range(3)]
    for n in (old, middle, new):
        cache.backup(n)
    cache.give_swa([old, middle, new], device=False)
    cache.tree.protect_host(old, old.end - len(old.key))
    cache.tree.lock(middle)
    assert cache.swa.evict(PAGE, device=False) == PAGE
    assert cache.swa.slots(new, False) is None
    assert cache.swa.slots(old, False) is not None and cache.swa.slots(middle, False) is not None
    assert cache.swa.evict(2 * PAGE, device=False) == 0, "what is left is protected"
    assert cache.swa.slots(old, False) is not None and cache.swa.slots(middle, False) is not None
    cache.tree.release_host(old, old.end - len(old.key))
    cache.tree.unlock(middle)
    cache.check()


def test_eviction_stops_once_enough_is_free():
    cache = Cache(window=PAGE, swa_pages=4)
    old, middle, new = three_branches(cache)
    assert cache.swa.evict(PAGE, device=True) == 0, "a page is free already"
    assert cache.swa.evict(2 * PAGE, device=True) == PAGE
    assert not cache.swa.present(old, True) and cache.swa.present(middle, True)
    cache.check()


def test_checkpoint_eviction_frees_the_lru_checkpoint_only():
    cache = Cache(window=0, checkpoints=2)
    first, second = cache.insert(seq(8, 100)), cache.insert(seq(8, 200))
    cache.checkpoint(first, device=True)
    cache.checkpoint(second, device=True)
    third = cache.insert(seq(8, 300))
    cache.checkpoint(third, device=True)
    assert not cache.mamba.present(first, True) and cache.mamba.present(second, True)
    assert cache.tree.resume_point(first, on_device=True) is cache.tree.root
    assert cache.tree.resume_point(third, on_device=True) is third
    cache.check()


def test_component_eviction_counts_a_node_as_recent_as_its_subtree():
    """Once a bug: a match stamps only its deepest node, and component eviction read the raw
    access time, so the just-matched path's ancestor lost its state before an older branch."""
    cache = Cache(window=8, swa_pages=3)
    a, b = cache.chain(seq(8, 100), 4, 8)  # times 1 and 2
    other = cache.insert(seq(PAGE, 900))  # time 3
    cache.give_swa([a, b, other], device=True)
    cache.checkpoint(b, device=True)
    cache.clock.tick()
    cache.tree.match_prefix(seq(8, 100))  # stamps b only; a is on the path as well
    assert cache.tree.resume_point(b, on_device=True) is b
    slots = cache.swa.alloc(PAGE, device=True)
    assert slots is not None
    assert cache.swa.present(a, True), "the least recently used holder is the other branch"
    assert cache.tree.resume_point(b, on_device=True) is b


def test_component_eviction_takes_unreferenced_state_first_but_pins_nothing():
    cache = Cache(window=8, swa_pages=4)
    a, b = cache.chain(seq(8, 100), 4, 8)  # times 1 and 2
    middle = cache.insert(seq(PAGE, 800))  # time 3
    new = cache.insert(seq(PAGE, 900))  # time 4
    cache.give_swa([a, b, middle, new], device=True)
    assert cache.tree.add_session_ref(b)
    assert cache.swa.evict(PAGE, device=True) == PAGE
    assert not cache.swa.present(middle, True), "the oldest unreferenced holder goes first"
    assert cache.swa.present(a, True), "a leads to a session-referenced node: referenced too"
    assert cache.tree.add_session_ref(new)
    assert cache.swa.evict(2 * PAGE, device=True) == PAGE
    assert not (cache.swa.present(a, True) and cache.swa.present(b, True)), "everything referenced: still evicted (no pin)"
    assert cache.swa.present(new, True), "and least recently used first"
    cache.tree.drop_session_ref(b)
    cache.tree.drop_session_ref(new)
    cache.check()


def test_drop_frees_one_tier_and_keeps_the_node():
    cache = Cache(window=12)
    (node,) = cache.chain(seq(8), 8)
    cache.backup(node)
    cache.give_swa([node], device=True)
    cache.give_swa([node], device=False)
    assert cache.swa.drop(node, device=True) == 8
    assert cache.swa.slots(node, True) is None and cache.swa.slots(node, False) is not None
    assert cache.swa.drop(node, device=True) == 0, "nothing left on that tier"
    assert cache.swa.drop(node, device=False) == 8
    assert "swa" not in node.components, "a node with no state on either tier keeps no record"
    assert node.parent is cache.tree.root and node.device_value is not None and node.host_value is not None
    cache.check()
    assert cache.swa.device_allocator.free_pages == cache.swa.device_allocator.num_pages


# --- a new component needs no new tree ---------------------------------------------------------


def test_a_third_component_plugs_into_the_same_tree_and_votes():
    indexer = Indexer(PageAllocator(16, PAGE))
    cache = Cache(window=12, extra=(indexer,))
    a, b, c = cache.chain(seq(24), 8, 16, 24)
    cache.give_swa([a, b, c], device=True)
    for n in (a, b, c):
        cache.checkpoint(n, device=True)
    assert cache.tree.resume_point(c, on_device=True) is cache.tree.root, "no index keys anywhere yet"
    for n in (a, b, c):
        assert indexer.give(n)
    assert cache.tree.resume_point(c, on_device=True) is c
    indexer.take(b)
    assert cache.tree.resume_point(c, on_device=True) is a, "the indexer alone rejects C and B"
    cache.check()
    # Its split and release rules run through the same tree hooks as the built-in components.
    slots = c.components["indexer"]
    upper = cache.tree.boundary(c, 20)
    assert upper.components["indexer"].tolist() + c.components["indexer"].tolist() == slots.tolist()  # type: ignore[union-attr]
    assert cache.tree.resume_point(upper, on_device=True) is a, "no checkpoint at the new boundary"
    cache.check()
    cache.tree.evict_device(1 << 30)
    assert cache.tree.token_counts()["nodes"] == 0
    cache.check()
    assert cache.all_free()


# --- random sequences --------------------------------------------------------------------------

#: Page "words": paths made of a few distinct pages share prefixes often.
WORDS = [seq(PAGE, 10 * w) for w in range(3)]
paths = st.lists(st.integers(0, len(WORDS) - 1), min_size=1, max_size=5).map(lambda ws: [t for w in ws for t in WORDS[w]])
WINDOW = 6


def brute_resume_point(cache: Cache, node: TreeNode, on_device: bool) -> TreeNode:
    """Evaluate every boundary on the path from the raw per-node state, deepest first."""
    nodes = path(cache.tree, node)

    def holds(n: TreeNode, name: str) -> bool:
        copies = n.components.get(name)
        return isinstance(copies, Copies) and (copies.device is not None or (not on_device and copies.host is not None))

    def usable(depth: int) -> bool:
        end = nodes[depth].end
        covering = {t: n for n in nodes[: depth + 1] for t in range(n.end - len(n.key), n.end)}
        swa = all(holds(covering[t], "swa") for t in range(max(0, end - WINDOW), end))
        indexed = all("indexer" in n.components for n in nodes[: depth + 1])
        return swa and holds(nodes[depth], "mamba") and indexed

    for depth in reversed(range(len(nodes))):
        if usable(depth):
            return nodes[depth]
    return cache.tree.root


class HybridTreeMachine(RuleBasedStateMachine):
    """Random inserts, matches (splits), boundaries, backups, component state, tombstones, locks,
    windows being read and evictions on a tree with SWA, MAMBA and the toy indexer, all pools small enough that
    component allocations evict each other."""

    def __init__(self) -> None:
        super().__init__()
        self.indexer = Indexer(PageAllocator(12, PAGE))
        self.cache = Cache(window=WINDOW, full_pages=12, swa_pages=8, checkpoints=3, extra=(self.indexer,))
        self.locks: list[TreeNode] = []
        self.protected: list[tuple[TreeNode, int]] = []
        self.reads: list[TreeNode] = []
        # The model of what each slot holds: the token position of an SWA slot, the boundary of
        # a checkpoint, keyed by (tier, slot). Splits must keep every node's state where it was taken.
        self.swa_position: dict[tuple[bool, int], int] = {}
        self.checkpoint_end: dict[tuple[bool, int], int] = {}

    def pick(self, index: int) -> TreeNode:
        nodes = sorted(self.cache.tree.nodes(), key=lambda n: n.id)
        return nodes[index % len(nodes)]

    @property
    def has_nodes(self) -> bool:
        return bool(self.cache.tree.root.children)

    @rule(tokens=paths)
    def insert(self, tokens: list[int]) -> None:
        tree, cache = self.cache.tree, self.cache
        cache.clock.tick()
        if cache.full_device.free_pages * PAGE < len(tokens):
            tree.evict_device(len(tokens))
        slots = cache.full_device.alloc(len(tokens))
        if slots is None:
            return  # too much is locked
        result = tree.insert(tokens, slots)
        if result.duplicate_length:
            cache.full_device.free(slots[: result.duplicate_length])

    @rule(tokens=paths, cut=st.integers(0, 5))
    def match(self, tokens: list[int], cut: int) -> None:
        self.cache.clock.tick()
        self.cache.tree.match_prefix(tokens[: cut * PAGE + PAGE])

    @precondition(lambda self: self.has_nodes)
    @rule(index=st.integers(0, 99), pages=st.integers(0, 5))
    def cut(self, index: int, pages: int) -> None:
        """A boundary on the path, most often inside ``node`` (a split)."""
        node = self.pick(index)
        self.cache.tree.boundary(node, max(0, node.end - pages * PAGE))

    @precondition(lambda self: self.has_nodes)
    @rule(index=st.integers(0, 99))
    def backup(self, index: int) -> None:
        for n in path(self.cache.tree, self.pick(index)):
            if n.host_value is None and n.device_value is not None:
                slots = self.cache.full_host.alloc(len(n.key))
                if slots is None:
                    return
                n.host_value = slots

    def _give_swa(self, node: TreeNode, device: bool) -> None:
        swa = self.cache.swa
        if swa.slots(node, device) is None:
            slots = swa.alloc(len(node.key), device)
            if slots is not None:
                swa.set(node, slots, device)
                start = node.end - len(node.key)
                self.swa_position.update({(device, slot): start + i for i, slot in enumerate(slots.tolist())})

    def _give_checkpoint(self, node: TreeNode, device: bool) -> None:
        mamba = self.cache.mamba
        if mamba.slots(node, device) is None:
            slot = mamba.alloc(1, device)
            if slot is not None:
                mamba.set(node, slot, device)
                self.checkpoint_end[(device, int(slot))] = node.end

    @precondition(lambda self: self.has_nodes)
    @rule(index=st.integers(0, 99), device=st.booleans())
    def give_swa(self, index: int, device: bool) -> None:
        self._give_swa(self.pick(index), device)

    @precondition(lambda self: self.has_nodes)
    @rule(index=st.integers(0, 99), device=st.booleans())
    def give_checkpoint(self, index: int, device: bool) -> None:
        self._give_checkpoint(self.pick(index), device)

    @precondition(lambda self: self.has_nodes)
    @rule(index=st.integers(0, 99))
    def give_index(self, index: int) -> None:
        self.indexer.give(self.pick(index))

    @precondition(lambda self: self.has_nodes)
    @rule(index=st.integers(0, 99), device=st.booleans())
    def make_resumable(self, index: int, device: bool) -> None:
        """What a finished request leaves: index keys on the path, SWA on the window, a checkpoint."""
        node = self.pick(index)
        for n in path(self.cache.tree, node):
            self.indexer.give(n)
        for n in self.cache.swa.window(node):
            self._give_swa(n, device)
        self._give_checkpoint(node, device)

    @precondition(lambda self: self.has_nodes)
    @rule(index=st.integers(0, 99), which=st.sampled_from(["swa", "mamba", "indexer"]), device=st.booleans())
    def tombstone(self, index: int, which: str, device: bool) -> None:
        node = self.pick(index)
        if which == "indexer":
            self.indexer.take(node)
        else:
            (self.cache.swa if which == "swa" else self.cache.mamba).drop(node, device)

    @rule(which=st.sampled_from(["swa", "mamba"]), device=st.booleans(), count=st.integers(1, 12))
    def component_pressure(self, which: str, device: bool, count: int) -> None:
        component = self.cache.swa if which == "swa" else self.cache.mamba
        if which == "swa" and device:  # a running request's path may lose SWA KV outside the window it reads
            locked = {id(n) for n in self.cache.tree.nodes() if self.cache.swa.being_read(n)}
        else:
            locked = {id(n) for n in self.cache.tree.nodes() if n.lock_ref or (not device and n.host_ref)}
        kept = {id(n): component.slots(n, device) for n in self.cache.tree.nodes() if id(n) in locked}
        component.evict(count, device)
        for n in self.cache.tree.nodes():
            if id(n) in kept:
                assert component.slots(n, device) is kept[id(n)], f"{component.name} evicted a protected node"

    @rule(device=st.booleans(), count=st.integers(1, 24))
    def evict(self, device: bool, count: int) -> None:
        if device:
            self.cache.tree.evict_device(count)
        else:
            self.cache.tree.evict_host(count)

    @precondition(lambda self: self.has_nodes and len(self.locks) < 2)
    @rule(index=st.integers(0, 99))
    def lock(self, index: int) -> None:
        node = self.pick(index)
        if node.device_value is not None:
            self.cache.tree.lock(node)
            self.locks.append(node)

    @precondition(lambda self: self.locks)
    @rule()
    def unlock(self) -> None:
        self.cache.tree.unlock(self.locks.pop(0))

    @precondition(lambda self: self.has_nodes and len(self.reads) < 2)
    @rule(index=st.integers(0, 99))
    def read_window(self, index: int) -> None:
        """A request resumes at a node: its path is locked and the window before it is read."""
        node = self.pick(index)
        if node.device_value is not None:
            self.cache.tree.lock(node)
            self.cache.swa.read(node)
            self.reads.append(node)

    @precondition(lambda self: self.reads)
    @rule()
    def finish_reading(self) -> None:
        node = self.reads.pop(0)
        self.cache.swa.unread(node)
        self.cache.tree.unlock(node)

    @precondition(lambda self: self.has_nodes and len(self.protected) < 2)
    @rule(index=st.integers(0, 99))
    def protect_host(self, index: int) -> None:
        node = self.pick(index)
        assume(node.host_value is not None)  # I/O reads or writes host pages
        begin = node.end - len(node.key)
        self.cache.tree.protect_host(node, begin)
        self.protected.append((node, begin))

    @precondition(lambda self: self.protected)
    @rule()
    def release_host(self) -> None:
        self.cache.tree.release_host(*self.protected.pop(0))

    @invariant()
    def slots_are_owned_once_and_nothing_leaks(self) -> None:
        self.cache.check()

    @invariant()
    def state_stays_where_it_was_taken(self) -> None:
        swa, mamba = self.cache.swa, self.cache.mamba
        for node in self.cache.tree.nodes():
            for device in (True, False):
                slots = swa.slots(node, device)
                if slots is not None:
                    positions = [self.swa_position[(device, slot)] for slot in slots.tolist()]
                    assert positions == list(range(node.end - len(node.key), node.end)), f"{node}: SWA slots of other tokens"
                slot = mamba.slots(node, device)
                if slot is not None:
                    assert self.checkpoint_end[(device, int(slot))] == node.end, f"{node}: a checkpoint taken elsewhere"

    @invariant()
    def resume_point_is_the_deepest_boundary_all_accept(self) -> None:
        tree = self.cache.tree
        for node in tree.nodes():
            for on_device in (True, False):
                assert tree.resume_point(node, on_device=on_device) is brute_resume_point(self.cache, node, on_device)

    def teardown(self) -> None:
        while self.locks:
            self.unlock()
        while self.reads:
            self.finish_reading()
        while self.protected:
            self.release_host()
        self.cache.tree.evict_device(1 << 30)
        self.cache.tree.evict_host(1 << 30)
        self.cache.check()
        assert self.cache.tree.token_counts()["nodes"] == 0 and self.cache.all_free(), "deleting every node freed every slot"


HybridTreeMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestHybridTreeMachine = HybridTreeMachine.TestCase
