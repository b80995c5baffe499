"""A real Mooncake master (with its HTTP metadata server) on loopback, for tests and CI.

The master keeps object metadata only; the bytes live in the segments that clients mount. So a
master that is killed and restarted comes back empty: clients must re-mount, and objects written
before the restart are misses afterwards (never wrong bytes).

Facts this module relies on (measured with ``mooncake-transfer-engine-non-cuda`` 0.3.13.post1):

* the default ``mooncake-transfer-engine`` wheel is a CUDA build that does not import without a
  GPU driver, so on a CPU machine the ``-non-cuda`` wheel is installed, plus ``libibverbs1``;
* the pip wheel puts the real binary at ``<site-packages>/mooncake/mooncake_master`` and a Python
  shim of the same name on ``PATH`` that ``execv``s it; we run the binary itself;
* every client process must set ``MC_TCP_BIND_ADDRESS=127.0.0.1`` or the transfer engine listens
  on the machine's external address.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from hicache_storage.testing.process import ServerProcess, ServiceError, free_port

MOONCAKE_PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
#: Every Mooncake client process needs this (see the module docstring).
CLIENT_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}


def _package_dir() -> Path | None:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def master_binary() -> Path | None:
    """The ``mooncake_master`` executable from the installed wheel, or ``None``."""
    package = _package_dir()
    if package is not None and (package / "mooncake_master").is_file():
        return package / "mooncake_master"
    found = shutil.which("mooncake_master")
    return Path(found) if found else None


def _libibverbs_present() -> bool:
    return ctypes.util.find_library("ibverbs") is not None


def ensure_installed() -> Path:
    """Install the Mooncake wheel and ``libibverbs1`` if missing; return the master binary's path."""
    if not _libibverbs_present():
        if shutil.which("apt-get") is None:
            raise ServiceError("libibverbs1 is missing and apt-get is not available; install libibverbs1 yourself")
        subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True)
        result = subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", "libibverbs1"], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise ServiceError(f"apt-get install libibverbs1 failed:\n{result.stderr[-2000:]}")
    if master_binary() is None:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", MOONCAKE_PACKAGE], capture_output=True, text=True
        )
        importlib.invalidate_caches()
        if result.returncode != 0:
            raise ServiceError(f"pip install {MOONCAKE_PACKAGE} failed:\n{result.stderr[-2000:]}")
    binary = master_binary()
    if binary is None:
        raise ServiceError(f"installed {MOONCAKE_PACKAGE} but found no mooncake_master binary in it")
    return binary


