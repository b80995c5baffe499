"""Find backends by name: built-ins (ours, and SGLang's judged through the reverse adapter), entry points,
or ``package.module:ClassName``.

Nothing here imports a connector until it is asked for, so listing backends costs no client
library imports, and a missing optional dependency is reported with the extra that provides it.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.connector import Connector
from hicache_storage.errors import ConfigError, MissingDependencyError, UnknownBackendError

ENTRY_POINT_GROUP = "hicache_storage.backends"


@dataclass(frozen=True)
class BackendSpec:
    """Where a backend lives and what it needs, known without importing it."""

    name: str
    target: str  # "package.module:ClassName"
    extra: str | None = None  # the pip extra that installs its client library
    requires: tuple[str, ...] = ()  # importable module names that must be present
    origin: str = "built-in"  # "built-in", "entry point <dist>" or "import path"
    summary: str = ""

    def missing(self) -> list[str]:
        """The required modules that are not installed (checked without importing them)."""
        return [module for module in self.requires if not _module_available(module)]


_C = "hicache_storage.connectors."

BUILTINS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec("memory", _C + "memory:MemoryBackend", summary="in-process dict; the reference connector"),
        BackendSpec("file", _C + "file:FileBackend", summary="one file per page on a local disk (NVMe), atomic, LRU capacity"),
        BackendSpec("redis", _C + "redis:RedisBackend", "redis", ("redis",), summary="Redis standalone or cluster, pipelined"),
        BackendSpec("s3", _C + "s3:S3Backend", "s3", ("boto3",), summary="Amazon S3 or any S3-compatible store"),
        BackendSpec(
            "mooncake",
            _C + "mooncake:MooncakeBackend",
            "mooncake",
            ("mooncake",),
            summary="Mooncake Store, zero-copy from registered host buffers",
        ),
        BackendSpec("hf3fs", _C + "hf3fs:HF3FSBackend", "hf3fs", summary="3FS: pre-sized per-rank files of page slots"),
        BackendSpec("fsspec", _C + "fsspec:FsspecBackend", "fsspec", ("fsspec",), summary="any fsspec URL (memory://, file://, s3://...)"),
        # SGLang's own backends, to judge them with the suite (hicache_storage.sglang_reverse): one
        # entry per backend whose capabilities that module declares.
        BackendSpec(
            "sglang:file",
            "hicache_storage.sglang_reverse:SGLangFileBackend",
            requires=("sglang",),
            summary="SGLang's own HiCacheFile, through the reverse adapter",
        ),
    )
}


def known_specs() -> dict[str, BackendSpec]:
    """Every backend that can be named: built-ins first, then entry points (which cannot shadow them)."""
    specs = dict(BUILTINS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in specs:
            continue
        dist = ep.dist.name if ep.dist is not None else "unknown distribution"
        specs[ep.name] = BackendSpec(ep.name, ep.value, origin=f"entry point ({dist})")
    return specs


def resolve(name: str) -> type[Connector]:
    """The connector class for a registered name or a ``package.module:ClassName`` path."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a backend name must be a non-empty string, got {name!r}", field="backend")
    specs = known_specs()
    spec = specs.get(name)
    if spec is None:
        if ":" not in name:
            raise UnknownBackendError(name, specs)
        spec = BackendSpec(name, name, origin="import path")
    return load(spec)


def load(spec: BackendSpec) -> type[Connector]:
    missing = spec.missing()
    if missing:
        raise MissingDependencyError(spec.name, missing[0], spec.extra)
    module_name, _, attr = spec.target.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"backend path {spec.target!r} must look like 'package.module:ClassName'", field="backend")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if spec.extra and exc.name and not exc.name.startswith("hicache_storage"):
            raise MissingDependencyError(spec.name, exc.name, spec.extra) from exc
        raise ConfigError(f"cannot import {module_name!r} for backend {spec.name!r}: {exc}", field="backend") from exc
    try:
        cls = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"module {module_name!r} has no attribute {attr!r} (backend {spec.name!r})", field="backend") from None
    if not (isinstance(cls, type) and issubclass(cls, Connector)):
        raise ConfigError(
            f"{spec.target!r} is not a Connector subclass; connectors subclass hicache_storage.Connector",
            field="backend",
        )
    return cls


def create_backend(name: str, config: BackendConfig | Mapping[str, Any] | str | None = None) -> Connector:
    """Build a connector by name with its config (a mapping, a JSON string or ``@path``).

    The connector alone, to put layers over by hand; callers hold a store
    (:func:`~hicache_storage.spec.open_store`, or ``Store(connector)``)."""
    return resolve(name)(config)


@dataclass(frozen=True)
class BackendInfo:
    spec: BackendSpec
    available: bool
    missing: list[str]
    capabilities: Capabilities | None
    error: str | None = None


def describe_backends() -> list[BackendInfo]:
    """Every known backend with availability, missing packages and declared capabilities."""
    infos = []
    for spec in sorted(known_specs().values(), key=lambda s: (s.origin != "built-in", s.name)):
        missing = spec.missing()
        capabilities, error = None, None
        if not missing:
            try:
                capabilities = load(spec).capabilities
            except Exception as exc:  # a broken third-party plugin must not break the listing
                error = f"{type(exc).__name__}: {exc}"
        infos.append(BackendInfo(spec, not missing and error is None, missing, capabilities, error))
    return infos


def _module_available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
