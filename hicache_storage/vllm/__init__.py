"""hicache-storage for vLLM: any registered connector as vLLM's L3, by either of vLLM's two routes.

``hicache_storage.vllm.connector.HiCacheStorageConnector`` is vLLM's KV connector
(``kv_connector`` / ``kv_connector_module_path`` in ``--kv-transfer-config``);
``hicache_storage.vllm.tier.HiCacheStorageTier`` is a secondary tier behind vLLM's CPU offloading
(``OffloadingConnector`` with ``spec_name="TieringOffloadingSpec"``, one ``secondary_tiers``
entry). See docs/vllm.md. The modules vLLM runs (``connector``, ``scheduler``, ``worker``,
``metadata``, ``tier``) import vLLM; ``config``, ``guard``, ``identity`` and ``tiny_model``
import it, torch or transformers only when called, so a config can be checked, and the bench on a
vLLM engine (``hicache_storage.benchmarks.multiturn.vllm_engine``) can explain itself, where vLLM
is not installed.
"""