class MooncakeMaster(ServerProcess):
    """``mooncake_master`` with its HTTP metadata server, plus one storage node, on 127.0.0.1.

    With ``storage_node=False``, the master alone: the deployment where every client contributes
    its own segment (``global_segment_size`` > 0, as SGLang instances run by default), so pages
    live only as long as the client whose segment holds them.

    ``master_server_addr`` (``"127.0.0.1:PORT"``) and ``metadata_server``
    (``"http://127.0.0.1:PM/metadata"``) are what a client's ``setup`` takes. The ports are
    chosen once, so :meth:`restart` brings the master back at the same addresses.

    Why a storage node: Mooncake places each object in a random mounted segment, and a segment
    dies with the client process that mounted it. Test clients therefore mount no memory
    (``global_segment_size=0``) and store everything in a separate ``mooncake_client`` process
    (the "real client" store service), as SGLang's Mooncake guide recommends for persistence
    across engine restarts. :meth:`kill` and :meth:`restart` affect the master only; the node
    re-mounts its segment on its own once the master is back, and :meth:`restart` waits for it.

    ``lease_ttl_ms`` is the master's ``--default_kv_lease_ttl``: a read or an exists check holds
    a lease that blocks removal. Mooncake's default is 10 s; tests use a short lease so that a
    delete right after a read does not wait that long. Clients should set the connector's
    ``lease_ttl_s`` to the same value.
    """

    DEFAULT_LEASE_TTL_MS = 300

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        lease_ttl_ms: int | None = DEFAULT_LEASE_TTL_MS,
        node_segment_bytes: int = 256 * 1024 * 1024,
        storage_node: bool = True,
    ) -> None:
        super().__init__("mooncake-master", workdir)
        self.lease_ttl_ms = lease_ttl_ms
        self.node_segment_bytes = node_segment_bytes
        self.storage_node = storage_node
        self._pick_ports()
        self.node = ServerProcess("mooncake-node", self.workdir)

    def _pick_ports(self) -> None:
        self.rpc_port = free_port()
        self.metadata_port = free_port(avoid=[self.rpc_port])
        self.metrics_port = free_port(avoid=[self.rpc_port, self.metadata_port])
        self.node_port = free_port(avoid=[self.rpc_port, self.metadata_port, self.metrics_port])

    @property
    def master_server_addr(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def client_config(self, segment_bytes: int = 0) -> dict[str, object]:
        """A ``mooncake`` connector config for this master: by default no local segment (pages
        go to the storage node); ``segment_bytes`` for a client that contributes its own."""
        config: dict[str, object] = {
            "master_server_address": self.master_server_addr,
            "metadata_server": self.metadata_server,
            "local_hostname": "127.0.0.1",
            "protocol": "tcp",
            "global_segment_size": segment_bytes,
            "local_buffer_size": 16 * 1024 * 1024,
        }
        if self.lease_ttl_ms is not None:
            config["lease_ttl_s"] = self.lease_ttl_ms / 1000
        return config

    def client_env(self) -> dict[str, str]:
        """The environment a client subprocess needs (this process's, plus :data:`CLIENT_ENV`)."""
        return {**os.environ, **CLIENT_ENV}

    def start(self, attempts: int = 3) -> None:
        """Start the master (and the storage node, if any); return once the node's segment is mounted.

        A free port can be taken by another process between choosing and binding it; a failed
        start is retried on new ports (``restart`` keeps its ports and does not retry).
        """
        for attempt in range(attempts):
            try:
                self._start_master()
                if self.storage_node:
                    if not self.node.running():
                        self._start_node()
                    self._wait_mounted()
                return
            except ServiceError:
                self.stop()
                if attempt == attempts - 1:
                    raise
                self._pick_ports()

    def stop(self, grace: float = 5.0) -> None:
        """Stop the node first (it unmounts through the master), then the master. Safe to call twice."""
        self.node.stop(grace)
        super().stop(grace)

    def kill(self) -> None:
        """SIGKILL the master (a crash, for fault tests) and reap it; ports and node are kept for :meth:`restart`."""
        if self.process is not None:
            self.signal(signal.SIGKILL)
            self.process.wait(timeout=10)
            self.process = None

    def restart(self) -> None:
        """Start the master again on the same ports (after :meth:`kill`); waits for the node to re-mount.

        The new master starts empty: objects stored before are gone (reads of them are misses).
        """
        if self.running():
            super().stop()
        try:
            self._start_master()
            if self.storage_node:
                self._wait_mounted()
        except ServiceError:
            self.stop()
            raise

    def freeze(self) -> None:
        """SIGSTOP the master: its sockets stay open but it answers nothing (a hung server)."""
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after :meth:`freeze`."""
        self.signal(signal.SIGCONT)

    def log_tail(self, lines: int = 40) -> str:
        return super().log_tail(lines) + "\n" + self.node.log_tail(lines)

    # --- internals ----------------------------------------------------------------------------

    def _start_master(self) -> None:
        binary = ensure_installed()
        argv = [
            str(binary),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.metadata_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--enable_metric_reporting=false",
        ]
        if self.lease_ttl_ms is not None:
            argv.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
        self.spawn(argv, env=CLIENT_ENV)
        self.wait_ready(
            lambda: self.listens_on(self.rpc_port, self.metadata_port, self.metrics_port),
            timeout=30.0,
        )

    def _start_node(self) -> None:
        binary = master_binary()
        node_binary = binary.with_name("mooncake_client") if binary is not None else None
        if node_binary is None or not node_binary.is_file():
            raise ServiceError(f"no mooncake_client binary next to {binary}; reinstall {MOONCAKE_PACKAGE}")
        self.node.spawn(
            [
                str(node_binary),
                f"--master_server_address={self.master_server_addr}",
                f"--metadata_server={self.metadata_server}",
                "--host=127.0.0.1",
                f"--port={self.node_port}",
                f"--global_segment_size={self.node_segment_bytes}",
                "--protocol=tcp",
            ],
            env=CLIENT_ENV,
        )

    def _wait_mounted(self, timeout: float = 30.0) -> None:
        """Wait until the master reports the node's segment (``master_total_capacity_bytes`` > 0)."""

        def mounted() -> bool:
            if not self.node.running():
                raise ServiceError(f"the Mooncake storage node exited\n{self.node.log_tail()}")
            return _total_capacity(self.metrics_port) > 0

        self.wait_ready(mounted, timeout=timeout)


def _total_capacity(metrics_port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1.0) as response:
            text = response.read().decode(errors="replace")
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("master_total_capacity_bytes "):
            return int(float(line.split()[1]))
    return 0
