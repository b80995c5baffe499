import hashlib
import random

import pytest

from hicache_storage.errors import InvalidKeyError
from hicache_storage.keys import KeyScope, Namespace, PageKey, Shard, hash_page, page_hashes


def sglang_spec_hash(tokens, prior):
    """The chain exactly as SGLANG_HICACHE.md states it, written out independently."""
    h = hashlib.sha256()
    if prior is not None:
        h.update(bytes.fromhex(prior))
    for t in tokens:
        h.update(t.to_bytes(4, byteorder="little", signed=False))
    return h.hexdigest()


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_hash_chain_follows_the_spec(page_size):
    rng = random.Random(page_size)
    tokens = [rng.randrange(2**32) for _ in range(5 * page_size + page_size // 2)]
    expected, prior = [], None
    for start in range(0, 5 * page_size, page_size):
        prior = sglang_spec_hash(tokens[start : start + page_size], prior)
        expected.append(prior)
    assert page_hashes(tokens, page_size) == expected  # the trailing partial page is not hashed


def test_hash_chain_continues_from_a_prior_hash():
    tokens = list(range(40))
    whole = page_hashes(tokens, 8)
    assert page_hashes(tokens[16:], 8, prior_hash=whole[1]) == whole[2:]


def test_token_ids_outside_32_bits_are_rejected():
    with pytest.raises(InvalidKeyError, match="32 bits"):
        hash_page([2**32])
    with pytest.raises(InvalidKeyError):
        hash_page([-1])


def test_namespace_fingerprint_is_unambiguous():
    base = dict(model="m", kv_dtype="bfloat16", page_size=64)
    fingerprints = {
        Namespace(**base, revision="a", tenant="bc").fingerprint,
        Namespace(**base, revision="ab", tenant="c").fingerprint,
        Namespace(**base, tenant=None).fingerprint,
        Namespace(**base, tenant="").fingerprint,
        Namespace(**base, revision="", tenant=None).fingerprint,
        Namespace(model="m", kv_dtype="bfloat16", page_size=32).fingerprint,
        Namespace(**base, layout="layer_first").fingerprint,
        Namespace(**base, format_version=2).fingerprint,
    }
    assert len(fingerprints) == 8


def test_fingerprint_is_stable_across_processes():
    # Pinned: a change here makes every stored page invisible, so it must be deliberate.
    assert Namespace("m", "bfloat16", 64).fingerprint == Namespace("m", "bfloat16", 64).fingerprint
    assert len(Namespace("m", "bfloat16", 64).fingerprint) == 32


def test_shard_tokens_and_mla_replication():
    assert Shard(tp_rank=1, tp_size=4).token == "tp1of4-pp0of1-cp0of1"
    assert Shard(tp_rank=3, tp_size=4, replicated=True).token == Shard(replicated=True).token
    assert Shard(tp_rank=0, tp_size=2, replicated=True).is_writer
    assert not Shard(tp_rank=1, tp_size=2, replicated=True).is_writer
    assert Shard(tp_rank=1, tp_size=2).is_writer


@pytest.mark.parametrize("kwargs", [dict(tp_rank=2, tp_size=2), dict(pp_rank=-1), dict(cp_size=0)])
def test_invalid_shards_are_rejected(kwargs):
    with pytest.raises(InvalidKeyError, match="rank < size"):
        Shard(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(model="", kv_dtype="bf16", page_size=1), "model"),
        (dict(model="m", kv_dtype="bf16", page_size=0), "page_size"),
        (dict(model="m", kv_dtype="bf16", page_size=1, layout="pages"), "layout"),
        (dict(model="m", kv_dtype="", page_size=1), "kv_dtype"),
    ],
)
def test_invalid_namespaces_name_the_field(kwargs, field):
    with pytest.raises(InvalidKeyError, match=field):
        Namespace(**kwargs)


@pytest.mark.parametrize("part", ["", "K", "../x", "a/b", "x" * 33, "1kv"])
def test_invalid_parts_are_rejected(part):
    with pytest.raises(InvalidKeyError, match="part"):
        KeyScope(Namespace("m", "bf16", 4), part=part)


@pytest.mark.parametrize("page_hash", ["", "ABCDEF0123", "../../etc/passwd", "g" * 64, "a" * 7, "a" * 129])
def test_invalid_page_hashes_are_rejected(page_hash):
    with pytest.raises(InvalidKeyError, match="hex"):
        KeyScope(Namespace("m", "bf16", 4)).key(page_hash)


def test_rendered_keys_are_safe_and_distinct():
    scope = KeyScope(Namespace("Model/With Spaces", "bf16", 4, tenant="../../x"), Shard(tp_rank=1, tp_size=2), "k")
    key = scope.key("ab" * 32)
    rendered = key.render("/")
    assert set(rendered) <= set("0123456789abcdefghijklmnopqrstuvwxyz/-_")
    assert rendered.startswith(scope.prefix("/") + "/")
    assert key.render(":").count(":") == 3
    assert key == PageKey(scope, "ab" * 32) and hash(key) == hash(PageKey(scope, "ab" * 32))
    assert key != scope.with_part("v").key("ab" * 32)


def test_replicated_scopes_of_every_rank_are_one_scope():
    namespace = Namespace("m", "bf16", 4)
    rank0 = KeyScope(namespace, Shard(tp_rank=0, tp_size=4, replicated=True)).key("ab" * 32)
    rank3 = KeyScope(namespace, Shard(tp_rank=3, tp_size=4, replicated=True)).key("ab" * 32)
    assert rank0 == rank3 and hash(rank0) == hash(rank3) and {rank0: 1}[rank3] == 1
    assert rank0 != KeyScope(namespace, Shard(tp_rank=3, tp_size=4)).key("ab" * 32)
