"""Typed connector configuration, read from a dict, a JSON string or ``@path`` (json, toml, yaml).

Every connector declares a :class:`BackendConfig` subclass: fields with types, defaults and
descriptions. Unknown keys are rejected with the list of valid ones; a bad value is reported with
its field, the value given and what is allowed. Secrets are ``pydantic.SecretStr`` so that reprs,
logs and reports never show them.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

from hicache_storage.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

C = TypeVar("C", bound="BackendConfig")


class BackendConfig(pydantic.BaseModel):
    """Base of every connector config. Immutable once built."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @classmethod
    def parse(cls: type[C], value: BackendConfig | Mapping[str, Any] | str | Path | None, *, backend: str | None = None) -> C:
        """Build a config from a config object, a mapping, a JSON string or ``@path``; ``None`` gives the defaults."""
        if isinstance(value, cls):
            return value
        if isinstance(value, BackendConfig):
            raise ConfigError(
                f"expected a {cls.__name__}, got a {type(value).__name__}", backend=backend
            )
        data = load_config_source(value)
        unknown = sorted(set(data) - set(cls.model_fields))
        if unknown:
            valid = ", ".join(sorted(cls.model_fields)) or "(none)"
            raise ConfigError(
                f"unknown config key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                f"for {cls.__name__}; valid keys: {valid}",
                field=unknown[0],
                backend=backend,
            )
        try:
            return cls.model_validate(data)
        except pydantic.ValidationError as exc:
            raise _config_error(cls, exc, backend) from None

    def public_dict(self) -> dict[str, Any]:
        """The config as plain data with secrets masked, for reports and logs."""
        return json.loads(self.model_dump_json())

    def __str__(self) -> str:
        return f"{type(self).__name__}({json.dumps(self.public_dict(), sort_keys=True)})"


_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])i?)?b?\s*", re.IGNORECASE)
_SIZE_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``"4gb"``, ``"512 MB"``, ``"16MiB"``, ``"64K"``, ``"1.5M"``.

    Units are powers of 1024, with or without ``i`` and ``b``, in any case; a fraction is rounded to
    whole bytes. Raises ``ValueError`` (a config validator turns it into a ``ConfigError``).
    """
    if isinstance(value, bool):
        raise ValueError("a size must be an integer or a string such as '4gb'")
    if isinstance(value, int):
        return value
    match = _SIZE_RE.fullmatch(str(value))
    if match is None:
        raise ValueError(f"cannot read {value!r} as a size; use bytes or a string such as '4gb', '512MB' or '64K'")
    number, unit = match.groups()
    scale = _SIZE_UNITS[unit.lower()] if unit else 1
    return int(number) * scale if number.isdigit() else round(float(number) * scale)


def load_config_source(value: Mapping[str, Any] | str | Path | None) -> dict[str, Any]:
    """A mapping from ``None``, a mapping, a JSON object string, or ``@path`` to a json/toml/yaml file."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, Path):
        return _load_file(value)
    if not isinstance(value, str):
        raise ConfigError(f"a config must be a mapping, a JSON string or '@path'; got {type(value).__name__}")
    text = value.strip()
    if text.startswith("@"):
        return _load_file(Path(text[1:]).expanduser())
    if not text:
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"config string is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
            "pass a JSON object such as '{\"root\": \"/tmp/kv\"}' or '@path/to/config.toml'"
        ) from None
    return _require_mapping(data, "the JSON config")


def _load_file(path: Path) -> dict[str, Any]:
    data = read_config_file(path)
    return _require_mapping({} if data is None else data, f"config file {str(path)!r}")


def read_config_file(path: Path, what: str = "config file", field: str | None = None) -> Any:
    """The data in a .json, .toml, .yaml or .yml file, by its suffix (``None`` for an empty YAML file).

    Every failure (another suffix, an unreadable file, bad syntax) is a :class:`ConfigError` that
    names ``what`` and the path, with ``field`` set to ``field``.
    """
    suffix = path.suffix.lower()
    if suffix not in (".json", ".toml", ".yaml", ".yml"):
        raise ConfigError(f"{what} {str(path)!r} must end in .json, .toml, .yaml or .yml", field=field)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {str(path)!r}: {exc.strerror}", field=field) from None
    try:
        if suffix == ".json":
            return json.loads(raw)
        if suffix == ".toml":
            return tomllib.loads(raw.decode())
        return yaml.safe_load(raw)  # safe_load: a config file can never construct objects
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"{what} {str(path)!r} is not valid {suffix[1:]}: {exc}", field=field) from None


def _require_mapping(data: object, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must hold an object of key/value pairs, got {type(data).__name__}")
    return data


def _config_error(cls: type[BackendConfig], exc: pydantic.ValidationError, backend: str | None) -> ConfigError:
    problems = []
    first_field = None
    for error in exc.errors(include_url=False):
        field = ".".join(str(part) for part in error["loc"]) or "(config)"
        first_field = first_field or field
        info = cls.model_fields.get(str(error["loc"][0])) if error["loc"] else None
        if not error["loc"]:
            shown = "<the whole config>"  # a model-level check: its input is every field, secrets too
        elif info is not None and _is_secret(info):
            shown = "<secret>"
        else:
            shown = repr(error.get("input"))
        allowed = f" ({info.description})" if info is not None and info.description else ""
        problems.append(f"{field}={shown}: {error['msg']}{allowed}")
    return ConfigError(f"invalid {cls.__name__}: " + "; ".join(problems), field=first_field, backend=backend)


def _is_secret(info: pydantic.fields.FieldInfo) -> bool:
    return "Secret" in repr(info.annotation)
