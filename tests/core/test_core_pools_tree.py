"""Pools (page allocator, host layouts, zero-copy page views, sizing) and the radix tree."""

from __future__ import annotations

import threading

import pytest
import torch

from hicache_core.pools import DevicePool, HostMemoryError, HostPool, KVGeometry, PageAllocator, available_memory_bytes
from hicache_storage.keys import page_hashes
from tree_helpers import Frees, slots

MHA = KVGeometry(layers=3, kv_heads=2, head_dim=4)
MLA = KVGeometry(layers=3, kv_heads=1, head_dim=8, is_mla=True)


# --- allocator ----------------------------------------------------------------------------------


def test_allocator_hands_out_whole_pages_and_refuses_when_full():
    alloc = PageAllocator(num_pages=4, page_size=4)
    a = alloc.alloc(5)
    assert a is not None and a.numel() == 8 and a[0] % 4 == 0 and a[4] % 4 == 0
    b = alloc.alloc(8)
    assert b is not None and alloc.free_pages == 0
    assert alloc.alloc(1) is None, "a full allocator gives nothing, never a partial allocation"
    alloc.free(a)
    assert alloc.free_pages == 2
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(a)
    with pytest.raises(ValueError, match="page boundary"):
        alloc.free(b[1:5])


def test_allocator_hands_out_the_lowest_free_pages_so_pages_freed_together_come_back_as_one_run():
    alloc = PageAllocator(num_pages=8, page_size=2)
    pages = [alloc.alloc(4) for _ in range(4)]  # pages 0-1, 2-3, 4-5, 6-7
    assert all(p is not None for p in pages)
    for p in (pages[3], pages[0], pages[2]):  # freed out of order, as eviction does
        alloc.free(p)
    again = alloc.alloc(8)
    assert again is not None
    assert again.tolist() == [0, 1, 2, 3, 8, 9, 10, 11], "two runs (pages 0-1 and 4-5), lowest first"


