"""The mooncake connector against a real Mooncake master, its metadata server and a storage node.

Each test that kills, freezes or needs a long lease starts its own master; the rest share the
session's ``mooncake_master``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hicache_storage.conformance import ConformanceTests
from hicache_storage.errors import BackendUnavailableError, ConfigError, StorageTimeoutError
from hicache_storage.keys import KeyScope, Namespace
from hicache_storage.store import Store
from hicache_storage.testing.mooncake_master import MooncakeMaster
from reused_store import ReusedStore

pytest.importorskip("mooncake.store", reason="needs mooncake-transfer-engine(-non-cuda)")
from hicache_storage.connectors.mooncake import MooncakeBackend, MooncakeConfig  # noqa: E402

pytestmark = pytest.mark.services


class TestMooncakeConformance(ReusedStore, ConformanceTests):
    """One client serves every clause that leaves it as it was (closing one takes a second)."""

    backend = "mooncake"

    @pytest.fixture
    def backend_config(self, mooncake_master: MooncakeMaster) -> dict[str, Any]:
        return mooncake_master.client_config()


@pytest.fixture
def scope() -> KeyScope:
    return KeyScope(Namespace(model=f"mooncake-test-{random.getrandbits(48):012x}", kv_dtype="bfloat16", page_size=16))


@pytest.fixture
def store(mooncake_master: MooncakeMaster) -> Iterator[Store]:
    opened = Store(MooncakeBackend(mooncake_master.client_config()))
    yield opened
    opened.close()


@pytest.fixture
def own_master(tmp_path: Any) -> Iterator[MooncakeMaster]:
    master = MooncakeMaster(tmp_path / "master")
    master.start()
    yield master
    master.stop()


def hashes(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["%064x" % rng.getrandbits(256) for _ in range(n)]


def count_staging_uses(connector: MooncakeBackend) -> list[int]:
    """Record how many pages each call sends through the staging buffer (a spy, not a mock)."""
    uses: list[int] = []
    original = connector._staging_chunks

    def spy(indices: list[int], buffers: Any) -> list[list[int]]:
        uses.append(len(indices))
        return original(indices, buffers)

    connector._staging_chunks = spy  # type: ignore[method-assign]
    return uses


# --- zero copy ----------------------------------------------------------------------------------


def test_registered_pool_moves_pages_without_staging(store: Store, scope: KeyScope) -> None:
    page = 8192
    pool = np.zeros(16 * page, dtype=np.uint8)
    store.register_buffer(pool)
    rng = np.random.default_rng(1)
    pool[: 4 * page] = rng.integers(0, 256, 4 * page, dtype=np.uint8)
    keys = scope.keys(hashes(4, 1))
    uses = count_staging_uses(store.top)
    assert store.put_from(keys, [pool[i * page : (i + 1) * page] for i in range(4)]) == [True] * 4
    # reads into registered memory, one segment and two segments (K and V halves) per page
    targets = [pool[(4 + i) * page : (5 + i) * page] for i in range(2)]
    for i in range(2):
        targets.append([pool[(6 + i) * page : (6 + i) * page + 3000], pool[(8 + i) * page : (9 + i) * page - 3000]])
    assert store.get_into(keys, targets) == [True] * 4
    assert sum(uses) == 0, "registered pages went through the staging buffer"
    for i in range(2):
        assert bytes(pool[(4 + i) * page : (5 + i) * page]) == bytes(pool[i * page : (i + 1) * page])
    for i in (2, 3):
        j = i - 2
        got = bytes(pool[(6 + j) * page : (6 + j) * page + 3000]) + bytes(pool[(8 + j) * page : (8 + j) * page + page - 3000])
        assert got == bytes(pool[i * page : (i + 1) * page])


def test_unregistered_and_multi_segment_pages_use_staging(store: Store, scope: KeyScope) -> None:
    keys = scope.keys(hashes(3, 2))
    values = [os.urandom(5000) for _ in keys]
    uses = count_staging_uses(store.top)
    assert store.put_from(keys, [values[0], [values[1][:100], values[1][100:]], bytearray(values[2])]) == [True] * 3
    targets = [bytearray(5000), [bytearray(2500), bytearray(2500)], memoryview(bytearray(5000))]
    assert store.get_into(keys, targets) == [True] * 3
    assert uses == [3, 3]
    assert [bytes(targets[0]), bytes(targets[1][0] + targets[1][1]), bytes(targets[2])] == values


def test_batches_larger_than_the_staging_buffer(mooncake_master: MooncakeMaster, scope: KeyScope) -> None:
    config = {**mooncake_master.client_config(), "staging_buffer_size": 3 * 4096}
    with Store(MooncakeBackend(config)) as store:
        keys = scope.keys(hashes(10, 3))
        values = [os.urandom(4096) for _ in keys]
        assert store.put(keys, values) == [True] * 10
        assert store.get(keys, 4096) == values


# --- overwrite and leases -----------------------------------------------------------------------


@pytest.mark.parametrize("registered", [True, False], ids=["registered", "unregistered"])
def test_overwrite_replaces_the_value(store: Store, scope: KeyScope, registered: bool) -> None:
    """Mooncake's ``put`` keeps an existing value; the connector must upsert."""
    pool = np.zeros(3 * 4096, dtype=np.uint8)
    if registered:
        store.register_buffer(pool)
    [key] = scope.keys(hashes(1, 4))
    pool[:4096] = 1
    pool[4096:8192] = 2
    assert store.put_from([key], [pool[:4096]]) == [True]
    assert store.get_into([key], [pool[8192:]]) == [True] and set(pool[8192:].tolist()) == {1}
    assert store.put_from([key], [pool[4096:8192]]) == [True]
    assert store.get_into([key], [pool[8192:]]) == [True] and set(pool[8192:].tolist()) == {2}
    assert store.put_from([key], [[pool[:100], pool[100:200]]]) == [True]  # multi-segment, other length
    assert store.get([key], 200) == [b"\x01" * 200]


