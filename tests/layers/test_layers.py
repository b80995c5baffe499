"""The layer base (forwarding, names, stats, errors) and stack_layers(), the config entry point."""

import json

import pytest

from hicache_storage.buffers import Segments
from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.errors import (
    BackendContractError,
    BackendUnavailableError,
    ConfigError,
    InvalidArgumentError,
)
from hicache_storage.keys import KeyScope, Namespace, PageKey
from hicache_storage.layers import (
    LAYERS,
    Layer,
    IntegrityLayer,
    MetricsLayer,
    RetryLayer,
    TimeoutLayer,
    connector_of,
    find_layer,
    stack_layers,
)
from hicache_storage.store import Store

NAMESPACE = Namespace(model="layer-tests", kv_dtype="bfloat16", page_size=16)
SCOPE = KeyScope(NAMESPACE)


def keys(n: int, start: int = 0) -> list[PageKey]:
    return SCOPE.keys([f"{i:016x}" for i in range(start, start + n)])


class RecordingMemory(MemoryBackend):
    """The memory connector, noting which hooks were reached."""

    capabilities = MemoryBackend.capabilities.replace(buffer_registration=True)

    def __init__(self, config=None):
        super().__init__(config)
        self.calls: list[str] = []

    def _exists(self, keys):
        self.calls.append("exists")
        return super()._exists(keys)

    def _get_into(self, keys, targets):
        self.calls.append("get")
        return super()._get_into(keys, targets)

    def _put_from(self, keys, sources):
        self.calls.append("put")
        return super()._put_from(keys, sources)

    def _delete(self, keys):
        self.calls.append("delete")
        return super()._delete(keys)

    def _clear(self, namespace):
        self.calls.append("clear")
        super()._clear(namespace)

    def _register_buffer(self, view):
        self.calls.append("register_buffer")

    def _close(self):
        self.calls.append("close")


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_every_layer_forwards_every_operation(kind):
    inner = RecordingMemory()
    store = Store(stack_layers(inner, [{"kind": kind}]))
    page = [b"a" * 64]
    assert store.put(keys(1), page) == [True]
    assert store.exists(keys(2)) == [True, False]
    assert store.get(keys(1), 64) == page
    store.register_buffer(bytearray(128))
    assert store.delete(keys(1)) == [True]
    store.clear(NAMESPACE)
    store.close()
    expected = {"exists", "get", "put", "delete", "clear", "register_buffer", "close"}
    if kind == "timeout":  # reads and writes go through staging buffers: registering caller memory is useless
        expected.remove("register_buffer")
    assert store.capabilities.buffer_registration == (kind != "timeout")
    assert expected <= set(inner.calls)
    assert inner.closed


def test_name_shows_the_chain_innermost_first():
    inner = MemoryBackend()
    store = stack_layers(inner, [{"kind": "integrity"}, {"kind": "timeout"}, {"kind": "metrics"}])
    assert store.name == "metrics(timeout(integrity(memory)))"
    assert [layer.name for layer in store.levels()] == [
        "metrics(timeout(integrity(memory)))",
        "timeout(integrity(memory))",
        "integrity(memory)",
        "memory",
    ]
    assert connector_of(store) is inner
    assert connector_of(inner) is inner
    assert isinstance(find_layer(store, TimeoutLayer), TimeoutLayer)
    assert find_layer(store, RetryLayer) is None
    assert "inner=<MemoryBackend" in repr(store)
    store.close()


def test_capabilities_come_from_the_inner_backend():
    inner = MemoryBackend({"capacity_bytes": 10_000})
    inner.capabilities = inner.capabilities.replace(max_batch=5)
    layer = RetryLayer(inner)
    assert layer.capabilities == inner.capabilities
    store = Store(layer)
    # Batches are split to the inner's limit before any inner hook sees them (a put writes the
    # last chunk first, so the head of a prefix is the most recent: test_backend_contract.py).
    seen = []
    original = inner._put_from
    inner._put_from = lambda ks, srcs: seen.append(len(ks)) or original(ks, srcs)
    assert store.put(keys(12), [b"x"] * 12) == [True] * 12
    assert seen == [2, 5, 5]


def test_inner_errors_name_the_inner_backend():
    class Down(MemoryBackend):
        def _exists(self, keys):
            raise BackendUnavailableError("connection refused")

    store = Store(MetricsLayer(Down()))
    with pytest.raises(BackendUnavailableError) as caught:
        store.exists(keys(1))
    assert caught.value.backend == "memory"
    assert caught.value.operation == "exists"


@pytest.mark.parametrize("results", [[True], [True, True, True], [True, 1]], ids=["short", "long", "non-bool"])
def test_an_inner_breaking_the_result_contract_is_caught(results):
    class Liar(MemoryBackend):
        def _exists(self, keys):
            return results

    # Integrity post-processes results per key: it must not hide a wrong count by zipping.
    store = Store(IntegrityLayer(Liar(), {"verify_exists": True}))
    with pytest.raises(BackendContractError) as caught:
        store.exists(keys(2))
    assert caught.value.backend == "memory"


def test_closed_inner_is_refused_through_the_layer():
    inner = MemoryBackend()
    store = Store(RetryLayer(inner))
    inner.close()
    with pytest.raises(Exception, match="closed"):
        store.exists(keys(1))


def test_wrapping_something_that_is_not_a_backend_is_refused():
    with pytest.raises(InvalidArgumentError, match="goes over a connector or another layer"):
        RetryLayer({"kind": "memory"})


