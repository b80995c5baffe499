"""Any SGLang ``HiCacheStorage`` backend as a hicache-storage connector, to judge it.

:func:`sglang_backend_class` makes the class for SGLang's backend ``NAME`` (as registered in
SGLang's ``StorageBackendFactory``: ``file``, ``mooncake``, ...), named ``sglang:NAME``. Those
whose capabilities :data:`KNOWN_CAPABILITIES` declares are registered under that name (the
registry's built-in table), so the conformance suite runs against them::

    hicache-storage conformance sglang:file --config '{"extra_config": {"file_storage_path": "/tmp/kv"}}'

The SGLang backend is built by SGLang's own factory, as a single-rank deployment
(``tp_size=1``, MHA), and driven through the interface SGLang's cache controller uses for
backends without the zero-copy path: ``exists``, ``batch_get`` into flat page tensors, and
``set`` of a flat page tensor (per page, so each page gets its own result). Our
:class:`~hicache_storage.keys.PageKey` is rendered into the string key, so every field of the
identity is in the name SGLang sees; SGLang then appends its own suffix (model name, ranks).

Nothing here hides what the SGLang backend does: a value it returns is passed on as it is, and
an exception it raises is re-raised as a :class:`~hicache_storage.errors.StorageError` naming it.
Backends that only work with a registered host pool (the zero-copy ``batch_*_v1`` family:
mooncake, hf3fs, nixl, ...) are not supported: there is no host pool here.

``delete`` and ``clear`` are not offered: SGLang's interface has no delete, and its ``clear()``
removes every page of every deployment in the store, not one namespace.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from typing import Any, ClassVar

import pydantic

from hicache_storage.connector import Connector
from hicache_storage.buffers import Segments, fill_segments, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.errors import BackendContractError, ConfigError, ErrorStatus, MissingDependencyError, StorageError
from hicache_storage.keys import PageKey

PREFIX = "sglang:"

#: What each SGLang backend is known to do, declared so the suite checks the right clauses.
KNOWN_CAPABILITIES: dict[str, Capabilities] = {
    # One file per page in a directory: survives restarts, visible to every process on the host.
    "file": Capabilities(persistent=True, shared_across_processes=True),
}


class SGLangBackendConfig(BackendConfig):
    extra_config: dict[str, Any] = pydantic.Field(
        default_factory=dict,
        description="SGLang's --hicache-storage-backend-extra-config for that backend, e.g. {\"file_storage_path\": \"/tmp/kv\"}",
    )
    model_name: str = pydantic.Field("hicache-storage", min_length=1, description="the model name SGLang's backend is given")


class SGLangConnector(Connector):
    """Base of the ``sglang:NAME`` classes made by :func:`sglang_backend_class`."""

    Config = SGLangBackendConfig
    config: SGLangBackendConfig
    #: The backend's name in SGLang's ``StorageBackendFactory``.
    sglang_name: ClassVar[str] = ""

    def __init__(self, config: SGLangBackendConfig | dict[str, Any] | str | None = None) -> None:
        super().__init__(config)
        if not self.sglang_name:
            raise ConfigError("use sglang_backend_class(NAME) (registry name e.g. 'sglang:file') to pick an SGLang backend")
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        storage_config = HiCacheStorageConfig(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=False,
            enable_storage_metrics=False,
            is_page_first_layout=True,
            model_name=self.config.model_name,
            extra_config=dict(self.config.extra_config),
        )
        try:
            self.store = StorageBackendFactory.create_backend(self.sglang_name, storage_config, None)
        except Exception as exc:
            raise ConfigError(
                f"SGLang could not build its {self.sglang_name!r} storage backend without a host pool: "
                f"{type(exc).__name__}: {exc}",
                backend=self.name,
            ) from exc

    # --- hooks --------------------------------------------------------------------------------

    def _exists(self, keys: list[PageKey]) -> list[bool]:
        return [bool(self._call("exists", self.store.exists, _name(key))) for key in keys]

    def _get_into(self, keys: list[PageKey], targets: list[Segments]) -> list[bool]:
        import torch

        tensors = [_target_tensor(target) for target in targets]
        pages = self._call("batch_get", self.store.batch_get, [_name(key) for key in keys], tensors)
        if not isinstance(pages, list) or len(pages) != len(keys):
            raise BackendContractError(
                f"SGLang's {self.sglang_name!r} batch_get returned {type(pages).__name__} for {len(keys)} keys",
                backend=self.name,
                operation="get",
            )
        results = []
        for page, tensor, target in zip(pages, tensors, targets):
            hit = page is not None
            if hit and page is not tensor:
                data = page.contiguous().view(torch.uint8).reshape(-1)
                hit = data.numel() == tensor.numel()
                if hit:
                    tensor.copy_(data)
            if hit and len(target) != 1:
                fill_segments(target, tensor.numpy())
            results.append(hit)
        return results

    def _put_from(self, keys: list[PageKey], sources: list[Segments]) -> list[bool]:
        import torch

        results = []
        for key, source in zip(keys, sources):
            data = bytearray(b"".join(source))
            page = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            results.append(bool(self._call("set", self.store.set, _name(key), page)))
        return results

    def _close(self) -> None:
        close = getattr(self.store, "close", None)
        if close is not None:
            self._call("close", close)

    def _call(self, operation: str, method: Any, *args: Any) -> Any:
        try:
            return method(*args)
        except StorageError:
            raise
        except Exception as exc:
            # SGLang's backends raise untyped errors: only a lost connection or a timeout may pass.
            passing = isinstance(exc, (ConnectionError, TimeoutError))
            raise StorageError(
                f"SGLang's {self.sglang_name!r} backend raised {type(exc).__name__}: {exc}",
                backend=self.name,
                operation=operation,
                status=ErrorStatus.TEMPORARY if passing else ErrorStatus.PERMANENT,
            ) from exc


def _name(key: PageKey) -> str:
    """The key SGLang sees: the rendered PageKey, with '_' (no '/', so file backends keep one directory)."""
    return key.render(sep="_")


def _target_tensor(target: Segments) -> Any:
    """A uint8 tensor over a one-segment target (zero-copy), or a scratch tensor for several."""
    import torch

    size = segments_size(target)
    if len(target) == 1 and size:
        return torch.frombuffer(target[0], dtype=torch.uint8)
    return torch.empty(size, dtype=torch.uint8)


@cache
def sglang_backend_class(sglang_name: str) -> type[SGLangConnector]:
    """The connector class for SGLang's backend ``sglang_name``, named ``sglang:NAME``."""
    if not sglang_name:
        raise ConfigError("name an SGLang backend after the prefix, e.g. 'sglang:file'", field="backend")
    if importlib.util.find_spec("sglang") is None:
        raise MissingDependencyError(PREFIX + sglang_name, "sglang", None)
    return type(
        f"SGLang{sglang_name.title().replace('_', '')}Backend",
        (SGLangConnector,),
        {
            "__module__": __name__,
            "__doc__": f"SGLang's {sglang_name!r} HiCache storage backend, judged as a connector.",
            "name": PREFIX + sglang_name,
            "sglang_name": sglang_name,
            "capabilities": KNOWN_CAPABILITIES.get(sglang_name, Capabilities()),
        },
    )


def __getattr__(attr: str) -> Any:
    # The class the registry's ``sglang:file`` names, made on first use.
    if attr == "SGLangFileBackend":
        return sglang_backend_class("file")
    raise AttributeError(attr)
