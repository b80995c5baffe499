"""The stack as a whole: live capabilities through every layer, the opening spec, default layers
from capabilities, the zero-copy order rule, and levels that reach each other only through the
layer interface."""

import ast
import json
from pathlib import Path

import pytest

from hicache_storage import ConfigError, KeyScope, Namespace, Store, StoreSpec, open_store
from hicache_storage.cli import main as cli_main
from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.layers import MetricsLayer, TimeoutLayer, find_layer, stack_layers

ROOT = Path(__file__).resolve().parents[2]
SCOPE = KeyScope(Namespace(model="stack-tests", kv_dtype="bfloat16", page_size=16))
EVERY_KIND = [
    {"kind": "faults", "seed": 1},
    {"kind": "integrity"},
    {"kind": "timeout", "seconds": 60},
    {"kind": "retry", "attempts": 2},
    {"kind": "metrics"},
]


class SizesSlotsOnFirstPut(MemoryBackend):
    """Learns its slot size from its first put and declares it then, as the hf3fs connector does."""

    def _put_from(self, keys, sources):
        if self.capabilities.max_value_size is None:
            self.capabilities = self.capabilities.replace(max_value_size=4096, max_batch=3)
        return super()._put_from(keys, sources)


def test_a_capability_changed_after_opening_is_seen_through_every_layer():
    connector = SizesSlotsOnFirstPut()
    store = Store(stack_layers(connector, EVERY_KIND))
    levels = store.levels()
    assert [getattr(level, "kind", "connector") for level in levels] == ["metrics", "retry", "timeout", "integrity", "faults", "connector"]
    assert all(level.capabilities.max_value_size is None for level in levels)

    assert store.put([SCOPE.key("ab" * 32)], [b"x" * 100]) == [True]

    trailer = 48  # the integrity layer's, taken from the limit by every level above it
    assert [level.capabilities.max_value_size for level in levels] == [4096 - trailer] * 4 + [4096] * 2
    assert all(level.capabilities.max_batch == 3 for level in levels)
    described = store.describe()
    assert described["capabilities"]["max_value_size"] == 4096 - trailer
    assert [level["capabilities"]["max_batch"] for level in described["levels"]] == [3] * 6
    with pytest.raises(Exception, match="max_value_size of 4048 bytes"):
        store.put([SCOPE.key("cd" * 32)], [b"y" * 4096])
    store.close()


def test_a_capability_changed_after_opening_is_seen_by_the_facade_split():
    connector = SizesSlotsOnFirstPut()
    store = Store(stack_layers(connector, [{"kind": "metrics"}]))
    keys = SCOPE.keys([f"{i:064x}" for i in range(8)])
    store.put(keys[:1], [b"a"])  # the connector now declares max_batch=3
    metrics = find_layer(store, MetricsLayer)
    before = metrics.snapshot()["operations"]["exists"]["calls"]
    assert store.exists(keys) == [True] + [False] * 7
    assert metrics.snapshot()["operations"]["exists"]["calls"] - before == 3  # 8 keys in batches of 3
    store.close()


