"""Layers any connector can be put under: timeout, retry, integrity, metrics, fault injection.

Each layer is a :class:`~hicache_storage.connector.Level` over the level below it (see
:mod:`hicache_storage.layers.base`), reached through the level interface. Operators name them in
a store spec (:func:`hicache_storage.spec.open_store`), or put them over a connector with
:func:`stack_layers`::

    top = stack_layers(create_backend("redis", {...}), [
        {"kind": "integrity"},
        {"kind": "timeout", "seconds": 2.0},
        {"kind": "retry", "attempts": 3},
        {"kind": "metrics", "prometheus": True},
    ])
    # -> metrics(retry(timeout(integrity(redis)))); Store(top) is the caller's API over it

The recommended order, innermost first: ``faults`` (only when rehearsing: right next to the
store, so integrity sees its corrupted pages), ``integrity``, ``timeout`` (bounds each try),
``retry`` (retries timed-out tries within its deadline), ``metrics`` (sees what callers see). With
a zero-copy timeout, retry and integrity go below it (:func:`check_layer_order` refuses
otherwise): ``timeout(retry(integrity(store)))``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache_storage.connector import Level
from hicache_storage.store import Store
from hicache_storage.config import BackendConfig, read_config_file
from hicache_storage.errors import ConfigError
from hicache_storage.layers.base import Layer, connector_of, find_layer
from hicache_storage.layers.faults import FaultInjectionLayer
from hicache_storage.layers.integrity import IntegrityLayer
from hicache_storage.layers.metrics import MetricsLayer, prometheus_text
from hicache_storage.layers.retry import RetryLayer
from hicache_storage.layers.timeout import TimeoutConfig, TimeoutLayer

#: Layer classes by the ``kind`` used in specs.
LAYERS: dict[str, type[Layer]] = {
    cls.kind: cls for cls in (TimeoutLayer, RetryLayer, IntegrityLayer, MetricsLayer, FaultInjectionLayer)
}
#: Layers that must sit below a zero-copy timeout, never above it.
BELOW_ZERO_COPY_TIMEOUT = ("retry", "integrity")

LayerSpecs = Sequence[Mapping[str, Any]] | str | Path | None


def stack_layers(
    backend: Level | Store,
    layers: LayerSpecs,
    *,
    default_timeout: TimeoutConfig | Mapping[str, Any] | None = None,
) -> Level:
    """``backend`` (a connector, the top of a stack, or a store's stack) under ``layers``, the first innermost, then
    under a ``default_timeout`` layer if the resulting stack does not bound its calls; returns the
    new top. ``layers`` is a list of mappings, each ``{"kind": <one of LAYERS>, **that layer's
    config}``; or that list as a JSON string; or ``@path`` to a json/yaml/toml file holding the
    list, or an object whose ``layers`` key holds it (toml needs the object form). ``None`` or
    ``[]`` adds no layer. Every spec is checked, and the order is checked against the zero-copy
    rule (module docstring), before any layer is built: on an error nothing is stacked and a
    :class:`ConfigError` names the spec and lists what is valid."""
    if isinstance(backend, Store):
        backend = backend.top
    plans = plan_layers(layers)
    timeout = None if default_timeout is None else TimeoutConfig.parse(default_timeout, backend="timeout")
    check_layer_order([*_kinds(backend), *((cls.kind, _zero_copy(config)) for cls, config in plans)])
    for cls, config in plans:
        backend = cls(backend, config)
    if timeout is not None and not backend.capabilities.bounded_calls:
        check_layer_order([*_kinds(backend), ("timeout", timeout.zero_copy)])
        backend = TimeoutLayer(backend, timeout)
    return backend


def plan_layers(specs: LayerSpecs) -> list[tuple[type[Layer], BackendConfig]]:
    """Each layer spec as its class and parsed config; a bad spec is a ConfigError naming it."""
    plans = []
    for index, spec in enumerate(load_layer_specs(specs)):
        where = f"layer spec #{index}"
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{where} must be an object like {{\"kind\": \"retry\"}}, got {type(spec).__name__}", field=where)
        options = dict(spec)
        kind = options.pop("kind", None)
        if kind not in LAYERS:
            given = "no 'kind'" if kind is None else f"unknown kind {kind!r}"
            raise ConfigError(f"{where} has {given}; valid kinds: {', '.join(LAYERS)}", field=f"{where}.kind")
        cls = LAYERS[kind]
        try:
            config = cls.Config.parse(options, backend=kind)
        except ConfigError as exc:
            raise ConfigError(f"{where} ({kind}): {exc.message}", field=f"{where}.{exc.field}" if exc.field else where) from None
        plans.append((cls, config))
    return plans


def check_layer_order(kinds: Sequence[tuple[str, bool]]) -> None:
    """Refuse a stack, given innermost first as ``(kind, zero_copy)``, with retry or integrity above a zero-copy timeout."""
    timeout_at = None
    for position, (kind, zero_copy) in enumerate(kinds):
        if kind == "timeout" and zero_copy and timeout_at is None:
            timeout_at = position
        elif kind in BELOW_ZERO_COPY_TIMEOUT and timeout_at is not None:
            order = " > ".join(k for k, _ in reversed(kinds))
            raise ConfigError(
                f"a {kind} layer above a zero-copy timeout layer ({order}, outermost first) could reuse the caller's "
                "buffers while a timed-out call still uses them; put retry and integrity below the zero-copy "
                "timeout, as in timeout(retry(integrity(store))), or give the timeout zero_copy: false",
                field="layers",
            )


def _kinds(backend: Level) -> list[tuple[str, bool]]:
    """The layers already in ``backend``'s stack as ``(kind, zero_copy)``, innermost first."""
    levels = [level for level in backend.levels() if isinstance(level, Layer)]
    return [(level.kind, _zero_copy(level.config)) for level in reversed(levels)]


def _zero_copy(config: BackendConfig) -> bool:
    return isinstance(config, TimeoutConfig) and config.zero_copy


def load_layer_specs(specs: LayerSpecs) -> list[Mapping[str, Any]]:
    """The list of layer specs from a list, a JSON string or ``@path`` (see :func:`stack_layers`).

    A file holding ``{"layers": [...]}`` (the name layers had before) is read too, with a
    deprecation warning.
    """
    if specs is None:
        return []
    if isinstance(specs, Path) or (isinstance(specs, str) and specs.strip().startswith("@")):
        path = specs if isinstance(specs, Path) else Path(specs.strip()[1:]).expanduser()
        data = read_config_file(path, "layer file", field="layers")
        data = [] if data is None else data
        what = f"layer file {str(path)!r}"
    elif isinstance(specs, str):
        text = specs.strip()
        try:
            data = json.loads(text) if text else []
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"layer specs are not valid JSON ({exc.msg} at column {exc.colno}); "
                'pass a list such as \'[{"kind": "timeout", "seconds": 2}]\' or \'@layers.yaml\'',
                field="layers",
            ) from None
        what = "the layer JSON"
    else:
        data, what = specs, "layer specs"
    if isinstance(data, Mapping) and set(data) == {"layers"}:
        data = data["layers"]
    elif isinstance(data, Mapping) and set(data) == {"wrappers"}:
        from hicache_storage.deprecation import warn_renamed

        warn_renamed(f"the {what} key 'wrappers'", "'layers'")
        data = data["wrappers"]
    if isinstance(data, (str, bytes)) or not isinstance(data, Sequence):
        raise ConfigError(f"{what} must be a list of layer specs (or {{\"layers\": [...]}}), got {type(data).__name__}", field="layers")
    return list(data)


__all__ = [
    "connector_of",
    "LAYERS",
    "LayerSpecs",
    "FaultInjectionLayer",
    "IntegrityLayer",
    "Layer",
    "MetricsLayer",
    "RetryLayer",
    "TimeoutLayer",
    "check_layer_order",
    "find_layer",
    "load_layer_specs",
    "plan_layers",
    "prometheus_text",
    "stack_layers",
]
