"""The connector exactly as docs/writing-a-connector.md builds it."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pydantic

from hicache_storage import BackendConfig, Capabilities, StorageBackend
from hicache_storage.buffers import fill_segments, segments_size


class AcmeKVConfig(BackendConfig):
    root: str = pydantic.Field(..., description="directory holding the store")


class AcmeKVBackend(StorageBackend):
    name = "acme-kv"
    Config = AcmeKVConfig
    capabilities = Capabilities(delete=True, clear=True, persistent=True, shared_across_processes=True)

    def __init__(self, config=None):
        super().__init__(config)
        self.root = Path(self.config.root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key):
        return self.root / key.render("/")

    def _exists(self, keys):
        return [self._path(k).is_file() for k in keys]

    def _get_into(self, keys, targets):
        results = []
        for key, target in zip(keys, targets):
            try:
                data = self._path(key).read_bytes()
            except FileNotFoundError:
                results.append(False)
                continue
            hit = len(data) == segments_size(target)
            if hit:
                fill_segments(target, data)
            results.append(hit)
        return results

    def _put_from(self, keys, sources):
        for key, source in zip(keys, sources):
            path = self._path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.writelines(source)
            os.replace(tmp, path)  # atomic: readers see the old page or the new one
        return [True] * len(keys)

    def _delete(self, keys):
        results = []
        for key in keys:
            try:
                self._path(key).unlink()
                results.append(True)
            except FileNotFoundError:
                results.append(False)
        return results

    def _clear(self, namespace):
        shutil.rmtree(self.root / namespace.fingerprint, ignore_errors=True)
