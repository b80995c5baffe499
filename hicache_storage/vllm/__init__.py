"""hicache-storage for vLLM: any registered connector as vLLM's KV connector (an L3 for its prefix cache).

``hicache_storage.vllm.connector.HiCacheStorageConnector`` is what vLLM loads (``kv_connector`` /
``kv_connector_module_path`` in ``--kv-transfer-config``); see docs/vllm.md. The modules vLLM
runs (``connector``, ``scheduler``, ``worker``, ``metadata``) import vLLM; ``config``, ``guard``,
``identity``, ``tiny_model`` and ``bench`` import it, torch or transformers only when called, so
a config can be checked and the bench explain itself where vLLM is not installed.
"""