def test_pinned_page_is_not_reused_until_io_finishes():
    alloc = PageAllocator(num_pages=2, page_size=2)
    slots = alloc.alloc(4)
    alloc.pin_io(slots[:2])
    alloc.free(slots)
    assert alloc.idle_pages == 1, "the page with I/O in flight must not return to the free list"
    assert alloc.free_pages == 2, "but it counts as free, so decisions do not depend on I/O timing"
    again = alloc.alloc(2)
    assert again is not None and set(again.tolist()) == set(slots[2:].tolist())
    assert alloc.alloc(4) is None, "more than will ever be free: refused at once"
    got: list[torch.Tensor] = []
    waiter = threading.Thread(target=lambda: got.append(alloc.alloc(2)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got, "the allocation waits for the I/O instead of reusing the page"
    assert alloc.awaited, "I/O threads can see that an allocation waits on their pins"
    alloc.unpin_io(slots[:2])
    waiter.join()
    assert not alloc.awaited
    assert set(got[0].tolist()) == set(slots[:2].tolist())


def test_alloc_evicting_with_agreement_evicts_instead_of_waiting_for_io_on_freed_pages():
    """Pages freed under I/O count as free, and a plain allocation of them waits for the I/O
    (a storage backup: up to a second behind a slow write-through queue). Given ``agree``, the
    shortfall is counted against the pages free now and evicted (the agreed count: every TP rank
    evicts the same), so the caller gets pages at once."""
    alloc = PageAllocator(num_pages=4, page_size=2)
    under_io, cached = alloc.alloc(4), alloc.alloc(4)
    assert under_io is not None and cached is not None
    alloc.pin_io(under_io)
    alloc.free(under_io)  # a deleted node whose backup is still writing
    assert alloc.free_pages == 2 and alloc.idle_pages == 0
    evicted: list[int] = []

    def evict(tokens: int) -> None:
        evicted.append(tokens)
        alloc.free(cached)  # the tree drops a cached page set nothing uses

    asked: list[int] = []
    got: list[torch.Tensor | None] = []
    caller = threading.Thread(target=lambda: got.append(alloc.alloc_evicting(4, evict, lambda short: asked.append(short) or short)), daemon=True)
    caller.start()
    caller.join(30.0)  # a guard against a hang, never a timing assertion
    assert not caller.is_alive(), "the allocation waited for the I/O although eviction could free pages"
    assert asked == [2] and evicted == [4], "the shortfall of pages free now, agreed, then evicted"
    assert got[0] is not None and set(got[0].tolist()) == set(cached.tolist())

    # Another rank short: this one evicts the agreed count although its own pages sufficed.
    alloc = PageAllocator(num_pages=4, page_size=2)
    evicted.clear()
    assert alloc.alloc_evicting(2, evicted.append, lambda short: max(short, 1)) is not None
    assert evicted == [2], "every rank evicts what the most short rank needs, so their trees stay the same"

    # Without agreement the old rule holds: pages freed under I/O count, and the allocation waits.
    alloc = PageAllocator(num_pages=2, page_size=2)
    under_io = alloc.alloc(4)
    assert under_io is not None
    alloc.pin_io(under_io)
    alloc.free(under_io)
    evicted.clear()
    waiter = threading.Thread(target=lambda: got.append(alloc.alloc_evicting(4, evicted.append)), daemon=True)
    waiter.start()
    for _ in range(3000):  # a guard against a hang, never a timing assertion
        if alloc.awaited:
            break
        waiter.join(0.01)
    assert alloc.awaited and not evicted, "nothing evicted: it waits for the pages under I/O"
    alloc.unpin_io(under_io)
    waiter.join(30.0)
    assert not waiter.is_alive() and got[-1] is not None


# --- host pool ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "geometry,layout,segments",
    [
        (MHA, "page_first", 2),
        (MHA, "page_first_direct", 2),
        (MHA, "layer_first", 2 * MHA.layers),
        (MLA, "page_first", 1),
        (MLA, "page_first_direct", 1),
        (MLA, "layer_first", MLA.layers),
    ],
)
def test_page_views_are_zero_copy_and_cover_the_page(geometry, layout, segments):
    host = HostPool(geometry, page_size=4, layout=layout, num_pages=8)
    host.kv.copy_(torch.arange(host.kv.numel(), dtype=host.kv.dtype).view_as(host.kv))
    slots = host.allocator.alloc(8)
    views = host.segments_for(slots)
    assert len(views) == 2
    base, end = host.kv.data_ptr(), host.kv.data_ptr() + host.kv.numel() * host.kv.element_size()
    for page in views:
        assert len(page) == segments
        assert sum(v.numel() * v.element_size() for v in page) == host.page_bytes
        for view in page:
            assert view.is_contiguous() and base <= view.data_ptr() < end, "a view, not a copy"
    views[0][0].fill_(-1)
    assert (host.kv == -1).sum().item() == views[0][0].numel(), "writing a view writes the pool"


def test_host_pool_sizing_by_ratio_and_bytes():
    device = DevicePool(MHA, num_pages=10, page_size=4, device="cpu")
    assert HostPool(MHA, 4, num_pages=None, ratio=2.5, device_pool=device).num_pages == 25
    page_bytes = MHA.token_bytes * 4
    assert HostPool(MHA, 4, size_bytes=page_bytes * 7 + 1).num_pages == 7
    with pytest.raises(ValueError, match="exactly one"):
        HostPool(MHA, 4, ratio=1.0, size_bytes=100, device_pool=device)


def test_host_pool_larger_than_ram_fails_with_a_clear_error():
    available = available_memory_bytes()
    assert available is not None, "this machine exposes /proc/meminfo or sysconf"
    with pytest.raises(HostMemoryError, match="GiB of RAM is available.*lower the host ratio or size"):
        HostPool(MHA, 4, size_bytes=available * 4)


# --- radix tree ---------------------------------------------------------------------------------


def test_insert_split_and_match_keep_page_hashes_right():
    frees = Frees()
    tree = frees.tree()
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [1, 2, 3, 4, 9, 9]
    assert tree.insert(a, slots(0, 8)).duplicate_length == 0
    result = tree.insert(b, slots(100, 6))
    assert result.duplicate_length == 4, "the shared first two pages were cached already"
    tree.check_invariants()
    match = tree.match_prefix(b + [5])
    assert match.device_indices.tolist() == list(range(4)) + [104, 105]
    assert match.device_node.page_hashes[-1] == page_hashes(b, 2)[-1]
    assert tree.match_prefix([1, 2, 3]).device_hit_length == 2, "a partial page never matches"


def test_device_eviction_is_lru_and_spares_locked_nodes():
    frees = Frees()
    tree = frees.tree()
    tree.insert([1, 1, 2, 2], slots(0, 4))
    tree.insert([3, 3, 4, 4], slots(10, 4))
    tree.insert([5, 5, 6, 6], slots(20, 4))
    tree.match_prefix([1, 1, 2, 2])  # refresh: now the most recently used
    locked = tree.match_prefix([3, 3, 4, 4]).device_node
    tree.lock(locked)
    assert tree.evict_device(4) == 4
    assert sorted(frees.device) == list(range(20, 24)), "the least recently used unlocked node goes first"
    assert tree.evict_device(100) == 4
    assert sorted(frees.device) == list(range(0, 4)) + list(range(20, 24)), "the locked node stays"
    tree.unlock(locked)
    tree.check_invariants()


def test_match_reports_host_hit_and_deepest_backed_up_node():
    frees = Frees()
    tree = frees.tree()
    tree.insert([1, 1, 2, 2, 3, 3], slots(0, 6))
    node = tree.match_prefix([1, 1, 2, 2, 3, 3]).device_node
    node.host_value = slots(50, 6)
    tree.insert([1, 1, 2, 2, 3, 3, 4, 4], slots(0, 8))  # adds an unbacked child
    assert tree.evict_device(8, backup=None) == 8
    # The unbacked child was deleted, the backed-up node stays on the host only.
    match = tree.match_prefix([1, 1, 2, 2, 3, 3, 4, 4, 7])
    assert match.device_hit_length == 0 and match.host_hit_length == 6
    assert match.backed_up_node is node and match.host_node is node
    assert tree.match_prefix([1, 1, 2, 2, 3, 3], count_host=False).host_hit_length == 0


def test_host_eviction_never_takes_protected_or_locked_nodes():
    frees = Frees()
    tree = frees.tree()
    for i, start in enumerate((0, 10, 20)):
        tree.insert([i, i, 9, 9], slots(start, 4))
        node = tree.match_prefix([i, i, 9, 9]).device_node
        node.host_value = slots(100 + start, 4)
    tree.evict_device(100)  # all three become host-only
    protected = tree.match_prefix([0, 0, 9, 9]).host_node
    locked = tree.match_prefix([1, 1, 9, 9]).host_node
    tree.protect_host(protected, 0)
    tree.lock(locked)
    assert tree.evict_host(100) == 4
    assert sorted(frees.host) == list(range(120, 124))
    tree.release_host(protected, 0)
    tree.unlock(locked)
    assert tree.evict_host(100) == 8
    assert tree.token_counts() == {"device": 0, "host": 0, "nodes": 0}


def test_insert_host_attaches_below_the_prefix_and_returns_duplicates():
    frees = Frees()
    tree = frees.tree()
    tree.insert([1, 1, 2, 2], slots(0, 4))
    result = tree.insert_host([1, 1, 2, 2, 3, 3, 4, 4], 2, slots(60, 6))
    assert result is not None and result.inserted_tokens == 4
    assert [u.tolist() for u in result.unused] == [[60, 61]], "page [2, 2] is on the device already"
    match = tree.match_prefix([1, 1, 2, 2, 3, 3, 4, 4])
    assert match.device_hit_length == 4 and match.host_hit_length == 4
    assert tree.insert_host([5, 5, 6, 6], 2, slots(70, 2)) is None, "no prefix [5, 5]: nothing to attach to"
    tree.check_invariants()


def test_device_hit_length_is_the_matched_device_prefix_and_changes_nothing():
    tree = Frees().tree(page_size=2)
    node = tree.insert(list(range(8)), slots(0, 8)).last_node
    tree.insert(list(range(4)) + [9, 9], slots(20, 6))  # a branch: the first node now ends at 4
    before = [(n.end, len(n.key), n.last_access) for n in tree.path(node)]
    assert tree.device_hit_length(list(range(6)) + [5, 5]) == 6, "inside a node: no split"
    assert [(n.end, len(n.key), n.last_access) for n in tree.path(node)] == before
    tree.evict_device(4)  # the deeper half of the path (4 tokens) leaves the device
    assert tree.device_hit_length(list(range(8))) == 4
    assert tree.match_prefix(list(range(8))).device_hit_length == 4
    assert tree.device_hit_length([7, 7]) == 0
