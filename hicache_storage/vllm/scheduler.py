"""The connector's scheduler side: which blocks to load from the store, which to save to it.

Runs in vLLM's scheduler (the engine core), on its one thread. Per request:

* **lookup** (``get_num_new_matched_tokens``): the request's full blocks after its local prefix hit
  are looked up in the store, for every TP rank's shard (a block is loadable only if every rank
  holds its part); the leading run found is reported, as an **asynchronous** load: vLLM allocates
  the blocks and parks the request (``WAITING_FOR_REMOTE_KVS``) while the workers read, so no
  forward pass waits on the store;
* **save**: at every step, each scheduled request's blocks that the step completes (prompt and
  generated tokens alike) are handed to the workers to store after the forward;
* **finish**: a request with saves handed out keeps its blocks until every worker reports them
  done (``finished_sending``); one finished while still loading keeps them until the load ends.

What each request got from the store is returned in its ``kv_transfer_params`` under
``"hicache_storage"`` (see :class:`RequestReport`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from hicache_storage.vllm.guard import GuardedStore
from hicache_storage.vllm.identity import Deployment
from hicache_storage.vllm.metadata import BlockTransfer, HiCacheConnectorMetadata

logger = logging.getLogger(__name__)

#: The key of this connector's report in a request's ``kv_transfer_params``.
REPORT_KEY = "hicache_storage"


@dataclass
class RequestReport:
    """What one request got from the store (returned with its output)."""

    #: tokens already cached in vLLM's own prefix cache (block-aligned) when it was looked up
    local_tokens: int = 0
    #: tokens the store held beyond them, which vLLM then asked the workers to load
    external_tokens: int = 0
    #: of those, tokens whose blocks arrived (the rest were recomputed)
    loaded_tokens: int = 0
    #: blocks that failed to load (a miss after the lookup found them: a corrupt, vanished or unreadable page)
    failed_blocks: int = 0
    #: blocks handed to the workers to store (each worker skips those its shard already holds)
    saved_blocks: int = 0


@dataclass
class _Request:
    request: Any
    report: RequestReport = field(default_factory=RequestReport)
    #: (first block, blocks found) at the last lookup
    lookup: tuple[int, int] = (0, 0)
    #: block ids of the load in flight, in page order
    loading: tuple[int, ...] = ()
    #: those some worker reported failed
    failed: set[int] = field(default_factory=set)
    #: leading blocks already handed to the workers to store
    saved: int = 0
    #: whether any save was handed out: the workers then report the request's end
    saves_issued: bool = False
    #: blocks from its start that a lookup may report: a load that failed stops the next lookup
    #: of the same request before its first failed block (vLLM looks a request up again when a
    #: failed load left it nothing), so a bad page costs one failed load, not a loop
    lookup_limit: int | None = None


class SchedulerSide:
    def __init__(self, deployment: Deployment, store: GuardedStore) -> None:
        self.deployment = deployment
        self.store = store
        self._requests: dict[str, _Request] = {}
        self._loads: list[BlockTransfer] = []

    # --- lookup and load ----------------------------------------------------------------------

    def lookup(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` (block-aligned) that the store holds for every rank."""
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _Request(request)
        size = self.deployment.block_size
        first = num_computed_tokens // size
        hashes = self.deployment.page_hashes(request.block_hashes)[first : state.lookup_limit]
        found = self._stored_prefix(hashes) if hashes else 0
        state.lookup = (first, found)
        state.report.local_tokens = first * size
        return found * size, found > 0

    def _stored_prefix(self, hashes: list[str]) -> int:
        found = len(hashes)
        for rank in range(self.deployment.tp_size):
            keys = self.deployment.keys(rank, hashes[:found])
            found = self.store.call("exists", f"lookup of {len(keys)} blocks", 0, lambda: self.store.store.prefix_exists(keys))
            if not found:
                break
        return found

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _Request(request)
        if num_external_tokens <= 0:
            return
        first, found = state.lookup
        blocks = min(found, num_external_tokens // self.deployment.block_size)
        hashes = self.deployment.page_hashes(request.block_hashes)[first : first + blocks]
        ids = tuple(block_ids[first : first + blocks])
        state.loading = ids
        state.report.external_tokens = blocks * self.deployment.block_size
        self._loads.append(BlockTransfer(request.request_id, ids, tuple(hashes)))

    # --- the step's plan ------------------------------------------------------------------------

    def build_meta(self, scheduler_output: Any) -> HiCacheConnectorMetadata:
        loads, self._loads = self._loads, []
        preempted = tuple(scheduler_output.preempted_req_ids or ())
        for req_id in preempted:
            state = self._requests.get(req_id)
            if state is not None:  # its blocks are freed; when it runs again, it saves from its new ones
                state.saved = 0
        saves: list[BlockTransfer] = []
        block_state = scheduler_output.kv_connector_block_state
        size = self.deployment.block_size
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None or block_state is None:
                continue
            request = state.request
            hashes = self.deployment.page_hashes(request.block_hashes)
            full = min(len(hashes), (request.num_computed_tokens + scheduled) // size)
            if full <= state.saved:
                continue
            groups = block_state.get_block_ids(req_id)
            if not groups:
                continue
            ids = groups[0]
            full = min(full, len(ids))
            saves.append(BlockTransfer(req_id, tuple(ids[state.saved : full]), tuple(hashes[state.saved : full])))
            state.report.saved_blocks += full - state.saved
            state.saved = full
            state.saves_issued = True
        return HiCacheConnectorMetadata(loads=loads, saves=saves, preempted=preempted)

    # --- what the workers report --------------------------------------------------------------

    def connector_output(self, output: Any) -> None:
        """Attribute failed blocks to the loads they belong to (with TP, each worker reports its own,
        possibly in different steps), and close the loads that every worker has finished."""
        invalid = set(output.invalid_block_ids or ())
        if invalid:
            for loading in self._requests.values():
                loading.failed.update(block for block in loading.loading if block in invalid)
        for req_id in output.finished_recving or ():
            state = self._requests.get(req_id)
            if state is None or not state.loading:
                continue
            failed = [i for i, block in enumerate(state.loading) if block in state.failed]
            good = failed[0] if failed else len(state.loading)
            state.report.failed_blocks += len(failed)
            state.report.loaded_tokens = good * self.deployment.block_size
            if failed:
                state.lookup_limit = state.lookup[0] + good
            state.loading, state.failed = (), set()

    def finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Whether the request's blocks must wait for the workers, and its report."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        # A load still running writes into the blocks: vLLM frees them when it reports the load done.
        return bool(state.loading) or state.saves_issued, {REPORT_KEY: asdict(state.report)}
