"""The connector's worker side: pages move between the store and vLLM's KV cache, off the forward.

Runs in each of vLLM's workers (one per TP rank), each with its own store and its own shard.

* A page is one block of every attention layer of this rank. Each layer's cache holds a block as
  one contiguous run (vLLM's ``[num_blocks, ...]`` per-layer layout, as on the CPU), so a page is
  read or written in place, one segment per layer: ``get_into`` / ``put_from`` with views of the
  KV cache itself, no staging copy.
* **Loads** are asynchronous: :meth:`WorkerSide.start_loads` hands the step's loads to a load
  thread and returns; the request stays parked in vLLM's scheduler until
  :meth:`WorkerSide.transfer_results` reports it done. A block that does not arrive (a miss, a
  page failing its integrity check, a store that fails) is reported as a load error, and vLLM
  recomputes from the first such block.
* **Saves** run on a save thread once the step's forward has written the blocks (vLLM calls
  ``wait_for_save`` after it): an ``exists`` first, so a block another request or engine already
  stored is not written again, then ``put_from`` of the rest. A block that failed to load is
  written again after it is recomputed. The scheduler keeps a finished request's blocks until
  its saves end; a preempted request's saves end before the next forward may reuse its blocks.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from hicache_storage.errors import ConfigError
from hicache_storage.keys import PageKey
from hicache_storage.vllm.config import WHERE
from hicache_storage.vllm.guard import GuardedStore
from hicache_storage.vllm.identity import Deployment
from hicache_storage.vllm.metadata import BlockTransfer, HiCacheConnectorMetadata

logger = logging.getLogger(__name__)

#: How long shutdown waits for saves under way.
SHUTDOWN_WAIT_S = 30.0


class WorkerSide:
    def __init__(self, deployment: Deployment, store: GuardedStore, tp_rank: int) -> None:
        self.deployment = deployment
        self.store = store
        self.tp_rank = tp_rank
        self._layers: list[torch.Tensor] = []
        #: kernel blocks per vLLM block, per layer
        self._ratio: list[int] = []
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-load")
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-save")
        self._lock = threading.Condition()
        self._loaded: set[str] = set()
        self._invalid: set[int] = set()
        self._reported_invalid: set[int] = set()
        #: pages that failed to load here: written again once recomputed, without asking exists
        self._rewrite: set[PageKey] = set()
        self._pending_saves: collections.Counter[str] = collections.Counter()
        self._saved_requests: set[str] = set()
        self._finishing: set[str] = set()
        #: blocks read, stored, already stored, failed to load or store
        self.counts: collections.Counter[str] = collections.Counter()

    # --- the KV cache -------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """Bind each layer's cache; every block of every layer must be one contiguous run."""
        missing = [name for name in self.deployment.layer_names if name not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no KV cache for layers {', '.join(missing)}", backend=WHERE)
        for name in self.deployment.layer_names:
            tensor = kv_caches[name]
            if tensor.device.type != "cpu":
                raise ConfigError(
                    f"layer {name}'s KV cache is on {tensor.device}; HiCacheStorageConnector moves blocks between host "
                    "memory and the store and has no device staging yet (vLLM's CPU backend keeps the KV cache in host memory)",
                    backend=WHERE,
                )
            if tensor.shape[0] % num_blocks:
                raise ConfigError(
                    f"layer {name}'s KV cache has shape {tuple(tensor.shape)}, whose first axis is not blocks "
                    f"({num_blocks}); this KV layout is not supported",
                    backend=WHERE,
                )
            ratio = tensor.shape[0] // num_blocks
            block = tensor[0:ratio]
            nbytes = block.numel() * block.element_size()
            if not block.is_contiguous() or nbytes != self.deployment.layer_block_bytes:
                raise ConfigError(
                    f"layer {name}'s KV cache (shape {tuple(tensor.shape)}, strides {tensor.stride()}) does not hold a "
                    f"block as one contiguous run of {self.deployment.layer_block_bytes} bytes; this KV layout is not supported",
                    backend=WHERE,
                )
            self._layers.append(tensor)
            self._ratio.append(ratio)
        for tensor in self._layers:
            self._register_buffer(tensor)

    def _register_buffer(self, tensor: torch.Tensor) -> None:
        """Announce one layer's cache to the store (a connector with memory registration maps it once)."""
        self.store.call("register_buffer", "buffer registration", None, lambda: self.store.store.register_buffer(tensor))

    def _page(self, block_id: int) -> list[torch.Tensor]:
        """One page's segments: block ``block_id`` of every layer, in place in the KV cache."""
        return [t[block_id * r : (block_id + 1) * r] for t, r in zip(self._layers, self._ratio)]

    # --- loads --------------------------------------------------------------------------------

    def start_loads(self, meta: HiCacheConnectorMetadata) -> None:
        for load in meta.loads:
            self._loader.submit(self._run_load, load)

    def _run_load(self, load: BlockTransfer) -> None:
        """Read one request's blocks; whatever happens, the load ends and is reported with its
        failed blocks (all of them if it raised), so vLLM never waits on it forever."""
        failed = list(load.block_ids)
        try:
            failed = self._load(load)
        except Exception:
            logger.exception("hicache_storage: load of request %s failed", load.req_id)
        finally:
            with self._lock:
                self._invalid.update(failed)
                self._loaded.add(load.req_id)
                self.counts["blocks_loaded"] += len(load.block_ids) - len(failed)
                self.counts["blocks_failed_to_load"] += len(failed)

    def _load(self, load: BlockTransfer) -> list[int]:
        keys = self.deployment.keys(self.tp_rank, load.hashes)
        targets = [self._page(block) for block in load.block_ids]
        hits = self.store.call("get", f"read of {len(keys)} blocks", None, lambda: self.store.store.get_into(keys, targets))
        if hits is None:
            hits = [False] * len(keys)
        with self._lock:
            self._rewrite.update(key for key, hit in zip(keys, hits) if not hit)
        return [block for block, hit in zip(load.block_ids, hits) if not hit]

    # --- saves --------------------------------------------------------------------------------

    def submit_saves(self, meta: HiCacheConnectorMetadata) -> None:
        for save in meta.saves:
            with self._lock:
                self._pending_saves[save.req_id] += 1
                self._saved_requests.add(save.req_id)
            self._saver.submit(self._run_save, save)

    def _save(self, save: BlockTransfer) -> None:
        keys = self.deployment.keys(self.tp_rank, save.hashes)
        stored = self.store.call("exists", f"exists query of {len(keys)} blocks", None, lambda: self.store.store.exists(keys))
        if stored is None:
            return
        with self._lock:
            todo = [i for i, hit in enumerate(stored) if not hit or keys[i] in self._rewrite]
        if todo:
            written = self.store.call(
                "put",
                f"write of {len(todo)} blocks",
                None,
                lambda: self.store.store.put_from([keys[i] for i in todo], [self._page(save.block_ids[i]) for i in todo]),
            )
            with self._lock:
                for i, ok in zip(todo, written or [False] * len(todo)):
                    if ok:
                        self._rewrite.discard(keys[i])
                self.counts["blocks_stored"] += sum(bool(ok) for ok in written or ())
                self.counts["blocks_not_stored"] += len(todo) - sum(bool(ok) for ok in written or ())
        with self._lock:
            self.counts["blocks_already_stored"] += len(keys) - len(todo)

    def wait_for_saves(self, req_ids: Collection[str] | None = None) -> None:
        """Block until every save handed out so far (only those of ``req_ids``, when given) has
        ended: a preempted request's blocks may be reused by the next forward, and vLLM returns a
        request's output before its blocks' save ends (the counts are final after a wait for all)."""
        with self._lock:
            if req_ids is None:
                self._lock.wait_for(lambda: not self._pending_saves)
            else:
                self._lock.wait_for(lambda: not any(self._pending_saves.get(r) for r in req_ids))

    def _run_save(self, save: BlockTransfer) -> None:
        try:
            self._save(save)
        except Exception:
            logger.exception("hicache_storage: save of request %s failed", save.req_id)
        finally:
            with self._lock:
                self._pending_saves[save.req_id] -= 1
                if not self._pending_saves[save.req_id]:
                    del self._pending_saves[save.req_id]
                self._lock.notify_all()

    # --- completion ---------------------------------------------------------------------------

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose saves ended since they finished, requests whose loads ended); the
        load errors of the same moment are what :meth:`load_errors` returns next."""
        with self._lock:
            self._finishing.update(r for r in finished_req_ids if r in self._saved_requests)
            sending = {r for r in self._finishing if not self._pending_saves[r]}
            self._finishing -= sending
            self._saved_requests -= sending
            recving, self._loaded = self._loaded, set()
            self._reported_invalid, self._invalid = self._invalid, set()
            # A load's failed blocks are recorded with its end, so they go out with it.
            return sending, recving

    def load_errors(self) -> set[int]:
        errors, self._reported_invalid = self._reported_invalid, set()
        return errors

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
        done = threading.Event()

        def drain() -> None:
            self._saver.shutdown(wait=True)
            done.set()

        threading.Thread(target=drain, daemon=True).start()
        if not done.wait(SHUTDOWN_WAIT_S):
            logger.warning("hicache_storage: saves still under way after %.0f s at shutdown; they are abandoned", SHUTDOWN_WAIT_S)
        self.store.close()