def test_describe_shows_what_an_instance_declares_once_open(capsys):
    """`list` shows the class's declaration; `describe` an open instance's, layers included."""
    spec = json.dumps({"backend": "memory", "config": {"capacity_bytes": 2**20}, "layers": [{"kind": "integrity"}]})
    assert cli_main(["describe", spec]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["name"] == "integrity(memory)"
    [integrity, memory] = described["levels"]
    assert memory["capabilities"]["evicts"] is True and memory["capabilities"]["capacity_bytes"] == 2**20
    assert integrity["capabilities"]["max_value_size"] == 2**20 - 48
    assert cli_main(["list", "--json"]) == 0
    [listed] = [b for b in json.loads(capsys.readouterr().out) if b["name"] == "memory"]
    assert listed["capabilities"]["evicts"] is False


@pytest.mark.parametrize("suffix", ["json", "yaml", "toml"])
def test_a_store_spec_loads_from_a_file(tmp_path, suffix):
    spec = {"backend": "memory", "config": {"store": f"spec-{suffix}"}, "layers": [{"kind": "integrity"}, {"kind": "metrics"}]}
    path = tmp_path / f"store.{suffix}"
    if suffix == "json":
        path.write_text(json.dumps(spec))
    elif suffix == "yaml":
        path.write_text("backend: memory\nconfig: {store: spec-yaml}\nlayers:\n  - kind: integrity\n  - kind: metrics\n")
    else:
        path.write_text('backend = "memory"\nconfig = {store = "spec-toml"}\n[[layers]]\nkind = "integrity"\n[[layers]]\nkind = "metrics"\n')
    assert StoreSpec.parse(f"@{path}") == StoreSpec.parse(spec)
    with open_store(f"@{path}") as store:
        assert store.name == "metrics(integrity(memory))"
        assert store.put([SCOPE.key("ef" * 32)], [b"z" * 10]) == [True]


def test_a_bad_spec_names_what_is_wrong():
    with pytest.raises(ConfigError, match="unknown config key 'layer'"):
        StoreSpec.parse({"backend": "memory", "layer": []})
    with pytest.raises(ConfigError, match="layer spec #0 has unknown kind 'compress'"):
        open_store({"backend": "memory", "layers": [{"kind": "compress"}]})
    with pytest.raises(ConfigError, match="capability_overrides"):
        open_store({"backend": "memory", "capability_overrides": {"max_batch": 0}})


class BoundsItsCalls(MemoryBackend):
    capabilities = MemoryBackend.capabilities.replace(bounded_calls=True)


def test_default_timeout_goes_only_on_a_stack_that_does_not_bound_its_calls():
    default = {"seconds": 5, "zero_copy": True}
    unbounded = stack_layers(MemoryBackend(), [], default_timeout=default)
    assert isinstance(unbounded, TimeoutLayer) and unbounded.config.zero_copy
    bounded = BoundsItsCalls()
    assert stack_layers(bounded, [], default_timeout=default) is bounded
    # Fault injection can stall a call: the stack above it no longer bounds its calls.
    stalling = stack_layers(BoundsItsCalls(), [{"kind": "faults"}], default_timeout=default)
    assert isinstance(stalling, TimeoutLayer) and stalling.inner.kind == "faults"
    # A timeout among the layers bounds the stack: no second one.
    asked = stack_layers(MemoryBackend(), [{"kind": "timeout", "seconds": 1}], default_timeout=default)
    assert asked.kind == "timeout" and isinstance(asked.inner, MemoryBackend)
    for store in (unbounded, bounded, stalling, asked):
        store.close()


def test_builtin_network_connectors_declare_bounded_calls():
    from hicache_storage.registry import resolve

    assert all(resolve(name).capabilities.bounded_calls for name in ("redis", "s3"))
    # Mooncake's client waited far past the engine's bound with its master frozen (the fault matrix).
    assert not any(resolve(name).capabilities.bounded_calls for name in ("memory", "file", "hf3fs", "fsspec", "mooncake"))


@pytest.mark.parametrize("above", ["retry", "integrity"])
def test_retry_and_integrity_are_refused_above_a_zero_copy_timeout(above):
    zero_copy = {"kind": "timeout", "seconds": 5, "zero_copy": True}
    connector = MemoryBackend()
    with pytest.raises(ConfigError, match=r"timeout\(retry\(integrity\(store\)\)\)") as caught:
        stack_layers(connector, [zero_copy, {"kind": above}])
    assert f"{above} > timeout" in str(caught.value) and not connector.closed
    with pytest.raises(ConfigError, match="zero-copy timeout"):
        open_store({"backend": "memory", "layers": [zero_copy, {"kind": above}]})
    # Onto a stack that already holds a zero-copy timeout, too.
    with pytest.raises(ConfigError, match="zero-copy timeout"):
        stack_layers(TimeoutLayer(MemoryBackend(), {"zero_copy": True}), [{"kind": above}])
    # Below it, or above a staging timeout, the order is safe.
    stack_layers(MemoryBackend(), [{"kind": above}, zero_copy]).close()
    stack_layers(MemoryBackend(), [{"kind": "timeout", "seconds": 5}, {"kind": above}]).close()


def test_capability_overrides_reach_every_layer():
    with open_store({"backend": "memory", "layers": EVERY_KIND, "capability_overrides": {"max_batch": 5}}) as store:
        assert [level.capabilities.max_batch for level in store.levels()] == [5] * 6


HOOKS = {"_exists", "_get_into", "_put_from", "_delete", "_clear", "_register_buffer", "_close", "_check_open"}


def test_no_module_calls_another_objects_underscore_hooks():
    """Levels reach each other through the public layer interface (hook_*), never through another
    object's underscore hooks; a level calls its own (self, super()) only."""
    offenders = []
    for package in ("hicache_storage", "connectors", "conformance", "hicache_core", "kernels"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in HOOKS:
                    owner = node.func.value
                    own = (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) or (
                        isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
                    )
                    if not own:
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node.func)}")
    assert offenders == []


def test_the_engine_opens_its_store_from_backend_config_and_layers():
    """EngineConfig names layers; the controller then bounds the stack with its zero-copy timeout
    on top, where retry and integrity are safe."""
    from dataclasses import replace

    from hicache_core.engine import Engine
    from hicache_core.soak import CacheTiers, tiny_engine_config

    config = replace(
        tiny_engine_config(CacheTiers.L1_L2_L3, 5.0),
        storage_backend="memory",
        storage_layers=[{"kind": "integrity"}, {"kind": "retry", "attempts": 2}],
    )
    with Engine(config) as engine:
        storage = engine.controller.storage
        assert storage.name == "timeout(retry(integrity(memory)))"
        assert storage.top.config.zero_copy and storage.capabilities.bounded_calls


def test_a_store_spec_never_shows_the_connector_config():
    """Only the connector's config class knows its secret fields; the spec shows none of it."""
    spec = StoreSpec.parse({"backend": "s3", "config": {"secret_access_key": "hunter2"}})
    for shown in (str(spec), repr(spec), json.dumps(spec.public_dict())):
        assert "hunter2" not in shown
