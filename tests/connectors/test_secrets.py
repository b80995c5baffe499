"""Credentials never leak: not in reprs, configs, stats, logs, exception chains or reports.

For every connector that takes credentials, a backend is used with the right secret and refused
with a wrong one, while everything it says is captured: each capture must be free of both secrets.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from hicache_storage import AuthenticationError, KeyScope, Namespace, Store, create_backend
from hicache_storage.testing.redis_server import RedisServer

RIGHT = "s3cr3t-Right-7a1f"
WRONG = "s3cr3t-Wrong-93bd"
SCOPE = KeyScope(Namespace("secrets", "bfloat16", 4))


@pytest.fixture(scope="module")
def redis_with_password():
    server = RedisServer(password=RIGHT)
    server.start()
    yield server
    server.stop()


def redis_configs(server):
    host = f"127.0.0.1:{server.port}"
    return {
        "field": lambda secret: {"url": f"redis://{host}/0", "password": secret},
        "url": lambda secret: {"url": f"redis://:{secret}@{host}/0"},
        "url-query": lambda secret: {"url": f"redis://{host}/0?password={secret}"},
    }


def s3_config(server, secret):
    config = {
        "bucket": server.bucket,
        "endpoint_url": server.endpoint_url,
        "region": server.region,
        "access_key_id": server.access_key,
        "secret_access_key": server.secret_key if secret == RIGHT else secret,
        "max_attempts": 1,
    }
    if secret == WRONG:
        config["session_token"] = WRONG + "-token"  # SeaweedFS takes no session tokens: only the refused run has one
    return config


def fsspec_s3_config(server, secret):
    return {
        "url": f"s3://{server.bucket}/secrets",
        "storage_options": {
            "key": server.access_key,
            "client_kwargs": {"endpoint_url": server.endpoint_url, "region_name": server.region},
            "config_kwargs": {"s3": {"addressing_style": "path"}, "retries": {"max_attempts": 1}},
        },
        "secret_storage_options": {"secret": secret},
    }


def hf3fs_config(server, secret, root):
    return {"root": str(root), "file_size": 2**20, "numjobs": 1, "page_size_bytes": 4096, "metadata_url": f"redis://:{secret}@127.0.0.1:{server.port}/0"}


def cases(request, tmp_path):
    """(label, backend name, config factory taking the secret, whether the server checks it)."""
    redis_server = request.getfixturevalue("redis_with_password")
    seaweed = request.getfixturevalue("seaweedfs")
    yield from ((f"redis-{kind}", "redis", make) for kind, make in redis_configs(redis_server).items())
    yield "s3", "s3", lambda secret: s3_config(seaweed, secret)
    yield "fsspec-s3", "fsspec", lambda secret: fsspec_s3_config(seaweed, seaweed.secret_key if secret == RIGHT else secret)
    yield "hf3fs-redis-index", "hf3fs", lambda secret: hf3fs_config(redis_server, secret, tmp_path / "mount")


def assert_clean(text: str, where: str, *secrets: str) -> None:
    for secret in secrets:
        assert secret not in text, f"a secret appeared in {where}"


@pytest.mark.services
@pytest.mark.parametrize("label", ["redis-field", "redis-url", "redis-url-query", "s3", "fsspec-s3", "hf3fs-redis-index"])
def test_secrets_stay_out_of_everything(request, tmp_path, caplog, label):
    caplog.set_level(logging.DEBUG)
    [(_, name, make)] = [case for case in cases(request, tmp_path) if case[0] == label]
    right_config = make(RIGHT)
    secrets = [RIGHT, WRONG]
    if name in ("s3", "fsspec"):
        secrets.append(request.getfixturevalue("seaweedfs").secret_key)  # the real secret stands in for RIGHT

    captured: list[tuple[str, str]] = []
    with Store(create_backend(name, right_config)) as store:
        key = SCOPE.key("ab" * 32)
        assert store.put([key], [b"x" * 4096]) == [True]
        assert store.get([key], 4096) == [b"x" * 4096]
        connector = store.top
        captured += [("repr", repr(store)), ("repr(connector)", repr(connector))]
        captured += [("str(config)", str(connector.config)), ("repr(config)", repr(connector.config))]
        captured += [("public_dict", json.dumps(connector.config.public_dict())), ("stats", json.dumps(store.stats()))]

    with pytest.raises(AuthenticationError) as info:
        with Store(create_backend(name, make(WRONG))) as refused:
            refused.put([SCOPE.key("cd" * 32)], [b"y" * 4096])
    captured.append(("exception chain", "".join(traceback.format_exception(info.value))))
    captured.append(("exception repr", repr(info.value)))

    captured.append(("logs", "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)))
    for where, text in captured:
        assert_clean(text, f"{label}: {where}", *secrets)


@pytest.mark.services
@pytest.mark.slow
def test_conformance_report_masks_secrets(redis_with_password, tmp_path):
    config = json.dumps({"url": f"redis://:{RIGHT}@127.0.0.1:{redis_with_password.port}/0", "prefix": "secrets-report"})
    result = subprocess.run(
        [sys.executable, "-m", "hicache_storage.cli", "conformance", "redis", "--config", config, "--report-dir", str(tmp_path), "-k", "roundtrip_segments"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:]
    for path in Path(tmp_path).iterdir():
        assert_clean(path.read_text(), path.name, RIGHT)
    assert_clean(result.stdout + result.stderr, "conformance output", RIGHT)
