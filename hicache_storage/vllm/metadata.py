"""What the scheduler side tells the workers each step (pickled to every worker process)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request to move, each with its page hash (same order)."""

    req_id: str
    block_ids: tuple[int, ...]
    hashes: tuple[str, ...]


@dataclass
class HiCacheConnectorMetadata(KVConnectorMetadata):
    #: blocks to read from the store into vLLM's KV cache (asynchronous loads)
    loads: list[BlockTransfer] = field(default_factory=list)
    #: blocks this step completes, to store once its forward has written them
    saves: list[BlockTransfer] = field(default_factory=list)
    #: requests preempted this step: their blocks may be reused, so their saves must end first
    preempted: tuple[str, ...] = ()
