"""The Redis backend's configuration: the URL (parsed, and stripped of any password) and its settings.

A password given in the URL is moved into the ``password`` field (a ``SecretStr``) before any
other check runs, so ``repr``, logs and error messages never show it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import pydantic

from hicache_storage.config import BackendConfig

#: Redis' own limit on one value (``proto-max-bulk-len``), unless the server is configured lower.
REDIS_MAX_BULK_LEN = 512 * 1024 * 1024
_SCHEMES = ("redis", "rediss", "unix")
# No glob characters (clear() builds a SCAN pattern from it) and no braces (a hash tag).
_PREFIX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: The ``:password@`` of a URL's userinfo, to mask in any text that may echo a URL.
USERINFO_RE = re.compile(r"(//[^/@?#]*?):[^/@?#]*@")


@dataclass(frozen=True)
class RedisEndpoint:
    """Where a URL points, without credentials."""

    scheme: str
    host: str | None
    port: int | None
    path: str | None  # the socket file, for unix://
    db: int
    username: str | None

    @property
    def address(self) -> str:
        """``host:port`` (``[v6]:port``) or ``unix:///path``: how messages name the server."""
        if self.scheme == "unix":
            return f"unix://{self.path}"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_redis_url(url: str) -> RedisEndpoint:
    """Parse a password-free Redis URL; ``ValueError`` says what is wrong with it."""
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ValueError("url is malformed; expected redis://host:port/db, rediss://host:port/db or unix:///path?db=N") from None
    try:
        port = parts.port
    except ValueError:
        raise ValueError("the url's port must be a number from 1 to 65535") from None
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(f"url scheme must be one of {', '.join(s + '://' for s in _SCHEMES)}; got {parts.scheme or '(none)'!r}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    if parts.password is not None or any(name == "password" for name, _ in query):
        raise ValueError("the password is given twice; put it either in the url or in the 'password' field")
    unknown = sorted({name for name, _ in query} - {"db"})
    if unknown:
        raise ValueError(
            f"unsupported url query parameter(s) {', '.join(unknown)}; only 'db' is read from the url, "
            "set timeouts, TLS and pool size as config fields"
        )
    db_texts = [value for name, value in query if name == "db"]
    if scheme == "unix":
        path = unquote(parts.path)
        if not path:
            raise ValueError("a unix:// url needs the socket path, as in unix:///run/redis.sock?db=0")
        host = None
    else:
        host, path = parts.hostname, None
        if not host:
            raise ValueError(f"url has no host; expected {scheme}://host:port/db")
        port = port or 6379
        if parts.path.strip("/"):
            db_texts.append(parts.path.strip("/"))
    if len(set(db_texts)) > 1:
        raise ValueError(f"url names the database twice with different values: {', '.join(db_texts)}")
    db_text = db_texts[0] if db_texts else "0"
    if not db_text.isdigit():
        raise ValueError(f"the database must be a non-negative integer, got {db_text!r}")
    username = unquote(parts.username or "") or None
    return RedisEndpoint(scheme, host, port if scheme != "unix" else None, path, int(db_text), username)


def _split_password(url: str) -> tuple[str, list[str]]:
    """The URL without any password (from userinfo or the query string), and the passwords found."""
    try:
        parts = urlsplit(url)
        userinfo_password = parts.password
    except ValueError:
        return USERINFO_RE.sub(r"\1:***@", url), []
    query = parse_qsl(parts.query, keep_blank_values=True)
    found = ([unquote(userinfo_password)] if userinfo_password is not None else []) + [
        value for name, value in query if name == "password"
    ]
    if not found:
        return url, []
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    netloc = f"{user}@{hostport}" if user else hostport
    rest = "&".join(f"{name}={value}" for name, value in query if name != "password")
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{rest}" if rest else ""), found


class RedisConfig(BackendConfig):
    """Settings of the Redis backend: the server or cluster, key prefix, TTL, limits, timeouts, TLS."""

    url: str = pydantic.Field(
        "redis://127.0.0.1:6379/0",
        description="redis://[user[:password]@]host:port/db, rediss://... for TLS, or unix:///path/to/socket?db=N",
    )
    password: pydantic.SecretStr | None = pydantic.Field(
        None, description="the server password (or the ACL user's); may also be given in the url"
    )
    cluster: bool = pydantic.Field(False, description="talk to a Redis Cluster through the node in the url")
    startup_nodes: list[str] = pydantic.Field(
        default_factory=list, description="extra cluster nodes as 'host:port' to discover the cluster from; implies cluster"
    )
    prefix: str = pydantic.Field("hicache", description="first component of every key, [A-Za-z0-9][A-Za-z0-9._-]{0,63}")
    ttl_seconds: pydantic.PositiveInt | None = pydantic.Field(
        None, description="expire pages this many seconds after their write; omit to keep them"
    )
    max_value_size: pydantic.PositiveInt = pydantic.Field(
        REDIS_MAX_BULK_LEN, description="largest page in bytes (Redis' proto-max-bulk-len, 512 MiB by default)"
    )
    max_batch: pydantic.PositiveInt = pydantic.Field(256, description="most pages in one pipeline; larger batches are split")
    socket_timeout: pydantic.PositiveFloat = pydantic.Field(5.0, description="seconds to wait for a reply before a call fails")
    connect_timeout: pydantic.PositiveFloat = pydantic.Field(
        2.0, description="seconds to wait for a connection (and for a free one in the pool)"
    )
    retries: pydantic.NonNegativeInt = pydantic.Field(
        1, description="retries of a call on a fresh connection after a connection error or timeout"
    )
    max_connections: pydantic.PositiveInt = pydantic.Field(64, description="connection pool size (per node in a cluster)")
    ssl_ca_certs: str | None = pydantic.Field(None, description="CA bundle file to verify the server with; rediss:// only")

    @pydantic.model_validator(mode="before")
    @classmethod
    def _move_password_out_of_url(cls, data: Any) -> Any:
        # Runs before any other check, so that no error message can echo the password.
        if not isinstance(data, dict) or not isinstance(data.get("url"), str):
            return data
        url, passwords = _split_password(data["url"])
        data = {**data, "url": url}
        if len(passwords) == 1 and data.get("password") is None:
            data["password"] = passwords[0]
        elif passwords:  # given twice: a masked marker makes the url check report it
            data["url"] = url + ("&" if "?" in url else "?") + "password=***"
        return data

    @pydantic.field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        parse_redis_url(url)
        return url

    @pydantic.field_validator("prefix")
    @classmethod
    def _check_prefix(cls, prefix: str) -> str:
        if not _PREFIX_RE.fullmatch(prefix):
            raise ValueError("prefix must be 1-64 characters of [A-Za-z0-9._-], starting with a letter or digit")
        return prefix

    @pydantic.field_validator("startup_nodes")
    @classmethod
    def _check_nodes(cls, nodes: list[str]) -> list[str]:
        for node in nodes:
            host, _, port = node.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"startup node {node!r} must look like 'host:port'")
        return nodes

    # The checks that combine fields are field validators on the later field: an error raised by
    # a whole-model validator would be reported with the raw input, password included.

    @pydantic.field_validator("cluster", "startup_nodes")
    @classmethod
    def _check_cluster_url(cls, value: bool | list[str], info: pydantic.ValidationInfo) -> bool | list[str]:
        url = info.data.get("url")
        if value and url is not None:
            endpoint = parse_redis_url(url)
            if endpoint.scheme == "unix":
                raise ValueError("Redis Cluster cannot be reached over a unix socket; use a redis:// url")
            if endpoint.db != 0:
                raise ValueError(f"Redis Cluster has only database 0; the url names database {endpoint.db}")
        return value

    @pydantic.field_validator("ssl_ca_certs")
    @classmethod
    def _check_tls_url(cls, value: str | None, info: pydantic.ValidationInfo) -> str | None:
        url = info.data.get("url")
        if value is not None and url is not None and parse_redis_url(url).scheme != "rediss":
            raise ValueError("ssl_ca_certs needs a rediss:// url (TLS)")
        return value

    @property
    def is_cluster(self) -> bool:
        """Whether to talk to a Redis Cluster: ``cluster`` set, or startup nodes given."""
        return self.cluster or bool(self.startup_nodes)