@pytest.mark.slow
def test_delete_waits_out_a_read_lease(tmp_path: Any, scope: KeyScope) -> None:
    master = MooncakeMaster(tmp_path / "m", lease_ttl_ms=1500)
    master.start()
    try:
        config = master.client_config()
        keys = scope.keys(hashes(2, 5))
        with Store(MooncakeBackend({**config, "lease_ttl_s": 0.1})) as impatient, Store(MooncakeBackend(config)) as patient:
            assert impatient.put(keys, [b"a" * 64, b"b" * 64]) == [True, True]
            assert impatient.get(keys[:1], 64) == [b"a" * 64]  # takes a 1.5 s read lease
            assert impatient.delete(keys[:1]) == [False], "a leased page was reported removed"
            assert impatient.get(keys[:1], 64) == [b"a" * 64], "the page must still be stored"
            assert patient.delete(keys) == [True, True]
            assert patient.exists(keys) == [False, False]
    finally:
        master.stop()


def test_clear_waits_out_this_clients_own_read_leases(store: Store, scope: KeyScope) -> None:
    keys = [scope.key(h) for h in hashes(3, 12)] + [scope.with_part("v").key(hashes(1, 13)[0])]
    assert store.put(keys, [b"p" * 128] * 4) == [True] * 4
    assert store.exists(keys) == [True] * 4  # every page now holds a read lease
    assert store.get(keys[:2], 128) == [b"p" * 128] * 2
    store.clear(scope.namespace)
    assert store.exists(keys) == [False] * 4


