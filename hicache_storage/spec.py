"""One way to open a store: a connector, its config and its layers, as one typed, file-loadable spec.

Used alike by the ``hicache-storage`` command, the SGLang adapter, the conformance suite and
the HiCache engine::

    store = open_store({
        "backend": "redis",                      # registered name or "package.module:Class"
        "config": {"url": "redis://127.0.0.1:6379"},
        "layers": [{"kind": "integrity"}, {"kind": "retry", "attempts": 3}],   # innermost first
    })
    store = open_store("@store.yaml")            # the same spec from a json/toml/yaml file

Default layers come from capabilities. ``default_timeout`` asks that every call be bounded: a
timeout layer with that config goes on top **unless the stack already bounds its calls**, that
is, unless its capabilities say ``bounded_calls`` (a connector whose client has socket or request
timeouts of its own, or a timeout among ``layers``). A layer that can stall a call (fault
injection) clears ``bounded_calls``, so the timeout comes back.

The stack builder (:func:`~hicache_storage.layers.stack_layers`) refuses an unsafe order: with a **zero-copy** timeout,
the store may still use the caller's buffers after the caller was told the call timed out, and a
retry or integrity layer above it would reuse those buffers at once (retrying into them, or
returning its trailer slots). Such a stack is a :class:`~hicache_storage.errors.ConfigError`
naming the order to use: ``timeout(retry(integrity(store)))``, retry and integrity below.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pydantic

from hicache_storage.config import BackendConfig, load_config_source
from hicache_storage.errors import ConfigError
from hicache_storage.layers import LayerSpecs, load_layer_specs, stack_layers
from hicache_storage.layers.timeout import TimeoutConfig
from hicache_storage.registry import resolve
from hicache_storage.store import Store


class StoreSpec(BackendConfig):
    """Everything needed to open a store; a mapping, a JSON string or ``@path`` (json, toml, yaml)."""

    backend: str = pydantic.Field(description="registered connector name (memory, file, redis, ...) or 'package.module:Class'")
    config: dict[str, Any] = pydantic.Field(
        default_factory=dict, repr=False, description="the connector's own config (a JSON object string or '@path' is read too)"
    )
    layers: list[dict[str, Any]] = pydantic.Field(
        default_factory=list,
        description='layers, innermost first, e.g. [{"kind": "integrity"}, {"kind": "retry"}] (a JSON string or \'@path\' too)',
    )
    default_timeout: TimeoutConfig | None = pydantic.Field(
        None, description="timeout layer put on top when the stack does not bound its calls itself (capabilities.bounded_calls)"
    )
    capability_overrides: dict[str, Any] = pydantic.Field(
        default_factory=dict, description="capability fields to set on the connector once open (an emulator's declared gaps)"
    )

    def public_dict(self) -> dict[str, Any]:
        """The spec as plain data, the connector's config left out: only the connector's own config
        class knows which of its fields are secrets (an open store's ``describe()`` shows it
        masked)."""
        return {**super().public_dict(), "config": "<see the connector's config>"}

    @pydantic.field_validator("config", mode="before")
    @classmethod
    def _read_config(cls, value: Any) -> Any:
        return load_config_source(value) if isinstance(value, (str, Path)) or value is None else value

    @pydantic.field_validator("layers", mode="before")
    @classmethod
    def _read_layers(cls, value: Any) -> Any:
        return load_layer_specs(value) if isinstance(value, (str, Path)) or value is None else value


def store_spec(
    backend: str,
    config: Mapping[str, Any] | str | Path | None = None,
    layers: LayerSpecs = None,
    **fields: Any,
) -> StoreSpec:
    """A :class:`StoreSpec` from its parts, each in any form the spec accepts (mapping, JSON, ``@path``)."""
    return StoreSpec.parse({"backend": backend, "config": config, "layers": layers, **fields}, backend="store spec")


def open_store(spec: StoreSpec | Mapping[str, Any] | str | Path) -> Store:
    """Open the connector ``spec`` names with its config, set its capability overrides, and put it
    under its layers (:func:`~hicache_storage.layers.stack_layers`); returns the
    :class:`~hicache_storage.store.Store` over that stack. On any error nothing stays open."""
    spec = StoreSpec.parse(spec, backend="store spec")
    connector = resolve(spec.backend)(spec.config)
    try:
        if spec.capability_overrides:
            try:
                connector.capabilities = connector.capabilities.replace(**spec.capability_overrides)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"capability_overrides: {exc}", field="capability_overrides", backend=spec.backend) from None
        return Store(stack_layers(connector, spec.layers, default_timeout=spec.default_timeout))
    except BaseException:
        connector.close()
        raise
