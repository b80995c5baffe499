"""The fast radix tree behaves exactly like a straightforward one, and token sequences hash right.

``ReferenceTree`` below is the tree as it was before the hash index (a top-down walk comparing
tokens page by page, no caches). Random operation sequences run on both, fed plain lists and
:class:`TokenSequence` objects; every result, every freed slot (in order) and the whole tree
(shape, copies, references, hit counts, access times) must agree after every step.
"""

from __future__ import annotations

import heapq
import importlib.util
import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hicache_core.radix_tree import RadixTree
from hicache_core.token_sequence import TokenSequence, chain_page_hashes
from hicache_storage.errors import InvalidKeyError
from hicache_storage.keys import page_hashes

ROOT = Path(__file__).resolve().parents[2]


# --- token sequences ----------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 2, 3, 64])
def test_token_sequence_hashes_match_sglang_chain_while_growing(page_size):
    rng = random.Random(page_size)
    tokens = [rng.randrange(2**32) for _ in range(700)]
    sequence = TokenSequence(page_size)
    position = 0
    while position < len(tokens):
        step = rng.randint(0, 90)
        sequence.extend(tokens[position : position + step])
        position += step
        expected = page_hashes(tokens[:position], page_size)
        assert sequence.page_hashes() == expected
        assert sequence.num_pages == len(expected)
        if expected:
            page = rng.randrange(len(expected))
            assert sequence.page_hash(page) == expected[page]
    assert sequence.tolist() == tokens and list(sequence) == tokens
    assert sequence[5:17] == tokens[5:17] and sequence[-1] == tokens[-1]
    assert chain_page_hashes(tokens, page_size, "ab" * 32) == page_hashes(tokens, page_size, "ab" * 32)


def test_prefix_views_never_change_and_fork_when_extended():
    sequence = TokenSequence(2, range(10))
    view = sequence.prefix(6)
    sequence.extend([7, 7, 7, 7])
    assert view.tolist() == list(range(6)) and view.page_hashes() == page_hashes(list(range(6)), 2)
    view.extend([1, 1])  # not the tip: gets its own copy
    assert view.tolist() == list(range(6)) + [1, 1]
    assert view.page_hashes() == page_hashes(list(range(6)) + [1, 1], 2)
    assert sequence.tolist() == list(range(10)) + [7, 7, 7, 7]
    assert sequence.page_hashes() == page_hashes(sequence.tolist(), 2)
    with pytest.raises(IndexError):
        sequence.prefix(15)


@pytest.mark.parametrize("bad", [[-1], [2**32], ["a"]])
def test_out_of_range_token_is_a_typed_error_and_appends_nothing(bad):
    sequence = TokenSequence(1, [1, 2])
    with pytest.raises(InvalidKeyError, match="0 <= id < 2\\*\\*32"):
        sequence.extend([3, *bad])
    assert sequence.tolist() == [1, 2]


# --- the reference tree (the implementation before the hash index) ------------------------------


class RefNode:
    def __init__(self, key, parent, now, ids):
        self.id = next(ids)
        self.parent, self.children, self.key = parent, {}, tuple(key)
        self.device_value = self.host_value = None
        self.lock_ref = self.host_ref = self.host_io = self.hit_count = 0
        self.last_access = now


