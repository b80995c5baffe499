"""Isolation matrix: on every connector, pages of one identity are never served to another.

The same page hash is written under a base identity and under one variant per identity field
(tenant, model revision, KV dtype, layout, page size, every shard axis, MLA replication, part),
each with bytes unique to it. Every identity must read back exactly its own bytes, and clearing
one namespace must leave every other namespace's pages intact.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from connector_matrix import CONNECTORS, connector_config
from hicache_storage import KeyScope, Namespace, Shard, Store, create_backend
from hicache_storage.conformance.clauses_identity import SHARD_VARIANTS

BASE = Namespace(model="isolation-model", kv_dtype="bfloat16", page_size=64, layout="page_first", revision="r1", tenant="alpha")
NAMESPACE_VARIANTS = {
    "tenant": replace(BASE, tenant="beta"),
    "tenant-absent": replace(BASE, tenant=None),
    "tenant-empty": replace(BASE, tenant=""),
    "revision": replace(BASE, revision="r2"),
    "model": replace(BASE, model="isolation-model-2"),
    "kv_dtype": replace(BASE, kv_dtype="float8_e4m3fn"),
    "layout": replace(BASE, layout="layer_first"),
    "page_size": replace(BASE, page_size=32),
    "format_version": replace(BASE, format_version=BASE.format_version + 1),
}
PAGE = 1024


def identities() -> dict[str, KeyScope]:
    scopes = {"base": KeyScope(BASE)}
    scopes.update({f"ns:{name}": KeyScope(ns) for name, ns in NAMESPACE_VARIANTS.items()})
    scopes.update({f"shard:{name}": KeyScope(BASE, shard) for name, shard in SHARD_VARIANTS.items()})
    scopes["part:v"] = KeyScope(BASE, part="v")
    return scopes


@pytest.mark.services
@pytest.mark.parametrize("label", CONNECTORS)
def test_identities_never_share_pages(request, tmp_path, label):
    name, config = connector_config(request, label, tmp_path)
    scopes = identities()
    page_hash = "5a" * 32
    with Store(create_backend(name, config)) as store:
        try:
            values = {ident: bytes([i + 1]) * PAGE for i, ident in enumerate(scopes)}
            for ident, scope in scopes.items():
                assert store.put([scope.key(page_hash)], [values[ident]]) == [True], ident
            for ident, scope in scopes.items():
                assert store.get([scope.key(page_hash)], PAGE) == [values[ident]], f"{label}: {ident} read another identity's page"

            # MLA: every TP rank reads the one replicated copy, whatever its rank.
            other_rank = KeyScope(BASE, Shard(tp_rank=3, tp_size=4, replicated=True))
            assert store.get([other_rank.key(page_hash)], PAGE) == [values["shard:replicated"]]

            if store.capabilities.clear:
                store.clear(NAMESPACE_VARIANTS["tenant"])
                for ident, scope in scopes.items():
                    expected = None if ident == "ns:tenant" else values[ident]
                    assert store.get([scope.key(page_hash)], PAGE) == [expected], f"{label}: clear(tenant=beta) touched {ident}"
        finally:
            if store.capabilities.clear:
                for namespace in {scope.namespace for scope in scopes.values()}:
                    store.clear(namespace)
