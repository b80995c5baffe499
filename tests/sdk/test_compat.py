"""The names from before Connector / Layer / Store still work for one release, each with a
DeprecationWarning naming its replacement (hicache_storage.compat); the new names never warn."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from hicache_storage import Connector, KeyScope, Namespace, Store, open_store
from hicache_storage.buffers import fill_segments
from hicache_storage.connectors.memory import MemoryBackend
from hicache_storage.layers import LAYERS, Layer, TimeoutLayer, load_layer_specs, stack_layers

SCOPE = KeyScope(Namespace(model="compat-tests", kv_dtype="bfloat16", page_size=16))


def test_a_storage_backend_subclass_warns_once_and_works_as_a_connector() -> None:
    from hicache_storage import StorageBackend

    with pytest.warns(DeprecationWarning, match=r"subclassing hicache_storage.StorageBackend .*OldStyle.* use hicache_storage.Connector"):

        class OldStyle(StorageBackend):
            name = "old-style"

            def __init__(self, config=None):
                super().__init__(config)
                self.pages: dict = {}

            def _exists(self, keys):
                return [k in self.pages for k in keys]

            def _get_into(self, keys, targets):
                hits = []
                for key, target in zip(keys, targets):
                    value = self.pages.get(key)
                    hits.append(value is not None and len(value) == sum(v.nbytes for v in target))
                    if hits[-1]:
                        fill_segments(target, value)
                return hits

            def _put_from(self, keys, sources):
                for key, source in zip(keys, sources):
                    self.pages[key] = b"".join(source)
                return [True] * len(keys)

    assert issubclass(OldStyle, Connector)
    keys = SCOPE.keys(["ab" * 32])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # using it warns no more
        old = OldStyle()
        # What a StorageBackend always had: the caller methods of a store over itself.
        assert old.put(keys, [b"page"]) == [True]
        assert old.get(keys, 4) == [b"page"]
        assert old.facade.stats()["put_keys"] == 1
        # And it stacks and opens like any connector.
        store = Store(stack_layers(OldStyle(), [{"kind": "integrity"}]))
        assert store.put(keys, [b"page"]) == [True] and store.get(keys, 4) == [b"page"]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("BackendWrapper", Layer),
        ("TimeoutWrapper", TimeoutLayer),
        ("WRAPPERS", LAYERS),
        ("load_wrapper_specs", load_layer_specs),
    ],
)
def test_old_layer_names_are_the_new_objects_with_a_warning(old: str, new: object) -> None:
    from hicache_storage import compat

    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: use hicache_storage.layers."):
        assert getattr(compat, old) is new


def test_wrap_stacks_layers_with_a_warning() -> None:
    from hicache_storage import wrap

    with pytest.warns(DeprecationWarning, match="hicache_storage.wrap is deprecated: use hicache_storage.layers.stack_layers"):
        top = wrap(MemoryBackend(), [{"kind": "metrics"}])
    assert top.name == "metrics(memory)"


def test_a_layer_file_under_the_old_key_is_read_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "layers.json"
    path.write_text(json.dumps({"wrappers": [{"kind": "retry", "attempts": 2}]}))
    with pytest.warns(DeprecationWarning, match="'wrappers' is deprecated: use 'layers'"):
        assert load_layer_specs(f"@{path}") == [{"kind": "retry", "attempts": 2}]
    store = None
    with pytest.warns(DeprecationWarning):
        store = open_store({"backend": "memory", "layers": f"@{path}"})
    assert [level.name for level in store.levels()] == ["retry(memory)", "memory"]


def test_new_names_never_warn(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store = open_store({"backend": "memory", "layers": [{"kind": "timeout"}, {"kind": "metrics"}]})
        store.put(SCOPE.keys(["cd" * 32]), [b"x"])
        store.close()


def test_the_cli_reads_the_old_flag_and_says_so(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hicache_storage.cli", "conformance", "memory", "--wrappers", '[{"kind": "metrics"}]',
         "--quick", "-k", "test_roundtrip_segments", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "--wrappers is deprecated: use --layers" in done.stderr
    report = json.loads((tmp_path / "memory.json").read_text())
    assert report["environment"]["layers"] == '[{"kind": "metrics"}]'


def test_giving_both_flags_is_a_usage_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hicache_storage.cli", "conformance", "memory", "--wrappers", "[]", "--layers", "[]"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "give --layers only" in done.stderr


def test_the_sglang_adapter_reads_the_old_key_with_a_warning() -> None:
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from hicache_storage.sglang import AdapterConfig

    with pytest.warns(DeprecationWarning, match="the extra-config key 'wrappers' is deprecated: use 'layers'"):
        config = AdapterConfig.from_extra_config({"connector": "memory", "wrappers": [{"kind": "metrics"}]})
    assert config.layers == [{"kind": "metrics"}]
    with pytest.raises(Exception, match="give 'layers' only"):
        AdapterConfig.from_extra_config({"connector": "memory", "wrappers": [], "layers": []})
