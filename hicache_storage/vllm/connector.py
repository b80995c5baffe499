"""Any hicache-storage connector as vLLM's KV connector: an L3 for vLLM's prefix cache.

vLLM builds this class from its ``kv_transfer_config``, once in the scheduler and once in every
worker::

    vllm serve MODEL --block-size 32 --kv-transfer-config '{
        "kv_connector": "HiCacheStorageConnector",
        "kv_connector_module_path": "hicache_storage.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connector": "file", "connector_config": {"root": "/mnt/nvme/kv"}}}'

``kv_connector_extra_config`` is :class:`~hicache_storage.vllm.config.VllmConnectorConfig`:
``connector``, ``connector_config``, ``layers``, ``tenant``, ``revision``, ``model``,
``breaker``, ``timeout_s``, as for the SGLang adapter. The scheduler side
(:mod:`hicache_storage.vllm.scheduler`) decides what to load and save; the worker side
(:mod:`hicache_storage.vllm.worker`) moves the blocks, off the forward pass; pages are keyed as
:mod:`hicache_storage.vllm.identity` says. A store that fails or hangs costs recompute, never a
request (:mod:`hicache_storage.vllm.guard`).

``kv_load_failure_policy`` must be ``"recompute"``: a cache page can vanish or fail its
integrity check between lookup and load, and vLLM's default (``"fail"``) would fail the request.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hicache_storage.errors import ConfigError
from hicache_storage.vllm.config import WHERE, VllmConnectorConfig
from hicache_storage.vllm.guard import GuardedStore
from hicache_storage.vllm.identity import deployment
from hicache_storage.vllm.metadata import HiCacheConnectorMetadata
from hicache_storage.vllm.scheduler import SchedulerSide
from hicache_storage.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class HiCacheStorageConnector(KVConnectorBase_V1):
    """vLLM's ``KVConnectorBase_V1`` over a hicache-storage store (see the module docstring)."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = VllmConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        if transfer.kv_load_failure_policy != "recompute":
            raise ConfigError(
                f"HiCacheStorageConnector needs kv_load_failure_policy 'recompute' in --kv-transfer-config (it is "
                f"{transfer.kv_load_failure_policy!r}): a cache page can vanish or fail its integrity check after its "
                'lookup, and vLLM would then fail the request instead of recomputing it. Add "kv_load_failure_policy": "recompute"',
                field="kv_load_failure_policy",
                backend=WHERE,
            )
        self.deployment = deployment(vllm_config, kv_cache_config, self.config)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role is KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self.deployment, GuardedStore(self.config, self.deployment.scope(0)))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            self.worker = WorkerSide(self.deployment, GuardedStore(self.config, self.deployment.scope(rank)), rank)
        logger.info(
            "hicache_storage: %s side on store %s, namespace %s (%s)",
            role.name.lower(),
            self.config.connector,
            self.deployment.namespace.fingerprint,
            self.deployment.namespace.geometry,
        )

    @property
    def requires_kv_delivery(self) -> bool:
        """A save that does not happen is a later cache miss, not lost work."""
        return False

    # --- worker side --------------------------------------------------------------------------

    def _worker(self) -> WorkerSide:
        if self.worker is None:
            raise RuntimeError("a worker-side method of HiCacheStorageConnector was called on its scheduler side")
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register(kv_caches, self._kv_cache_config.num_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HiCacheConnectorMetadata)
        self._worker().start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads are asynchronous, and a request runs only once its load ended."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Nothing during the forward: the step's blocks are stored after it (:meth:`wait_for_save`)."""

    def wait_for_save(self) -> None:
        """Hand the blocks this step completed to the save thread; returns at once."""
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, HiCacheConnectorMetadata)
            self._worker().submit_saves(meta)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """A preempted request's blocks may be reused by this step's forward: its saves end first."""
        assert isinstance(kv_connector_metadata, HiCacheConnectorMetadata)
        if kv_connector_metadata.preempted:
            self._worker().wait_for_saves(kv_connector_metadata.preempted)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self._worker().transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().load_errors()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.store.close()

    # --- scheduler side -----------------------------------------------------------------------

    def _scheduler(self) -> SchedulerSide:
        if self.scheduler is None:
            raise RuntimeError("a scheduler-side method of HiCacheStorageConnector was called on a worker")
        return self.scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().lookup(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler().after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().finished(request)
