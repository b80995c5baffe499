"""Our page-hash chain against SGLang's own (``get_hash_str``, a C++ extension SGLang compiles on
first use), on random token sequences and page sizes."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.mem_cache.utils import get_hash_str, get_storage_hash_str, storage_namespace_seed

from hicache_storage.errors import InvalidKeyError
from hicache_storage.keys import hash_page, page_hashes

tokens_32bit = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(tokens=tokens_32bit, page_size=st.integers(min_value=1, max_value=64))
def test_page_hashes_equal_sglangs(tokens: list[int], page_size: int) -> None:
    full = len(tokens) // page_size
    # SGLang also hashes a trailing partial page; HiCache only ever stores whole pages.
    assert page_hashes(tokens, page_size) == get_hash_str(tokens, None, page_size=page_size)[:full]


@settings(max_examples=100, deadline=None, derandomize=True)
@given(tokens=tokens_32bit, page_size=st.integers(min_value=1, max_value=32), prior=st.binary(min_size=32, max_size=32))
def test_chains_continued_from_a_prior_hash_equal_sglangs(tokens: list[int], page_size: int, prior: bytes) -> None:
    full = len(tokens) // page_size
    assert page_hashes(tokens, page_size, prior.hex()) == get_hash_str(tokens, prior.hex(), page_size=page_size)[:full]


def test_seeded_long_sequences_and_common_page_sizes() -> None:
    rng = random.Random(20261129)
    for page_size in (1, 16, 32, 64, 128, 256):
        tokens = [rng.randrange(200_000) for _ in range(page_size * rng.randint(1, 12) + rng.randrange(page_size))]
        assert page_hashes(tokens, page_size) == get_hash_str(tokens, None, page_size=page_size)[: len(tokens) // page_size]


def test_a_whole_sequence_hash_equals_sglangs() -> None:
    rng = random.Random(7)
    for length in (0, 1, 5, 1000):
        tokens = [rng.randrange(2**32) for _ in range(length)]
        assert hash_page(tokens) == get_hash_str(tokens)


@pytest.mark.parametrize(("extra_key", "cache_salt"), [("lora-a", None), (None, "tenant-1"), ("", ""), ("x", "y")])
def test_namespaced_chains_match_sglangs_storage_hashes(extra_key: str | None, cache_salt: str | None) -> None:
    """SGLang seeds a request's chain with its extra key / cache salt; the seed is a prior hash to us."""

    class Key(list):
        pass

    tokens = Key(range(100, 164))
    tokens.extra_key, tokens.cache_salt = extra_key, cache_salt
    seed = storage_namespace_seed(extra_key, cache_salt)
    assert page_hashes(list(tokens), 16, seed) == get_storage_hash_str(tokens, None, page_size=16)


def test_token_ids_beyond_32_bits_are_refused_not_hashed_differently() -> None:
    """SGLang hashes ids >= 2**32 with a wider encoding; ours refuses them instead of disagreeing."""
    with pytest.raises(InvalidKeyError):
        page_hashes([1, 2**32], 2)
