"""Wrappers any backend can be put in: timeout, retry, integrity, metrics, fault injection.

Each wrapper is a :class:`~hicache_storage.backend.StorageBackend` around another one (see
:mod:`hicache_storage.wrappers.base`). Operators put them on from config with :func:`wrap`::

    backend = wrap(create_backend("redis", {...}), [
        {"kind": "integrity"},
        {"kind": "timeout", "seconds": 2.0},
        {"kind": "retry", "attempts": 3},
        {"kind": "metrics", "prometheus": True},
    ])
    # -> metrics(retry(timeout(integrity(redis))))

The recommended order, innermost first: ``faults`` (only when rehearsing: right next to the
store, so integrity sees its corrupted pages), ``integrity``, ``timeout`` (bounds each try),
``retry`` (retries timed-out tries within its deadline), ``metrics`` (sees what callers see).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache_storage.backend import StorageBackend
from hicache_storage.config import read_config_file
from hicache_storage.errors import ConfigError
from hicache_storage.wrappers.base import BackendWrapper, find_wrapper, unwrap
from hicache_storage.wrappers.faults import FaultInjectionWrapper
from hicache_storage.wrappers.integrity import IntegrityWrapper
from hicache_storage.wrappers.metrics import MetricsWrapper, prometheus_text
from hicache_storage.wrappers.retry import RetryWrapper
from hicache_storage.wrappers.timeout import TimeoutWrapper

#: Wrapper classes by the ``kind`` used in specs.
WRAPPERS: dict[str, type[BackendWrapper]] = {
    cls.kind: cls for cls in (TimeoutWrapper, RetryWrapper, IntegrityWrapper, MetricsWrapper, FaultInjectionWrapper)
}

WrapperSpecs = Sequence[Mapping[str, Any]] | str | Path | None


def wrap(backend: StorageBackend, specs: WrapperSpecs) -> StorageBackend:
    """Put ``backend`` inside the wrappers ``specs`` describes, the first spec innermost.

    ``specs`` is a list of mappings, each ``{"kind": <one of WRAPPERS>, **that wrapper's config}``;
    or that list as a JSON string; or ``@path`` to a json/yaml/toml file holding the list, or an
    object whose ``wrappers`` key holds it (toml needs the object form). ``None`` or ``[]`` returns
    ``backend`` unchanged. A spec with an unknown kind or key raises :class:`ConfigError` naming
    the spec and listing what is valid; nothing is wrapped then.
    """
    specs = load_wrapper_specs(specs)
    plans = []
    for index, spec in enumerate(specs):
        where = f"wrapper spec #{index}"
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{where} must be an object like {{\"kind\": \"retry\"}}, got {type(spec).__name__}", field=where)
        options = dict(spec)
        kind = options.pop("kind", None)
        if kind not in WRAPPERS:
            given = "no 'kind'" if kind is None else f"unknown kind {kind!r}"
            raise ConfigError(f"{where} has {given}; valid kinds: {', '.join(WRAPPERS)}", field=f"{where}.kind")
        cls = WRAPPERS[kind]
        try:
            config = cls.Config.parse(options, backend=kind)
        except ConfigError as exc:
            raise ConfigError(f"{where} ({kind}): {exc.message}", field=f"{where}.{exc.field}" if exc.field else where) from None
        plans.append((cls, config))
    for cls, config in plans:
        backend = cls(backend, config)
    return backend


def load_wrapper_specs(specs: WrapperSpecs) -> list[Mapping[str, Any]]:
    """The list of wrapper specs from a list, a JSON string or ``@path`` (see :func:`wrap`)."""
    if specs is None:
        return []
    if isinstance(specs, Path) or (isinstance(specs, str) and specs.strip().startswith("@")):
        path = specs if isinstance(specs, Path) else Path(specs.strip()[1:]).expanduser()
        data = read_config_file(path, "wrapper file", field="wrappers")
        data = [] if data is None else data
        what = f"wrapper file {str(path)!r}"
    elif isinstance(specs, str):
        text = specs.strip()
        try:
            data = json.loads(text) if text else []
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"wrapper specs are not valid JSON ({exc.msg} at column {exc.colno}); "
                'pass a list such as \'[{"kind": "timeout", "seconds": 2}]\' or \'@wrappers.yaml\'',
                field="wrappers",
            ) from None
        what = "the wrapper JSON"
    else:
        data, what = specs, "wrapper specs"
    if isinstance(data, Mapping) and set(data) == {"wrappers"}:
        data = data["wrappers"]
    if isinstance(data, (str, bytes)) or not isinstance(data, Sequence):
        raise ConfigError(f"{what} must be a list of wrapper specs (or {{\"wrappers\": [...]}}), got {type(data).__name__}", field="wrappers")
    return list(data)


__all__ = [
    "WRAPPERS",
    "BackendWrapper",
    "FaultInjectionWrapper",
    "IntegrityWrapper",
    "MetricsWrapper",
    "RetryWrapper",
    "TimeoutWrapper",
    "find_wrapper",
    "load_wrapper_specs",
    "prometheus_text",
    "unwrap",
    "wrap",
]
