import subprocess
import sys

import pytest

from hicache_storage import create_backend, resolve
from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.errors import ConfigError, MissingDependencyError, UnknownBackendError
from hicache_storage.registry import BUILTINS, BackendSpec, describe_backends, load


def test_builtin_by_name():
    assert resolve("memory") is MemoryBackend
    connector = create_backend("memory", {"store": "registry-test"})
    assert isinstance(connector, MemoryBackend) and connector.config.store == "registry-test"
    connector.close()


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownBackendError) as info:
        resolve("mooncak")
    message = str(info.value)
    for name in BUILTINS:
        assert name in message
    assert "hicache_storage.backends" in message and "module:ClassName" in message


def test_module_class_path():
    assert resolve("hicache_storage.connectors.memory:MemoryBackend") is MemoryBackend


@pytest.mark.parametrize(
    "target, match",
    [
        ("hicache_storage.connectors.memory:Nope", "has no attribute 'Nope'"),
        ("hicache_storage.keys:Namespace", "not a Connector subclass"),
        ("no_such_module_xyz:Backend", "cannot import 'no_such_module_xyz'"),
    ],
)
def test_bad_module_class_paths(target, match):
    with pytest.raises(ConfigError, match=match):
        resolve(target)


def test_missing_extra_names_the_package_and_the_extra():
    spec = BackendSpec("vendor", "vendor_client_xyz:Backend", extra="vendor", requires=("vendor_client_xyz",))
    with pytest.raises(MissingDependencyError) as info:
        load(spec)
    assert "'vendor_client_xyz'" in str(info.value)
    assert "pip install 'hicache-storage[vendor]'" in str(info.value)
    assert isinstance(info.value, ImportError)


def test_describe_lists_every_builtin_with_capabilities_or_what_is_missing():
    infos = {info.spec.name: info for info in describe_backends()}
    assert set(BUILTINS) <= set(infos)
    assert infos["memory"].available and infos["memory"].capabilities.delete


def test_importing_the_sdk_imports_no_client_library():
    code = (
        "import sys, hicache_storage, hicache_storage.registry;"
        "hicache_storage.registry.describe_backends();"
        "heavy = [m for m in ('redis', 'boto3', 'mooncake', 'fsspec', 'torch', 'triton', 'sglang') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""