# --- two client processes -----------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from hicache_storage.connectors.mooncake import MooncakeBackend
    from hicache_storage.keys import KeyScope, Namespace
    from hicache_storage.store import Store
    request = json.load(sys.stdin)
    scope = KeyScope(Namespace(**request["namespace"]))
    with Store(MooncakeBackend(request["config"])) as store:
        pool = np.zeros(4 * 4096, dtype=np.uint8)
        store.register_buffer(pool)
        read_keys = scope.keys(request["read"])
        halves = [[pool[i * 4096 : i * 4096 + 1000], pool[i * 4096 + 1000 : (i + 1) * 4096]] for i in range(2)]
        hits = store.get_into(read_keys, halves)
        pool[2 * 4096 :] = np.frombuffer(bytes.fromhex(request["write_value"]), dtype=np.uint8)
        stored = store.put_from(scope.keys(request["write"]), [pool[(2 + i) * 4096 : (3 + i) * 4096] for i in range(2)])
    json.dump({"hits": hits, "read": bytes(pool[: 2 * 4096]).hex(), "stored": stored}, sys.stdout)
    """
)


@pytest.mark.slow
def test_two_processes_share_pages(mooncake_master: MooncakeMaster, store: Store, scope: KeyScope) -> None:
    ours, theirs = hashes(2, 6), hashes(2, 7)
    our_value, their_value = os.urandom(2 * 4096), os.urandom(2 * 4096)
    assert store.put(scope.keys(ours), [our_value[:4096], our_value[4096:]]) == [True, True]
    namespace = {k: v for k, v in scope.namespace.describe().items() if k != "fingerprint"}
    request = {
        "config": mooncake_master.client_config(),
        "namespace": namespace,
        "read": ours,
        "write": theirs,
        "write_value": their_value.hex(),
    }
    result = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=120,
        env=mooncake_master.client_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout)
    assert answer["hits"] == [True, True] and bytes.fromhex(answer["read"]) == our_value
    assert answer["stored"] == [True, True]
    # the child has exited; its pages live in the storage node, not in the child
    assert store.get(scope.keys(theirs), 4096) == [their_value[:4096], their_value[4096:]]


# --- deployments: where a page lives decides what is declared -----------------------------------

#: A client that contributes its own segment, as SGLang instances do by default (4 GiB there).
CLIENT_SEGMENT = 256 * 2**20

WRITER = textwrap.dedent(
    """
    import json, sys
    from hicache_storage.connectors.mooncake import MooncakeBackend
    from hicache_storage.keys import KeyScope, Namespace
    from hicache_storage.store import Store

    request = json.loads(sys.stdin.readline())
    scope = KeyScope(Namespace(**request["namespace"]))
    with Store(MooncakeBackend(request["config"])) as store:
        stored = store.put(scope.keys(request["write"]), [bytes.fromhex(request["value"])])
        print(json.dumps({"stored": stored}), flush=True)
        sys.stdin.readline()  # stay alive, segment mounted, until told to exit
    """
)


@pytest.fixture(scope="module")
def plain_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """A master and no storage node: every byte lives in some client's own segment."""
    master = MooncakeMaster(tmp_path_factory.mktemp("plain-master"), storage_node=False)
    master.start()
    yield master
    master.stop()


def test_capabilities_follow_the_deployment(mooncake_master: MooncakeMaster) -> None:
    with Store(MooncakeBackend(mooncake_master.client_config())) as no_segment:
        caps = no_segment.capabilities
        assert caps.persistent and caps.outlives_writer and caps.shared_across_processes
    with Store(MooncakeBackend(mooncake_master.client_config(CLIENT_SEGMENT))) as own_segment:
        caps = own_segment.capabilities
        assert not caps.persistent and not caps.outlives_writer
        assert caps.shared_across_processes and caps.shared_across_hosts
    assert MooncakeConfig.parse({"master_server_address": "h:1"}).global_segment_size > 0, (
        "the default is a per-client segment, so the default declares neither"
    )


