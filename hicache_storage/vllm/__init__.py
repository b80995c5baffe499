"""hicache-storage for vLLM: any registered connector as vLLM's KV connector (an L3 for its prefix cache).

``hicache_storage.vllm.connector.HiCacheStorageConnector`` is what vLLM loads (``kv_connector`` /
``kv_connector_module_path`` in ``--kv-transfer-config``); see docs/vllm.md. Only the modules that
vLLM itself loads import vLLM: this package and :mod:`hicache_storage.vllm.config` do not.
"""