def test_stats_show_every_layers_counters():
    store = Store(stack_layers(MemoryBackend(), [{"kind": "integrity"}, {"kind": "timeout"}, {"kind": "retry"}]))
    stats = store.stats()
    for name in ("integrity_miss_checksum", "timeouts", "retries", "get_calls"):
        assert name in stats
    store.close()


# --- stack_layers() ---------------------------------------------------------------------------------------


SPECS = [{"kind": "retry", "attempts": 2}, {"kind": "metrics", "label": "l3"}]


def test_wrap_applies_specs_innermost_first():
    store = stack_layers(MemoryBackend(), SPECS)
    assert isinstance(store, MetricsLayer) and isinstance(store.inner, RetryLayer)
    assert store.inner.config.attempts == 2
    assert store.label == "l3"


def test_wrap_with_nothing_returns_the_backend_itself():
    inner = MemoryBackend()
    assert stack_layers(inner, None) is inner
    assert stack_layers(inner, []) is inner
    assert stack_layers(inner, "") is inner


def test_wrap_accepts_a_json_string():
    store = stack_layers(MemoryBackend(), json.dumps(SPECS))
    assert store.name == "metrics(retry(memory))"


@pytest.mark.parametrize(
    ("suffix", "text"),
    [
        (".json", json.dumps(SPECS)),
        (".json", json.dumps({"layers": SPECS})),
        (".yaml", "- kind: retry\n  attempts: 2\n- kind: metrics\n  label: l3\n"),
        (".toml", '[[layers]]\nkind = "retry"\nattempts = 2\n\n[[layers]]\nkind = "metrics"\nlabel = "l3"\n'),
    ],
    ids=["json-list", "json-object", "yaml", "toml"],
)
def test_wrap_reads_a_file(tmp_path, suffix, text):
    path = tmp_path / f"layers{suffix}"
    path.write_text(text)
    store = stack_layers(MemoryBackend(), f"@{path}")
    assert store.name == "metrics(retry(memory))"
    assert store.inner.config.attempts == 2


def test_unknown_kind_lists_the_valid_ones():
    with pytest.raises(ConfigError) as caught:
        stack_layers(MemoryBackend(), [{"kind": "retry"}, {"kind": "compress"}])
    message = str(caught.value)
    assert "layer spec #1" in message and "'compress'" in message
    for kind in LAYERS:
        assert kind in message
    assert caught.value.field == "layer spec #1.kind"


def test_missing_kind_is_reported():
    with pytest.raises(ConfigError, match="no 'kind'; valid kinds"):
        stack_layers(MemoryBackend(), [{"seconds": 1}])


def test_unknown_key_lists_the_valid_ones():
    with pytest.raises(ConfigError) as caught:
        stack_layers(MemoryBackend(), [{"kind": "timeout", "second": 1}])
    message = str(caught.value)
    assert "layer spec #0 (timeout)" in message and "'second'" in message
    assert "valid keys: clear_seconds, max_abandoned, seconds, staging_cache_bytes, workers, zero_copy" in message
    assert caught.value.field == "layer spec #0.second"


def test_bad_value_names_field_value_and_rule():
    with pytest.raises(ConfigError) as caught:
        stack_layers(MemoryBackend(), [{"kind": "retry", "attempts": 0}])
    assert "attempts=0" in str(caught.value)
    assert "greater than or equal to 1" in str(caught.value)


@pytest.mark.parametrize(
    ("specs", "match"),
    [
        ("{not json", "not valid JSON"),
        ('{"kind": "retry"}', "must be a list"),
        ([["retry"]], "must be an object"),
        ("@/nonexistent/layers.json", "cannot read layer file"),
        ("@layers.ini", "must end in"),
    ],
)
def test_malformed_specs_raise_config_errors(specs, match):
    with pytest.raises(ConfigError, match=match):
        stack_layers(MemoryBackend(), specs)


def test_nothing_is_wrapped_when_a_later_spec_is_bad():
    inner = MemoryBackend()
    with pytest.raises(ConfigError):
        stack_layers(inner, [{"kind": "timeout"}, {"kind": "retry", "bogus": 1}])
    assert not inner.closed
    assert stack_layers(inner, [{"kind": "timeout"}]).inner is inner


def test_every_layer_kind_is_a_layer():
    for cls in LAYERS.values():
        assert issubclass(cls, Layer)
        assert cls.Config.__name__.endswith("Config")


def test_segments_reach_the_inner_unchanged_through_pass_through_layers():
    """Zero-copy layers hand the caller's own memory to the connector."""
    seen: list[Segments] = []

    class Spy(MemoryBackend):
        def _get_into(self, keys, targets):
            seen.extend(targets)
            return super()._get_into(keys, targets)

    store = Store(stack_layers(Spy(), [{"kind": "retry"}, {"kind": "metrics"}]))
    store.put(keys(1), [b"z" * 32])
    target = bytearray(32)
    assert store.get_into(keys(1), [target]) == [True]
    assert seen[0][0].obj is target


def test_counters_of_stacked_layers_of_one_kind_add_up():
    top = stack_layers(MemoryBackend(), [{"kind": "faults", "exists": {"error_rate": 1.0}}, {"kind": "retry", "attempts": 2, "base_seconds": 0.0001}])
    store = Store(stack_layers(top, [{"kind": "retry", "attempts": 3, "base_seconds": 0.0001}]))
    with pytest.raises(BackendUnavailableError):
        store.exists(keys(1))
    # The inner retry tries twice (1 retry), gives up and marks the error persistent, which the
    # outer retry does not retry again: the counters of both layers add up to that one retry.
    assert store.stats()["retries"] == 1
    assert store.stats()["faults_error"] == 2
