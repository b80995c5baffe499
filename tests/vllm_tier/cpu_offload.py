"""What stands in for vLLM's CUDA offload worker when the offloading route runs on the CPU (tests only).

vLLM 0.32's ``TieringOffloadingSpec`` gets its worker from ``CPUOffloadingSpec.get_worker``,
which refuses every platform but CUDA-alike and XPU ("CPU Offloading is currently only supported
on CUDA-alike and XPU GPUs", vllm/v1/kv_offload/cpu/spec.py:199-203); the worker it would build,
``CPUOffloadingWorker``, copies with device streams and asserts device tensors
(vllm/v1/kv_offload/cpu/gpu_worker.py:302). The scheduler side (the CPU primary tier, the
cascades to secondary tiers, the promotions) has no such check.

:class:`CpuTieringOffloadingSpec` is ``TieringOffloadingSpec`` with one method replaced: its
worker, :class:`HostCopyWorker`, copies blocks between vLLM's KV cache (host memory on the CPU
backend) and the same shared region ``TieringOffloadingSpec.create_worker`` maps, in the layout
``CPUOffloadingWorker`` gives it (each canonical tensor's block, tensor after tensor, in this
rank's slot of the row). It is minimal: one KV cache group, one block per chunk, synchronous
copies (each transfer is done when it is submitted). Selected with
``"spec_name": "CpuTieringOffloadingSpec", "spec_module_path": "cpu_offload"`` (this folder is on
the role process's path); on a GPU, ``"spec_name": "TieringOffloadingSpec"`` needs none of it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class HostCopyWorker(OffloadingWorker):
    """Copies blocks between the KV cache and the primary tier's rows with plain tensor indexing."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion) -> None:
        if blocks_per_chunk != 1 or len(kv_caches.group_data_refs) != 1:
            raise NotImplementedError(
                f"the CPU stand-in copy worker moves one block per chunk of one KV cache group "
                f"(got {blocks_per_chunk} blocks per chunk, {len(kv_caches.group_data_refs)} groups)"
            )
        self._region = region
        #: (KV cache blocks, primary rows) per canonical tensor, both int8 [blocks, page bytes]
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for cache in kv_caches.tensors:
            blocks = cache.tensor.view(torch.int8).view(-1, cache.page_size_bytes)
            self._pairs.append((blocks, region.create_next_worker_view(cache.page_size_bytes)))
        self._finished: list[TransferResult] = []

    def _copy(self, job_id: int, src_spec: Any, dst_spec: Any, to_host: bool) -> bool:
        start = time.perf_counter()
        src = torch.from_numpy(np.asarray(src_spec.block_ids, dtype=np.int64))
        dst = torch.from_numpy(np.asarray(dst_spec.block_ids, dtype=np.int64))
        assert len(src) == len(dst), (len(src), len(dst))
        moved = 0
        for blocks, rows in self._pairs:
            source, target = (blocks, rows) if to_host else (rows, blocks)
            target[dst] = source[src]
            moved += len(src) * blocks.shape[1]
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=moved, transfer_time=time.perf_counter() - start))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """KV cache blocks -> primary rows."""
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Primary rows -> KV cache blocks."""
        return self._copy(job_id, src_spec, dst_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        """Every copy ended when it was submitted."""

    def shutdown(self) -> None:
        self._pairs.clear()
        self._region.cleanup()


class CpuTieringOffloadingSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker is :class:`HostCopyWorker` (see the module docstring)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                self._worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, region)
            except Exception:
                region.cleanup()
                raise
        return self._worker