class ReferenceTree:
    def __init__(self, page_size, free_device, free_host, clock):
        self.page_size, self.free_device, self.free_host, self.clock = page_size, free_device, free_host, clock
        self.ids = itertools.count()
        self.root = RefNode((), None, clock(), self.ids)
        self.root.device_value = torch.empty(0, dtype=torch.int64)
        self.root.lock_ref = 1

    def match_prefix(self, tokens, count_host=True):
        parts, device_node = [], self.root
        host_node = backed_up = self.root
        host_length, now = 0, self.clock()
        for node in self._walk(tokens):
            if node.device_value is not None and device_node is node.parent:
                parts.append(node.device_value)
                device_node = node
            elif node.host_value is not None and count_host:
                host_length += len(node.key)
            else:
                break
            host_node = node
            if node.host_value is not None:
                backed_up = node
            node.last_access = now
        indices = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return indices, device_node, host_length, host_node, backed_up

    def insert(self, tokens, device_indices):
        now, duplicate, last, existing, new, position = self.clock(), 0, self.root, [], [], 0
        for node in self._walk(tokens):
            end = position + len(node.key)
            if node.device_value is not None:
                duplicate = end
            else:
                node.device_value = device_indices[position:end].clone()
            node.hit_count += 1
            node.last_access = now
            existing.append(node)
            last, position = node, end
        if position < len(tokens):
            leaf = self._new_leaf(last, tokens[position:], now)
            leaf.device_value = device_indices[position:].clone()
            new.append(leaf)
            last = leaf
        return duplicate, last, new, existing

    def insert_host(self, tokens, start, host_indices):
        now, unused, inserted, position, parent = self.clock(), [], 0, 0, self.root
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
        return inserted, unused

    def _new_leaf(self, parent, tokens, now):
        leaf = RefNode(tokens, parent, now, self.ids)
        parent.children[leaf.key[: self.page_size]] = leaf
        return leaf

    def _walk(self, tokens, split_at=None):
        ps = self.page_size
        limit = len(tokens) - len(tokens) % ps
        node, position = self.root, 0
        while position < limit:
            child = node.children.get(tuple(tokens[position : position + ps]))
            if child is None:
                return
            common = ps
            while (
                common < len(child.key)
                and position + common < limit
                and tuple(tokens[position + common : position + common + ps]) == child.key[common : common + ps]
            ):
                common += ps
            if split_at is not None and position < split_at < position + common:
                common = split_at - position
            if common < len(child.key):
                child = self._split(child, common)
            yield child
            node, position = child, position + len(child.key)

    def _split(self, child, length):
        upper = RefNode(child.key[:length], child.parent, child.last_access, self.ids)
        upper.lock_ref, upper.host_ref, upper.hit_count = child.lock_ref, child.host_ref, child.hit_count
        upper.host_io = child.host_io
        if child.device_value is not None:
            upper.device_value, child.device_value = child.device_value[:length], child.device_value[length:]
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:length], child.host_value[length:]
        child.parent.children[child.key[: self.page_size]] = upper
        child.key, child.parent = child.key[length:], upper
        upper.children[child.key[: self.page_size]] = child
        return upper

    def _path_up(self, node):
        while node is not self.root and node is not None:
            yield node
            node = node.parent

    def add_refs(self, node, attribute, delta):
        for n in self._path_up(node):
            setattr(n, attribute, getattr(n, attribute) + delta)

    def add_host_io(self, node, begin, delta):
        """host_ref along the path, host_io on the nodes holding the tokens from ``begin`` on."""
        self.add_refs(node, "host_ref", delta)
        end = sum(len(n.key) for n in self._path_up(node))
        for n in self._path_up(node):
            if end > begin:
                n.host_io += delta
            end -= len(n.key)

    def nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def evict_device(self, num_tokens, backup):
        heap = [(n.last_access, n.id, n) for n in self.nodes() if self._device_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if not self._device_evictable(node):
                continue
            if node.host_value is None and backup is not None:
                backup(node)
            size, parent = len(node.key), node.parent
            self.free_device(node.device_value)
            node.device_value = None
            if node.host_value is None:
                # Storage backups below finish detached: the ancestors stop counting them.
                for ancestor in self._path_up(node.parent):
                    ancestor.host_ref -= node.host_ref
                self._delete_subtree(node)
            freed += size
            if parent is not None and self._device_evictable(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def evict_host(self, num_tokens):
        rank = lambda n: (0 if n.device_value is None else 1, n.last_access, n.id, n)  # noqa: E731
        heap = [rank(n) for n in self.nodes() if self._host_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            *_, node = heapq.heappop(heap)
            if not self._host_evictable(node):
                continue
            freed += len(node.key)
            self.free_host(node.host_value)
            node.host_value = None
            if node.device_value is None:
                parent = node.parent
                self._delete_subtree(node)
                if parent is not None and self._host_evictable(parent):
                    heapq.heappush(heap, rank(parent))
        return freed

    def drop_host_value(self, node):
        if node.host_value is not None:
            self.free_host(node.host_value)
            node.host_value = None
        while (
            node is not self.root and node.device_value is None and node.host_value is None
            and not node.children and node.lock_ref == 0 and node.host_ref == 0
        ):
            parent = node.parent
            del parent.children[node.key[: self.page_size]]
            node.parent = None
            node = parent

    def _device_evictable(self, node):
        return (
            node is not self.root and node.parent is not None and node.device_value is not None
            and node.lock_ref == 0 and not any(c.device_value is not None for c in node.children.values())
        )

    def _host_evictable(self, node):
        if node is self.root or node.parent is None or node.host_value is None:
            return False
        if node.device_value is not None:
            return node.host_io == 0
        return node.host_ref == 0 and node.lock_ref == 0 and not node.children

    def _delete_subtree(self, node):
        for child in list(node.children.values()):
            if child.host_value is not None:
                self.free_host(child.host_value)
                child.host_value = None
            self._delete_subtree(child)
        if node.host_value is not None:
            self.free_host(node.host_value)
            node.host_value = None
        if node.parent is not None:
            del node.parent.children[node.key[: self.page_size]]
            node.parent = None
        node.children = {}


# --- differential: fast tree vs reference -------------------------------------------------------


def _values(tensor):
    return None if tensor is None else tensor.tolist()


def _recency(node):
    """The latest access time in ``node``'s subtree: what the fast tree evicts by (a match stamps
    only the deepest node); the reference stamps whole paths, so there it is the node's own."""
    return max([node.last_access, *(_recency(c) for c in node.children.values())])


def _shape(root):
    """The whole tree as nested plain data, children in key order."""

    def visit(node):
        return [
            (key, child.key, _values(child.device_value), _values(child.host_value), child.lock_ref, child.host_ref,
             child.host_io, child.hit_count, _recency(child), visit(child))
            for key, child in sorted(node.children.items())
        ]

    return visit(root)


def _path_of(tree_root, node):
    """Tokens from the root through ``node`` (how nodes of the two trees are paired)."""
    parts = []
    while node is not tree_root:
        parts.append(node.key)
        node = node.parent
    return tuple(t for key in reversed(parts) for t in key)


class Pair:
    def __init__(self, page_size, seed, stride_pages):
        self.rng = random.Random(seed)
        self.page_size = page_size
        self.freed = {"fast": ([], []), "ref": ([], [])}
        fast_ticks, ref_ticks = itertools.count(), itertools.count()
        self.fast = RadixTree(page_size, self.freed["fast"][0].append, self.freed["fast"][1].append,
                              clock=lambda: float(next(fast_ticks)), index_stride_tokens=stride_pages * page_size)
        self.ref = ReferenceTree(page_size, self.freed["ref"][0].append, self.freed["ref"][1].append,
                                 clock=lambda: float(next(ref_ticks)))
        self.next_slot = 0
        self.known: list[list[int]] = []  # token runs inserted so far, to reuse as shared prefixes
        self.fast_locks: list = []
        self.ref_locks: list = []
        self.fast_protected: list = []
        self.ref_protected: list = []

    # tokens: small vocabulary and shared prefixes, so splits and partial pages happen often
    def tokens(self, aligned):
        rng, ps = self.rng, self.page_size
        base = list(rng.choice(self.known)) if self.known and rng.random() < 0.8 else []
        base = base[: rng.randint(0, len(base))]
        extra = [rng.randrange(3) for _ in range(rng.randint(0, 4 * ps + 3))]
        tokens = base + extra
        if aligned:
            tokens = tokens[: len(tokens) - len(tokens) % ps]
        return tokens

    def as_input(self, tokens):
        """The fast tree gets a TokenSequence (the hash path) or a list, at random."""
        choice = self.rng.random()
        if choice < 0.45:
            return TokenSequence(self.page_size, tokens)
        if choice < 0.6 and len(tokens):
            longer = TokenSequence(self.page_size, tokens + [1] * self.rng.randint(1, 5))
            longer.page_hashes()
            return longer.prefix(len(tokens))  # a view sharing a longer sequence's hashes
        if choice < 0.7:
            return TokenSequence(self.page_size + 1, tokens)  # another page size: the token path
        return list(tokens)

    def slots(self, n):
        start = self.next_slot
        self.next_slot += n
        return torch.arange(start, start + n, dtype=torch.int64)

    def step(self):
        rng = self.rng
        op = rng.choices(
            ["insert", "match", "insert_host", "lock", "unlock", "protect", "release", "evict_device",
             "evict_host", "drop_host"],
            weights=[30, 30, 10, 6, 6, 4, 4, 5, 4, 2],
        )[0]
        getattr(self, op)()
        return op

    def insert(self):
        tokens = self.tokens(aligned=True)
        slots = self.slots(len(tokens))
        got = self.fast.insert(self.as_input(tokens), slots)
        want = self.ref.insert(tokens, slots)
        assert got.duplicate_length == want[0]
        assert _path_of(self.fast.root, got.last_node) == _path_of(self.ref.root, want[1])
        assert [_path_of(self.fast.root, n) for n in got.new_nodes] == [_path_of(self.ref.root, n) for n in want[2]]
        assert [_path_of(self.fast.root, n) for n in got.existing_nodes] == [_path_of(self.ref.root, n) for n in want[3]]
        if tokens:
            self.known.append(tokens)

    def match(self):
        tokens = self.tokens(aligned=False)
        count_host = self.rng.random() < 0.7
        got = self.fast.match_prefix(self.as_input(tokens), count_host=count_host)
        indices, device_node, host_length, host_node, backed_up = self.ref.match_prefix(tokens, count_host)
        assert got.device_indices.tolist() == indices.tolist()
        assert got.device_hit_length == indices.numel() and got.host_hit_length == host_length
        for mine, theirs in ((got.device_node, device_node), (got.host_node, host_node), (got.backed_up_node, backed_up)):
            assert _path_of(self.fast.root, mine) == _path_of(self.ref.root, theirs)

    def insert_host(self):
        tokens = self.tokens(aligned=True)
        start = self.rng.randint(0, len(tokens) // self.page_size) * self.page_size
        host = self.slots(len(tokens) - start) + 10**6
        got = self.fast.insert_host(self.as_input(tokens), start, host)
        want = self.ref.insert_host(tokens, start, host)
        if want is None:
            assert got is None
        else:
            assert got is not None and got.inserted_tokens == want[0]
            assert [u.tolist() for u in got.unused] == [u.tolist() for u in want[1]]

    def _pick(self):
        """The same node in both trees: the end of a random cached run's match."""
        if not self.known:
            return None
        tokens = self.rng.choice(self.known)
        node = self.fast.match_prefix(tokens).host_node
        ref_node = self.ref.match_prefix(tokens)[3]
        return (node, ref_node) if node is not self.fast.root else None

    def lock(self):
        if (pair := self._pick()) is not None and len(self.fast_locks) < 4:
            self.fast.lock(pair[0])
            self.ref.add_refs(pair[1], "lock_ref", 1)
            self.fast_locks.append(pair[0])
            self.ref_locks.append(pair[1])

    def unlock(self):
        if self.fast_locks:
            i = self.rng.randrange(len(self.fast_locks))
            self.fast.unlock(self.fast_locks.pop(i))
            self.ref.add_refs(self.ref_locks.pop(i), "lock_ref", -1)

    def protect(self):
        pair = self._pick()
        if pair is not None and pair[0].host_value is not None and len(self.fast_protected) < 3:
            begin = pair[0].end - len(pair[0].key)
            self.fast.protect_host(pair[0], begin)
            self.ref.add_host_io(pair[1], begin, 1)
            self.fast_protected.append((pair[0], begin))
            self.ref_protected.append((pair[1], begin))

    def release(self):
        if self.fast_protected:
            i = self.rng.randrange(len(self.fast_protected))
            self.fast.release_host(*self.fast_protected.pop(i))
            node, begin = self.ref_protected.pop(i)
            self.ref.add_host_io(node, begin, -1)

    def evict_device(self):
        amount = self.rng.randint(1, 6) * self.page_size
        with_backup = self.rng.random() < 0.6

        def backup_for(tree_name):
            def backup(node):
                if self.rng_backup[tree_name].random() < 0.7:
                    node.host_value = node.device_value + 10**7
                    return True
                return False

            return backup

        seed = self.rng.randrange(10**9)
        self.rng_backup = {"fast": random.Random(seed), "ref": random.Random(seed)}
        got = self.fast.evict_device(amount, backup_for("fast") if with_backup else None)
        want = self.ref.evict_device(amount, backup_for("ref") if with_backup else None)
        assert got == want

    def evict_host(self):
        amount = self.rng.randint(1, 6) * self.page_size
        assert self.fast.evict_host(amount) == self.ref.evict_host(amount)

    def drop_host(self):
        pair = self._pick()
        if pair is not None and pair[0].host_ref == 0 and pair[0].lock_ref == 0:
            self.fast.drop_host_value(pair[0])
            self.ref.drop_host_value(pair[1])

    def compare(self, op):
        self.fast.check_invariants()
        assert _shape(self.fast.root) == _shape(self.ref.root), f"trees differ after {op}"
        for kind in (0, 1):
            assert [t.tolist() for t in self.freed["fast"][kind]] == [t.tolist() for t in self.freed["ref"][kind]], op


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("stride_pages", [1, 2, 3])
@pytest.mark.parametrize("seed", range(5))
def test_fast_tree_matches_reference_on_random_operations(page_size, stride_pages, seed):
    """Short sequences, so the index stride is a few pages: indexed and token-compared parts both count."""
    pair = Pair(page_size, seed * 31 + page_size, stride_pages)
    for _ in range(250):
        op = pair.step()
        pair.compare(op)


def test_long_conversation_takes_the_hash_path_and_stays_exact():
    """A growing conversation (the benchmark's shape) on both trees, with page size 4."""
    tree = RadixTree(4, lambda _: None, index_stride_tokens=12)
    reference = ReferenceTree(4, lambda _: None, lambda _: None, clock=lambda: 0.0)
    rng = random.Random(3)
    sequence = TokenSequence(4, [rng.randrange(50) for _ in range(8)])
    for round_ in range(30):
        sequence.extend([rng.randrange(50) for _ in range(10)])
        match = tree.match_prefix(sequence)
        assert match.device_indices.tolist() == reference.match_prefix(sequence.tolist())[0].tolist()
        assert match.device_hit_length == ((len(sequence) - 10) // 4 * 4 if round_ else 0)
        sequence.extend([rng.randrange(50) for _ in range(7)])
        aligned = len(sequence) // 4 * 4
        slots = torch.arange(aligned, dtype=torch.int64) + 1000 * round_
        assert tree.insert(sequence.prefix(aligned), slots).duplicate_length == reference.insert(sequence[:aligned], slots)[0]
    tree.check_invariants()
    assert tree.token_counts()["nodes"] == sum(1 for _ in reference.nodes())


# --- the benchmark script -----------------------------------------------------------------------


def test_tree_benchmark_quick_mode_runs_end_to_end(tmp_path):
    spec = importlib.util.spec_from_file_location("hicache_tree_benchmark", ROOT / "benchmarks" / "tree.py")
    assert spec is not None and spec.loader is not None
    tree_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tree_bench)  # a script folder, not a package
    assert tree_bench.main(["--quick", "--no-sglang", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "tree.json").read_text())
    assert set(report["page_sizes"]) == {"1", "64"}
    for result in report["page_sizes"].values():
        assert [row["rounds"] for row in result["buckets"]] == ["1-4", "5-8"]
        assert all(row["ours_ms"] > 0 and row["ours_list_ms"] > 0 for row in result["buckets"])
    assert "Page size 64" in (tmp_path / "tree.md").read_text()


@pytest.mark.slow
def test_tree_benchmark_quick_mode_against_sglang_in_a_subprocess(tmp_path):
    """With SGLang when it is installed (its import stand-ins stay in that process)."""
    pytest.importorskip("sglang")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tree.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "tree.json").read_text())
    assert report["sglang"], report["sglang_error"]
    assert all("sglang_over_ours" in row for r in report["page_sizes"].values() for row in r["buckets"])


def test_index_holds_every_stride_page_and_lookups_start_there(monkeypatch):
    """White-box: the index keeps every third page (stride 6 tokens, page 2), and a match by
    TokenSequence compares tokens only after the deepest indexed page."""
    tree = RadixTree(2, lambda _: None, index_stride_tokens=6)
    tokens = list(range(40))
    tree.insert(TokenSequence(2, tokens), torch.arange(40))
    hashes = page_hashes(tokens, 2)
    assert set(tree._by_hash) == {hashes[page] for page in range(2, 20, 3)}
    starts = []
    descend = tree._descend
    monkeypatch.setattr(tree, "_descend", lambda seq, node, position: starts.append(position) or descend(seq, node, position))
    assert tree.match_prefix(TokenSequence(2, tokens + [99, 99, 98])).device_hit_length == 40
    assert starts == [36], "pages 0-17 were found through the index (page 17 is the deepest indexed one)"
    tree.match_prefix(TokenSequence(2, tokens[:20] + [7] * 20))  # splits the node after page 9
    tree.check_invariants()
    assert set(tree._by_hash) == {hashes[page] for page in range(2, 20, 3)}
