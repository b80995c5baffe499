"""Structured page keys.

A stored page is named by four things, and two pages share bytes only if all four are equal:

* the **page hash**: SHA-256 chain over the token ids, bit-identical to SGLang's, so a key names
  the whole prefix up to and including its page;
* the **namespace**: everything that changes the bytes of a page for the same tokens (model and
  revision, KV dtype, page size, byte layout, tenant / cache salt, key format version);
* the **shard**: which slice of the KV this process holds (tp / pp / cp rank and size; MLA KV is
  replicated across TP ranks, so TP is left out);
* the **part**: which buffer of the page (``kv``, ``k``, ``v``, or a side pool such as ``swa``,
  ``mamba``, ``draft``).

Keys render to strings made of ``[0-9a-z._-]`` joined by a separator the connector picks, so every
connector can use them as paths, object names or Redis keys without escaping. The namespace is
rendered as a 128-bit fingerprint of its canonical JSON, which is unambiguous: ``("a", "bc")`` and
``("ab", "c")`` differ, and an absent field (``None``) differs from an empty one (``""``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property

from hicache_storage.errors import InvalidKeyError

#: Version of the key and value format. Bump it when the bytes of a page change meaning; old
#: pages then become invisible instead of being misread.
FORMAT_VERSION = 1

#: Host-pool byte layouts a page can be stored in (SGLang's ``--hicache-mem-layout`` values).
#: ``page_first_kv_split`` keeps K and V (and an MLA indexer) in separate page-first buffers;
#: ``page_head`` orders a page head-major, so a group of heads is one contiguous run.
#: ``vllm_block`` is one vLLM KV block: each attention layer's bytes of the block, layer after
#: layer, in vLLM's own block layout (the namespace's geometry names it).
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_first_kv_split", "page_head", "vllm_block")

_PART_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
_HASH_RE = re.compile(r"[0-9a-f]{8,128}")


# --- the page hash chain ------------------------------------------------------------------------


def hash_page(token_ids: Iterable[int], prior_hash: str | None = None) -> str:
    """SHA-256 of the prior page's digest bytes followed by each token as 4-byte little-endian.

    Bit-identical to SGLang's ``get_hash_str``: the first page has no prior bytes.
    """
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    try:
        hasher.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids))
    except OverflowError as exc:
        raise InvalidKeyError("token ids must fit in 32 bits unsigned (0 <= id < 2**32)") from exc
    return hasher.hexdigest()


def is_page_hash(text: object) -> bool:
    """Whether ``text`` is a well-formed page hash: 8 to 128 lowercase hex digits."""
    return isinstance(text, str) and _HASH_RE.fullmatch(text) is not None


def page_hashes(token_ids: Sequence[int], page_size: int, prior_hash: str | None = None) -> list[str]:
    """Hash chain over the full pages of ``token_ids``; a trailing partial page is not hashed."""
    if page_size <= 0:
        raise InvalidKeyError(f"page_size must be a positive integer, got {page_size!r}")
    hashes: list[str] = []
    prior = prior_hash
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        prior = hash_page(token_ids[start : start + page_size], prior)
        hashes.append(prior)
    return hashes


# --- identity -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Namespace:
    """What makes two deployments' pages different for the same tokens.

    ``tenant`` is the cache salt: deployments that must not share cache use different tenants.
    ``revision`` pins the model weights; leave it ``None`` only if the name already does.
    ``geometry`` names the shape of a stored value where an engine can change it under one model,
    dtype and layout (e.g. ``"layers=62,bytes=1032192"``: a deployment with MTP draft layers packed
    into its KV pages, or one whose pages move as whole flat copies). It takes part in the
    fingerprint only when set, so namespaces without it keep the fingerprint they always had.
    """

    model: str
    kv_dtype: str
    page_size: int
    layout: str = "page_first"
    revision: str | None = None
    tenant: str | None = None
    format_version: int = FORMAT_VERSION
    geometry: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise InvalidKeyError(f"Namespace.model must be a non-empty string, got {self.model!r}")
        if not isinstance(self.kv_dtype, str) or not self.kv_dtype:
            raise InvalidKeyError(f"Namespace.kv_dtype must be a non-empty string such as 'bfloat16', got {self.kv_dtype!r}")
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size <= 0:
            raise InvalidKeyError(f"Namespace.page_size must be a positive integer, got {self.page_size!r}")
        if self.layout not in LAYOUTS:
            raise InvalidKeyError(f"Namespace.layout must be one of {', '.join(LAYOUTS)}; got {self.layout!r}")
        for name in ("revision", "tenant", "geometry"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidKeyError(f"Namespace.{name} must be a string or None, got {value!r}")

    @cached_property
    def fingerprint(self) -> str:
        """32 hex digits naming this namespace; the canonical JSON of every field, hashed."""
        fields = asdict(self)
        if fields["geometry"] is None:
            del fields["geometry"]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]

    def describe(self) -> dict[str, object]:
        """The fields as a plain dict, for metadata files and reports."""
        return {**asdict(self), "fingerprint": self.fingerprint}


@dataclass(frozen=True)
class Shard:
    """Which slice of the model's KV a process holds.

    ``replicated=True`` is for MLA-style KV that is identical on every TP rank: TP rank and size
    are then left out of the key, so every rank reads the one copy a single rank wrote.
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    replicated: bool = False

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "cp"):
            rank, size = getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size")
            if not (isinstance(rank, int) and isinstance(size, int)) or size < 1 or not 0 <= rank < size:
                raise InvalidKeyError(
                    f"Shard.{axis}_rank/{axis}_size must satisfy 0 <= rank < size; got rank={rank!r}, size={size!r}"
                )

    @cached_property
    def token(self) -> str:
        tp = "tpx" if self.replicated else f"tp{self.tp_rank}of{self.tp_size}"
        return f"{tp}-pp{self.pp_rank}of{self.pp_size}-cp{self.cp_rank}of{self.cp_size}"

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes: for replicated KV only TP rank 0 does, the others only read."""
        return not self.replicated or self.tp_rank == 0


@dataclass(frozen=True, eq=False)
class KeyScope:
    """Namespace + shard + part: everything in a key but the page hash. Make keys from it.

    Two scopes are equal when they render the same: a replicated (MLA) shard of TP rank 3 is the
    same scope as that of TP rank 0, since every rank shares the one copy.
    """

    namespace: Namespace
    shard: Shard = field(default_factory=Shard)
    part: str = "kv"

    def __post_init__(self) -> None:
        if not isinstance(self.part, str) or not _PART_RE.fullmatch(self.part):
            raise InvalidKeyError(
                f"key part must match [a-z][a-z0-9_]{{0,31}} (e.g. 'kv', 'k', 'v', 'swa'); got {self.part!r}"
            )

    @cached_property
    def components(self) -> tuple[str, str, str]:
        return (self.namespace.fingerprint, self.shard.token, self.part)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeyScope) and self.components == other.components

    def __hash__(self) -> int:
        return hash(self.components)

    def prefix(self, sep: str = "/") -> str:
        """The rendered scope, which every key of this scope starts with (followed by ``sep``)."""
        return sep.join(self.components)

    def with_part(self, part: str) -> KeyScope:
        return KeyScope(self.namespace, self.shard, part)

    def key(self, page_hash: str) -> PageKey:
        return PageKey(self, page_hash)

    def keys(self, page_hashes: Iterable[str]) -> list[PageKey]:
        return [PageKey(self, h) for h in page_hashes]


@dataclass(frozen=True, slots=True)
class PageKey:
    """One page of one part in one scope. Hashable; compare and use as dict keys freely."""

    scope: KeyScope
    page_hash: str

    def __post_init__(self) -> None:
        if not is_page_hash(self.page_hash):
            raise InvalidKeyError(f"page hash must be 8-128 lowercase hex digits; got {self.page_hash!r}")

    def render(self, sep: str = "/") -> str:
        """``<namespace fingerprint><sep><shard><sep><part><sep><page hash>``; safe as a path or object name."""
        return sep.join((*self.scope.components, self.page_hash))

    def __str__(self) -> str:
        return self.render()
