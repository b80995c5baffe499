"""Session-aware eviction: referenced prefixes go last, never pinned; close and stale requests.

Tree-level tests drive :class:`RadixTree` and :class:`SessionTable` directly (slots are plain
integers, freed slots are recorded in order). Engine tests run the reference model; the last
test runs one workload under memory pressure twice, plain LRU and with sessions, and compares the
sessions' hits (the outputs must be identical: the reference model is bit-exact whatever the
cache does).
"""

from __future__ import annotations

import pytest
import torch

from hicache_core import CacheTiers, Engine, EngineConfig, Request, SessionTable
from hicache_core.radix_tree import RadixTree, TreeNode
from tree_helpers import Frees, slots


def node_of(tree: RadixTree, tokens: list[int]) -> TreeNode:
    node = tree.match_prefix(tokens).host_node
    assert node.end == len(tokens), f"{tokens} is not cached whole"
    return node


def back_up(tree: RadixTree, tokens: list[int], start: int) -> None:
    """Give every node on the path of ``tokens`` a host copy (host slots from ``start``)."""
    node = node_of(tree, tokens)
    while node is not tree.root:
        node.host_value = slots(start + node.end - len(node.key), len(node.key))
        node = node.parent


# --- the tree ------------------------------------------------------------------------------------


def test_device_eviction_takes_unreferenced_nodes_first_then_referenced_ones():
    frees = Frees()
    tree = frees.tree()
    sessions = SessionTable(tree)
    tree.insert([1, 1, 2, 2], slots(0, 4))  # oldest: plain LRU would take it first
    tree.insert([3, 3, 4, 4], slots(10, 4))
    tree.insert([5, 5, 6, 6], slots(20, 4))
    assert sessions.reference(sessions.ticket("a"), node_of(tree, [1, 1, 2, 2]))
    tree.match_prefix([5, 5, 6, 6])  # now the most recently used
    assert tree.evict_device(4) == 4
    assert frees.device == list(range(10, 14)), "the least recently used unreferenced node goes first"
    assert tree.evict_device(4) == 4
    assert frees.device[4:] == list(range(20, 24)), "even a more recent unreferenced node goes before a referenced one"
    assert tree.evict_device(4) == 4, "no pinning: the referenced node goes when nothing else is left"
    assert frees.device[8:] == list(range(0, 4))
    assert tree.token_counts()["nodes"] == 0
    tree.check_invariants()


def test_without_sessions_eviction_is_plain_lru():
    frees = Frees()
    tree = frees.tree()
    tree.insert([1, 1, 2, 2], slots(0, 4))
    tree.insert([3, 3, 4, 4], slots(10, 4))
    tree.insert([5, 5, 6, 6], slots(20, 4))
    tree.match_prefix([1, 1, 2, 2])
    assert tree.evict_device(100) == 12
    assert frees.device == list(range(10, 14)) + list(range(20, 24)) + list(range(0, 4))


def test_ancestors_of_a_referenced_node_count_as_referenced():
    frees = Frees()
    tree = frees.tree()
    sessions = SessionTable(tree)
    tree.insert([1, 1, 2, 2, 3, 3], slots(0, 6))
    sessions.reference(sessions.ticket("a"), node_of(tree, [1, 1, 2, 2, 3, 3]))
    tree.insert([1, 1, 2, 2, 4, 4], slots(10, 6))  # splits off the shared [1, 1, 2, 2]
    tree.insert([7, 7, 8, 8], slots(20, 4))
    back_up(tree, [1, 1, 2, 2, 3, 3], 100)
    # The referenced leaf [3, 3] leaves the device first (it is the least recently used leaf
    # once the unreferenced ones are gone) and stays on the host: its parent [1, 1, 2, 2] is
    # now a device leaf that leads to a referenced node, so it goes after the unreferenced [7, 7, 8, 8].
    assert tree.evict_device(2) == 2 and frees.device == [14, 15], "the unreferenced branch [4, 4] first"
    assert tree.evict_device(2) == 4 and frees.device[2:] == [20, 21, 22, 23], "then the unreferenced [7, 7, 8, 8]"
    assert tree.evict_device(2) == 2 and frees.device[6:] == [4, 5], "then the referenced leaf (it has a host copy)"
    tree.insert([9, 9], slots(30, 2))
    assert tree.evict_device(2) == 2 and frees.device[8:] == [30, 31], (
        "a device leaf above a referenced host-only node is still referenced"
    )
    match = tree.match_prefix([1, 1, 2, 2, 3, 3, 0])
    assert (match.device_hit_length, match.host_hit_length) == (4, 2)
    tree.check_invariants()


