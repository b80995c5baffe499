"""The connector's part of vLLM's ``kv_connector_extra_config``: which store, and how to key it.

Imports nothing of vLLM, so a config can be checked (and its errors read) anywhere.
"""

from __future__ import annotations

from typing import Any

import pydantic

from hicache_storage.config import BackendConfig
from hicache_storage.errors import ConfigError
from hicache_storage.health import BreakerConfig
from hicache_storage.spec import StoreSpec, store_spec

#: The name errors give for this config.
WHERE = "vllm-connector"
#: ... and for the same config as a secondary tier of vLLM's CPU offloading.
TIER_WHERE = "vllm-tier"


class VllmConnectorConfig(BackendConfig):
    """``kv_connector_extra_config`` of :class:`~hicache_storage.vllm.connector.HiCacheStorageConnector`."""

    connector: str = pydantic.Field(description="registered connector name (memory, file, redis, ...) or 'package.module:Class'")
    connector_config: dict[str, Any] = pydantic.Field(default_factory=dict, description="the connector's own config")
    layers: list[dict[str, Any]] = pydantic.Field(
        default_factory=list,
        description='layers, innermost first, e.g. [{"kind": "integrity"}, {"kind": "retry", "attempts": 2}]',
    )
    tenant: str | None = pydantic.Field(None, description="cache salt of the deployment: different tenants never share pages")
    revision: str | None = pydantic.Field(None, description="model weights revision for keys; defaults to vLLM's --revision")
    model: str | None = pydantic.Field(None, description="model identity for keys; defaults to vLLM's served model name")
    breaker: dict[str, Any] = pydantic.Field(
        default_factory=dict,
        description="store health: failures_to_open, probe_backoff_s, probe_backoff_max_s (hicache_storage.health.BreakerConfig)",
    )
    timeout_s: float | None = pydantic.Field(
        5.0,
        gt=0,
        description="longest wait for one store call: a timeout layer on top unless the stack bounds its calls itself "
        "(redis, s3, or a timeout among 'layers'); null for none. vLLM's scheduler waits on lookups, so keep it short",
    )

    @classmethod
    def from_extra_config(cls, extra_config: dict[str, Any] | None) -> VllmConnectorConfig:
        return cls._from_mapping(extra_config, owner="HiCacheStorageConnector", place="kv_connector_extra_config", where=WHERE)

    @classmethod
    def from_tier_config(cls, tier_config: dict[str, Any] | None) -> VllmConnectorConfig:
        """The same keys, given in a ``secondary_tiers`` entry of vLLM's ``TieringOffloadingSpec``
        (:mod:`hicache_storage.vllm.tier`), less what vLLM's tier factory consumes itself."""
        return cls._from_mapping(tier_config, owner="HiCacheStorageTier", place="its secondary_tiers entry", where=TIER_WHERE)

    @classmethod
    def _from_mapping(cls, given_config: dict[str, Any] | None, *, owner: str, place: str, where: str) -> VllmConnectorConfig:
        given = dict(given_config or {})
        if "connector" not in given:
            raise ConfigError(
                f"{owner} needs 'connector' in {place} "
                '(e.g. "connector": "file", "connector_config": {"root": "/mnt/nvme/kv"})',
                field="connector",
                backend=where,
            )
        if "wrappers" in given:
            raise ConfigError(
                f"{place} has 'wrappers'; the vLLM connector calls them 'layers' "
                '(e.g. "layers": [{"kind": "integrity"}])',
                field="wrappers",
                backend=where,
            )
        return cls.parse(given, backend=where)

    def store_spec(self) -> StoreSpec:
        """The store the connector opens in each of vLLM's processes (scheduler and every worker)."""
        timeout = None if self.timeout_s is None else {"seconds": self.timeout_s}
        return store_spec(self.connector, self.connector_config, self.layers, default_timeout=timeout)

    def breaker_config(self) -> BreakerConfig:
        try:
            return BreakerConfig(**self.breaker)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"bad 'breaker' in kv_connector_extra_config ({exc}); its keys are failures_to_open, "
                "probe_backoff_s, probe_backoff_max_s",
                field="breaker",
                backend=WHERE,
            ) from exc
