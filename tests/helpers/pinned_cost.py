"""The cost model's setting for tests that assert where tokens came from (L3 amounts).

An engine's default, :attr:`~hicache_storage.cost.LoadPolicy.COST`, reads only the stored pages
that arrive before computing them would be done, and while the store is the slow leg it defers
write-through backups to a node's next hit, judged from speeds timed live: the store's reads and
writes, the copies to the device and the engine's own prefills. On a test machine those depend
on its load (the tiny reference model often computes a page faster than a store reads one), so
the pages written and read, and every amount that follows from them (``cached_storage``,
``storage_hit_tokens``, ``prefetch_pages``, ``prefetch_bytes``, a bench's ``storage_tokens``...),
would change from run to run. Outputs do not: a page recomputed has the KV a page loaded has.

A test that asserts such an amount pins :data:`LOAD_AND_STORE_EVERY_PAGE`
(``ControllerConfig(cost=...)``, or a bench's ``load_policy``):
:attr:`~hicache_storage.cost.LoadPolicy.ALL` reads every stored page past the prefetch threshold
and writes every page, as SGLang does, whatever the speeds. A test that checks only outputs or
exactness keeps the default, so the default stays covered. (Tests of the cost model's own choices
give it the speeds they plan with: ``tests/core/test_core_cost.py``.)
"""

from __future__ import annotations

from hicache_storage.cost import CostConfig, LoadPolicy

#: Every page written and every stored page read, whatever the speeds (see the module).
LOAD_AND_STORE_EVERY_PAGE = CostConfig(policy=LoadPolicy.ALL)