def test_host_eviction_takes_unreferenced_nodes_first_then_referenced_ones():
    frees = Frees()
    tree = frees.tree()
    sessions = SessionTable(tree)
    ticket = sessions.ticket("a")
    for i, start in enumerate((0, 10, 20)):
        tree.insert([i, i, 9, 9], slots(start, 4))
        back_up(tree, [i, i, 9, 9], 100 + start)
    sessions.reference(ticket, node_of(tree, [0, 0, 9, 9]))
    assert tree.evict_device(100) == 12 and frees.device == [10, 11, 12, 13, 20, 21, 22, 23, 0, 1, 2, 3]
    # Host-only now: [0, 0, 9, 9] (the oldest, referenced), [1, 1, 9, 9], [2, 2, 9, 9].
    # On the device with a host copy: [5, 5] (referenced) and [6, 6].
    tree.insert([5, 5], slots(40, 2))
    back_up(tree, [5, 5], 140)
    tree.insert([6, 6], slots(50, 2))
    back_up(tree, [6, 6], 150)
    sessions.reference(ticket, node_of(tree, [5, 5]))
    assert tree.evict_host(8) == 8 and frees.host == [110, 111, 112, 113, 120, 121, 122, 123], (
        "unreferenced host-only nodes first, least recently used first"
    )
    assert tree.evict_host(2) == 2 and frees.host[8:] == [150, 151], "then unreferenced host copies of device nodes"
    assert tree.evict_host(2) == 2 and frees.host[10:] == [140, 141], (
        "a referenced node still on the device loses its host copy before a referenced host-only node is deleted"
    )
    assert tree.evict_host(4) == 4 and frees.host[12:] == [100, 101, 102, 103], "no pinning on the host either"
    assert tree.token_counts() == {"device": 4, "host": 0, "nodes": 2}
    tree.check_invariants()


def test_close_drops_references_but_keeps_the_data():
    frees = Frees()
    tree = frees.tree()
    sessions = SessionTable(tree)
    node = tree.insert([1, 1, 2, 2], slots(0, 4)).last_node
    tree.insert([3, 3, 4, 4], slots(10, 4))
    sessions.reference(sessions.ticket("a"), node)
    before = tree.token_counts()
    assert sessions.close("a") and "a" not in sessions
    assert node.session_refs == 0 and tree.token_counts() == before, "the data is still cached"
    assert tree.in_tree(node) and node.device_value is not None
    assert not sessions.close("a"), "closing twice is a no-op"
    assert tree.evict_device(4) == 4 and frees.device == [0, 1, 2, 3], "plain LRU again once closed"


def test_a_request_finishing_after_close_adds_no_reference():
    tree = Frees().tree()
    sessions = SessionTable(tree)
    tree.insert([1, 1, 2, 2], slots(0, 4))
    node = node_of(tree, [1, 1, 2, 2])
    stale = sessions.ticket("a")  # submitted before the close
    sessions.close("a")
    assert not sessions.reference(stale, node) and node.session_refs == 0
    assert "a" not in sessions, "a stale request does not reopen the session"
    fresh = sessions.ticket("a")  # the session reopens under the same id
    assert fresh.epoch != stale.epoch
    assert not sessions.reference(stale, node) and node.session_refs == 0, "nor resurrects it once reopened"
    assert sessions.reference(fresh, node) and node.session_refs == 1
    assert sessions.referenced_nodes("a") == [node]


