import json

import pydantic
import pytest

from hicache_storage.config import BackendConfig, parse_size
from hicache_storage.connectors.memory import MemoryConfig
from hicache_storage.errors import ConfigError


class SecretConfig(BackendConfig):
    url: str = "redis://127.0.0.1:6379"
    password: pydantic.SecretStr | None = None
    threads: int = pydantic.Field(4, ge=1, le=64, description="I/O threads, 1-64")


def test_defaults_from_none():
    assert MemoryConfig.parse(None) == MemoryConfig()


def test_unknown_keys_are_rejected_with_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        MemoryConfig.parse({"capacity": 10, "stor": "x"})
    message = str(info.value)
    assert "'capacity'" in message and "'stor'" in message
    assert "valid keys: capacity_bytes, store" in message
    assert info.value.field == "capacity"


def test_bad_values_name_the_field_the_value_and_what_is_allowed():
    with pytest.raises(ConfigError) as info:
        SecretConfig.parse({"threads": 0})
    message = str(info.value)
    assert "threads=0" in message and "greater than or equal to 1" in message and "I/O threads, 1-64" in message
    assert info.value.field == "threads"


def test_wrong_type_is_reported():
    with pytest.raises(ConfigError, match="capacity_bytes='lots'"):
        MemoryConfig.parse({"capacity_bytes": "lots"})


def test_json_string(tmp_path):
    assert MemoryConfig.parse('{"store": "shared"}').store == "shared"
    with pytest.raises(ConfigError, match="not valid JSON"):
        MemoryConfig.parse("{store: shared}")
    with pytest.raises(ConfigError, match="object of key/value pairs"):
        MemoryConfig.parse("[1, 2]")


@pytest.mark.parametrize(
    "name, text",
    [
        ("c.json", json.dumps({"store": "s", "capacity_bytes": 1024})),
        ("c.toml", 'store = "s"\ncapacity_bytes = 1024\n'),
        ("c.yaml", "store: s\ncapacity_bytes: 1024\n"),
        ("c.yml", "store: s\ncapacity_bytes: 1024\n"),
    ],
)
def test_at_path_files(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    assert MemoryConfig.parse(f"@{path}") == MemoryConfig(store="s", capacity_bytes=1024)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="must end in"):
        MemoryConfig.parse(f"@{tmp_path / 'c.ini'}")
    with pytest.raises(ConfigError, match="cannot read config file"):
        MemoryConfig.parse(f"@{tmp_path / 'missing.json'}")
    bad = tmp_path / "bad.toml"
    bad.write_text("store = ")
    with pytest.raises(ConfigError, match="not valid toml"):
        MemoryConfig.parse(f"@{bad}")


def test_yaml_cannot_execute_code(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text(f"store: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match="not valid yaml"):
        MemoryConfig.parse(f"@{path}")
    assert not marker.exists()


def test_secrets_never_show(tmp_path):
    config = SecretConfig.parse({"password": "hunter2"})
    assert config.password.get_secret_value() == "hunter2"
    for text in (repr(config), str(config), json.dumps(config.public_dict())):
        assert "hunter2" not in text
    with pytest.raises(ConfigError) as info:
        SecretConfig.parse({"password": 12345678, "threads": 0})
    assert "12345678" not in str(info.value)


def test_configs_are_immutable():
    with pytest.raises(pydantic.ValidationError):
        MemoryConfig().store = "x"


class PairedConfig(BackendConfig):
    user: str | None = None
    password: pydantic.SecretStr | None = None

    @pydantic.model_validator(mode="after")
    def both_or_neither(self):
        if (self.user is None) != (self.password is None):
            raise ValueError("give user and password together")
        return self


def test_model_level_errors_do_not_echo_the_input():
    with pytest.raises(ConfigError) as info:
        PairedConfig.parse({"password": "hunter2"})
    assert "give user and password together" in str(info.value)
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "size"),
    [("0", 0), ("512MB", 512 * 2**20), ("4gb", 4 * 2**30), ("16 MiB", 16 * 2**20), ("1k", 1024), ("64K", 2**16), ("1.5M", 3 * 2**19), (7, 7)],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["12Q", "", "k", "-3", "1.2.3", True])
def test_parse_size_refuses_what_is_not_a_size(text):
    with pytest.raises(ValueError):
        parse_size(text)