@pytest.mark.slow
def test_per_client_segment_a_peer_page_is_visible_while_the_peer_lives(plain_master: MooncakeMaster, scope: KeyScope) -> None:
    """No storage node: a peer's page is in the peer's segment. Another process reads it while the
    peer runs (shared_across_processes); once the peer exits the page is gone, a miss and never
    wrong bytes, which is why this deployment does not declare outlives_writer."""
    [theirs] = hashes(1, 21)
    value = os.urandom(4096)
    request = {
        "config": plain_master.client_config(CLIENT_SEGMENT),
        "namespace": {k: v for k, v in scope.namespace.describe().items() if k != "fingerprint"},
        "write": [theirs],
        "value": value.hex(),
    }
    peer = subprocess.Popen(
        [sys.executable, "-c", WRITER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=plain_master.client_env(),
    )
    assert peer.stdin is not None and peer.stdout is not None
    # This reader mounts no segment, so the page can only be in the peer's.
    with Store(MooncakeBackend(plain_master.client_config())) as reader:
        try:
            peer.stdin.write(json.dumps(request) + "\n")
            peer.stdin.flush()
            line = peer.stdout.readline()
            assert line, f"the peer failed:\n{peer.stderr.read()[-3000:]}"
            assert json.loads(line) == {"stored": [True]}
            assert reader.exists(scope.keys([theirs])) == [True]
            assert reader.get(scope.keys([theirs]), 4096) == [value]
        finally:
            _, stderr = peer.communicate("exit\n", timeout=120)
        assert peer.returncode == 0, stderr[-3000:]
        assert reader.get(scope.keys([theirs]), 4096) == [None], "the page left with its writer's segment"
        assert reader.exists(scope.keys([theirs])) == [False]


@pytest.mark.slow
def test_suite_on_per_client_segments_proves_what_is_declared(plain_master: MooncakeMaster, tmp_path: Any) -> None:
    """The suite on the deployment without storage nodes, through the CLI, on the clauses whose
    outcome depends on where bytes live (the whole suite on it: scripts/conformance_reports.py;
    each clause here closes a client that unmounts a segment, about 2 s a clause)."""
    clauses = "visible_across_processes or outlive or persistence_across_instances or roundtrip_segments or batch_order"
    result = subprocess.run(
        [sys.executable, "-m", "hicache_storage.cli", "conformance", "mooncake"]
        + ["--config", json.dumps(plain_master.client_config(CLIENT_SEGMENT)), "-k", clauses]
        + ["--report-dir", str(tmp_path), "--report-name", "per-client-segment"],
        capture_output=True,
        text=True,
        timeout=300,
        env=plain_master.client_env(),
    )
    report = json.loads((tmp_path / "per-client-segment.json").read_text())
    outcomes = {r["clause"]: r["outcome"] for r in report["results"]}
    assert result.returncode == 0, f"{outcomes}\n{result.stdout[-3000:]}"
    assert outcomes["test_visible_across_processes"] == "passed"
    assert outcomes["test_pages_outlive_their_writer_process"] == "unsupported"
    assert outcomes["test_persistence_across_instances"] == "unsupported"
    assert report["capabilities"]["shared_across_processes"] and not report["capabilities"]["outlives_writer"]


# --- faults -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_master_killed_and_restarted(own_master: MooncakeMaster, scope: KeyScope) -> None:
    with Store(MooncakeBackend(own_master.client_config())) as store:
        keys = scope.keys(hashes(4, 8))
        values = [os.urandom(4096) for _ in keys]
        assert store.put(keys, values) == [True] * 4
        own_master.kill()
        # a dead master: typed errors or per-key False, never a crash or a hang
        for call in (lambda: store.exists(keys), lambda: store.get(keys, 4096), lambda: store.put(keys, values)):
            try:
                result = call()
            except BackendUnavailableError as exc:
                assert own_master.master_server_addr in str(exc)
            else:
                assert all(r in (False, None) for r in result)
        own_master.restart()
        # the client reconnects on its own; the new master starts empty
        deadline = time.monotonic() + 30
        while True:
            try:
                if store.put(keys[:1], values[:1]) == [True]:
                    break
            except BackendUnavailableError:
                pass
            assert time.monotonic() < deadline, "the client did not reconnect within 30 s"
            time.sleep(0.2)
        for got, value in zip(store.get(keys, 4096), values):
            assert got in (None, value), "a page read after the restart has other bytes"
        assert store.get(keys[:1], 4096) == values[:1]
        assert store.put(keys, values) == [True] * 4
        assert store.get(keys, 4096) == values


@pytest.mark.slow
def test_frozen_master_gives_a_timeout_not_a_hang(own_master: MooncakeMaster, scope: KeyScope) -> None:
    with Store(MooncakeBackend(own_master.client_config())) as store:
        keys = scope.keys(hashes(1, 9))
        own_master.freeze()
        try:
            started = time.monotonic()
            try:
                answer = store.exists(keys)  # Mooncake's RPC timeout is 30 s
            except (StorageTimeoutError, BackendUnavailableError):
                pass
            else:  # CI saw this twice (never here): say what came back, and from which master
                pytest.fail(
                    f"exists on a frozen master returned {answer} after {time.monotonic() - started:.1f}s "
                    f"(master pid {own_master.pid} on port {own_master.rpc_port}, listening: "
                    f"{own_master.listens_on(own_master.rpc_port)})"
                )
        finally:
            own_master.thaw()
        assert store.exists(keys) == [False]



class _FailingExists:
    """The real client, except that ``batch_is_exist`` answers with ``reply(keys)`` (a fault)."""

    def __init__(self, client: Any, reply: Any) -> None:
        self._client, self._reply = client, reply

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return self._reply(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@pytest.mark.parametrize(
    "reply,error",
    [
        (lambda keys: [-1] * len(keys), BackendUnavailableError),  # the client's documented error value
        (lambda keys: [-901, -1][: len(keys)], StorageTimeoutError),
        (lambda keys: [], BackendUnavailableError),  # no answer for the keys asked
    ],
    ids=["all-failed", "timed-out", "empty"],
)
def test_an_exists_whose_every_key_failed_is_an_error_not_a_batch_of_misses(store, scope, monkeypatch, reply, error) -> None:
    keys = scope.keys(hashes(2, 11))
    connector = store.top
    monkeypatch.setattr(connector, "_store", _FailingExists(connector._store, reply))
    with pytest.raises(error, match="did not answer an exists of 2 keys"):
        store.exists(keys)
    monkeypatch.setattr(connector, "_store", _FailingExists(connector._store._client, lambda keys: [1, -1]))
    assert store.exists(keys) == [True, False], "one key failing is a miss for that key"

def test_unreachable_master_is_named_at_construction(tmp_path: Any) -> None:
    from hicache_storage.testing.process import free_port

    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(BackendUnavailableError, match=address.replace(".", r"\.")):
        MooncakeBackend({"master_server_address": address, "connect_timeout_s": 0.5})


# --- configuration ------------------------------------------------------------------------------


def test_config_falls_back_to_the_sglang_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.1:50051")
    monkeypatch.setenv("MOONCAKE_TE_META_DATA_SERVER", "http://10.0.0.1:8080/metadata")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "4gb")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "rdma")
    monkeypatch.setenv("MOONCAKE_DEVICE", "erdma_0,erdma_1")
    monkeypatch.delenv("MOONCAKE_LOCAL_HOSTNAME", raising=False)
    monkeypatch.setenv("LOCAL_HOSTNAME", "10.0.0.2")
    config = MooncakeConfig.parse({"protocol": "tcp"})
    assert config.master_server_address == "10.0.0.1:50051"
    assert config.metadata_server == "http://10.0.0.1:8080/metadata"
    assert config.global_segment_size == 4 * 2**30
    assert config.protocol == "tcp", "an explicit config key wins over the environment"
    assert config.device_name == "erdma_0,erdma_1"
    assert config.local_hostname == "10.0.0.2"


def test_missing_master_address_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    with pytest.raises(ConfigError, match="MOONCAKE_MASTER"):
        MooncakeBackend({})


def test_bad_size_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="global_segment_size"):
        MooncakeConfig.parse({"master_server_address": "h:1", "global_segment_size": "lots"})



def test_empty_page_is_reported_not_stored(store: Store, scope: KeyScope) -> None:
    """Mooncake refuses zero-byte objects; the connector says so per key instead of failing the batch."""
    empty, full = scope.keys(hashes(2, 10))
    assert store.put([empty, full], [b"", b"x" * 10]) == [False, True]
    assert store.exists([empty, full]) == [False, True]