def test_a_split_keeps_the_reference_on_the_lower_node():
    frees = Frees()
    tree = frees.tree()
    sessions = SessionTable(tree)
    tree.insert([1, 1, 2, 2, 3, 3], slots(0, 6))
    node = node_of(tree, [1, 1, 2, 2, 3, 3])
    sessions.reference(sessions.ticket("a"), node)
    tree.insert([7, 7], slots(20, 2))
    tree.match_prefix([1, 1, 2, 2, 5])  # cuts [1, 1, 2, 2] off the referenced node
    upper = node.parent
    assert upper is not tree.root and upper.end == 4 and node.end == 6
    assert (upper.session_refs, node.session_refs) == (0, 1)
    tree.check_invariants()
    assert tree.evict_device(2) == 2 and frees.device == [20, 21], "the upper part leads to a reference"
    assert sessions.referenced_nodes("a") == [node]
    sessions.close("a")
    assert (upper.session_refs, node.session_refs) == (0, 0)


def test_a_deleted_node_takes_its_references_along():
    frees = Frees()
    tree = frees.tree()
    sessions = SessionTable(tree, nodes_per_session=2)
    tree.insert([1, 1, 2, 2], slots(0, 4))
    gone = node_of(tree, [1, 1, 2, 2])
    ticket = sessions.ticket("a")
    sessions.reference(ticket, gone)
    assert tree.evict_device(4) == 4 and not tree.in_tree(gone), "no host copy: the node is deleted"
    assert sessions.referenced_nodes("a") == []
    assert not sessions.reference(ticket, gone), "a deleted node cannot be referenced"
    # Same tokens again: a new node. The dead record must not count against it or the bound.
    tree.insert([1, 1, 2, 2], slots(10, 4))
    tree.insert([3, 3], slots(20, 2))
    fresh, other = node_of(tree, [1, 1, 2, 2]), node_of(tree, [3, 3])
    assert fresh is not gone
    assert sessions.reference(ticket, fresh) and sessions.reference(ticket, other)
    assert sessions.referenced_nodes("a") == [fresh, other]
    sessions.close("a")
    assert (fresh.session_refs, other.session_refs, gone.session_refs) == (0, 0, 1)
    tree.check_invariants()


def test_a_session_holds_its_latest_nodes_and_the_table_its_latest_sessions():
    tree = Frees().tree()
    sessions = SessionTable(tree, nodes_per_session=2, max_sessions=2)
    nodes = []
    for i in range(3):
        tree.insert([i, i], slots(10 * i, 2))
        nodes.append(node_of(tree, [i, i]))
    a = sessions.ticket("a")
    for node in nodes:
        sessions.reference(a, node)
    assert [n.session_refs for n in nodes] == [0, 1, 1], "the oldest reference is dropped"
    sessions.reference(a, nodes[1])  # already held: moves to the newest place, counted once
    assert [n.session_refs for n in nodes] == [0, 1, 1]
    sessions.reference(a, nodes[0])
    assert sessions.referenced_nodes("a") == [nodes[1], nodes[0]]
    b = sessions.ticket("b")
    sessions.reference(b, nodes[0])
    assert nodes[0].session_refs == 2, "two sessions on one node"
    sessions.ticket("a")  # "a" is now the most recently active
    sessions.ticket("c")  # a third session closes the least recently active one, "b"
    assert "b" not in sessions and "a" in sessions and "c" in sessions
    assert not sessions.reference(b, nodes[2])
    assert [n.session_refs for n in nodes] == [1, 1, 0]
    with pytest.raises(ValueError, match="at least 1"):
        SessionTable(tree, nodes_per_session=0)


# --- the engine ----------------------------------------------------------------------------------

SMALL = dict(page_size=4, device_pages=48, host_pages=64, host_ratio=None)


