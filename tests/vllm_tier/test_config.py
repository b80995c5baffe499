"""The connector's config: every mistake is a ConfigError that says what was wrong and how to fix it."""

from __future__ import annotations

import pytest

from hicache_storage.errors import ConfigError
from hicache_storage.vllm.config import VllmConnectorConfig


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        (None, ["'connector'", "kv_connector_extra_config"]),
        ({"connector_config": {"root": "/tmp/kv"}}, ["'connector'"]),
        ({"connector": "file", "wrappers": [{"kind": "integrity"}]}, ["'wrappers'", "'layers'"]),
        ({"connector": "file", "tennant": "a"}, ["'tennant'", "tenant"]),
        ({"connector": "file", "breaker": {"failures_to_open": 0}}, ["breaker", "failures_to_open"]),
        ({"connector": "file", "timeout_s": 0}, ["timeout_s"]),
    ],
)
def test_bad_config_names_the_mistake(extra: dict | None, names: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        VllmConnectorConfig.from_extra_config(extra).breaker_config()
    for name in names:
        assert name in str(caught.value)


def test_store_spec_carries_layers_and_a_timeout() -> None:
    config = VllmConnectorConfig.from_extra_config(
        {"connector": "file", "connector_config": {"root": "/tmp/kv"}, "layers": [{"kind": "integrity"}], "timeout_s": 2}
    )
    spec = config.store_spec()
    assert (spec.backend, spec.config, spec.layers) == ("file", {"root": "/tmp/kv"}, [{"kind": "integrity"}])
    assert spec.default_timeout is not None and spec.default_timeout.seconds == 2
    no_timeout = VllmConnectorConfig.from_extra_config({"connector": "memory", "timeout_s": None}).store_spec()
    assert no_timeout.default_timeout is None


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--experiment", "branch-backup"], "--experiment"),
        (["--tiers", "L1"], "--tiers"),
        (["--page-size", "48"], "--page-size"),
        (["--dtype", "float16"], "--dtype"),
        (["--config", "{}"], "--backend"),
    ],
)
def test_bench_engine_vllm_refuses_what_it_cannot_run(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each bad option is one line and exit status 2, before any engine starts."""
    from hicache_storage.cli import main

    assert main(["bench", "--engine", "vllm", *argv]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1, err