def test_a_finished_request_is_referenced_by_its_session_until_close():
    with Engine(EngineConfig(tiers=CacheTiers.L1_L2, **SMALL)) as engine:
        tokens = list(range(30))
        (first,) = engine.serve([Request("r0", tokens, 4, session_id="a")])
        (node,) = engine.sessions.referenced_nodes("a")
        # The deepest cached node: the prompt and the outputs with KV, in whole pages.
        assert node.end == (len(tokens) + 3) // 4 * 4 and node.session_refs == 1
        engine.serve([Request("r1", list(range(100, 120)), 4)])
        assert engine.sessions.referenced_nodes("a") == [node], "a request without a session changes nothing"
        assert engine.close_session("a") and node.session_refs == 0 and not engine.close_session("a")
        (second,) = engine.serve([Request("r2", tokens + first.output_ids + [9], 4)])
        assert second.cached_tokens == node.end, "closing kept the data"
        engine.tree.check_invariants()


def test_an_engine_request_finishing_after_close_adds_no_reference():
    with Engine(EngineConfig(tiers=CacheTiers.L1_L2, **SMALL)) as engine:
        engine.submit(Request("stale", list(range(30)), 4, session_id="a"))
        engine.step()  # admitted and prefilled: it is running
        assert engine.close_session("a")
        engine.submit(Request("fresh", list(range(50, 70)), 4, session_id="a"))  # reopens "a"
        while engine.has_work():
            engine.step()
        results = {r.rid: r for r in engine.take_results()}
        assert set(results) == {"stale", "fresh"}
        (node,) = engine.sessions.referenced_nodes("a")
        assert node.end == 20, "only the request submitted after the close is referenced"
        stale = engine.tree.match_prefix(list(range(30)) + results["stale"].output_ids[:2]).host_node
        assert stale.end == 32 and stale.session_refs == 0


def test_a_session_closed_while_its_request_runs_keeps_no_token_sequence():
    with Engine(EngineConfig(tiers=CacheTiers.L1_L2, **SMALL)) as engine:
        engine.submit(Request("stale", list(range(30)), 4, session_id="a"))
        engine.step()
        engine.close_session("a")
        while engine.has_work():
            engine.step()
        assert "a" not in engine._session_sequences, "a closed session must not keep its conversation's hashes"


def run_pressure_workload(sessions: bool) -> tuple[list[int], list[list[int]]]:
    """Three multi-turn conversations, each round followed by two one-off requests that push the
    device and host pools; returns each conversation's cached tokens per round after the first,
    and every request's output."""
    gen = torch.Generator().manual_seed(0)
    config = EngineConfig(tiers=CacheTiers.L1_L2, page_size=4, device_pages=48, host_pages=64, host_ratio=None)
    hits: list[int] = []
    outputs: list[list[int]] = []
    with Engine(config) as engine:
        histories: list[list[int]] = [[], [], []]
        for round_ in range(4):
            for c in range(3):
                turn = torch.randint(0, 256, (24,), generator=gen).tolist()
                request = Request(f"c{c}-{round_}", histories[c] + turn, 4, session_id=f"c{c}" if sessions else None)
                (result,) = engine.serve([request])
                if round_:
                    hits.append(result.cached_tokens)
                outputs.append(result.output_ids)
                histories[c] = request.tokens + result.output_ids
                for k in range(2):
                    one_off = torch.randint(0, 256, (48,), generator=gen).tolist()
                    outputs.append(engine.serve([Request(f"o{c}-{round_}-{k}", one_off, 4)])[0].output_ids)
        evicted = engine.metrics.snapshot()
        assert evicted["device_evicted_tokens"] and evicted["host_evicted_tokens"], "no memory pressure"
        engine.tree.check_invariants()
    return hits, outputs


def test_sessions_hit_more_than_plain_lru_under_memory_pressure():
    lru_hits, lru_outputs = run_pressure_workload(sessions=False)
    session_hits, session_outputs = run_pressure_workload(sessions=True)
    assert session_outputs == lru_outputs, "the cache never changes what the model outputs"
    assert sum(session_hits) > sum(lru_hits), (lru_hits, session_hits)
    assert all(s >= p for s, p in zip(session_hits, lru_hits)), (lru_hits, session_hits)
