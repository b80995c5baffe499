"""Real Redis servers for tests: a standalone server and a Redis Cluster, on loopback.

Each server runs ``redis-server`` in the foreground from a config file in its own work
directory (so a password never shows in the process list), binds 127.0.0.1 on a free port, keeps
nothing on disk (no RDB, no AOF) and is stopped by the PID we started. Fault tests use
:meth:`RedisServer.kill` (SIGKILL), :meth:`~RedisServer.restart` (same port, same config),
:meth:`~RedisServer.freeze` (SIGSTOP) and :meth:`~RedisServer.thaw` (SIGCONT).

The cluster is built without ``redis-cli``: each node is given a config epoch and a contiguous
slot range, then the first node meets the others, and we wait until every node reports
``cluster_state:ok`` with every node known.

Readiness and cluster setup speak RESP over a raw socket, so this module needs no Redis client
library.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from hicache_storage.testing.process import ServerProcess, ServiceError, free_port

HOST = "127.0.0.1"
_SLOTS = 16384


def ensure_installed() -> None:
    """Install ``redis-server`` with apt (after ``apt-get update``) when it is not on PATH."""
    if shutil.which("redis-server") is not None:
        return
    if os.geteuid() != 0:
        raise ServiceError(
            "redis-server is not installed and installing it needs root; "
            "run: apt-get update && apt-get install -y --no-install-recommends redis-server"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "redis-server"]):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
            raise ServiceError(f"{' '.join(argv)} failed with code {done.returncode}:\n{tail}")
    if shutil.which("redis-server") is None:
        raise ServiceError("apt-get installed redis-server but it is still not on PATH")


class RedisServer(ServerProcess):
    """One ``redis-server`` on 127.0.0.1.

    ``password`` sets ``requirepass``; ``unix_socket`` also listens on a socket file in the work
    directory (see :attr:`unix_url`); ``tls`` serves TLS only, with a certificate for 127.0.0.1
    signed by a throwaway CA (:attr:`ca_path`; :attr:`url` is then ``rediss://``);
    ``cluster_bus_port`` makes it a cluster node.
    """

    def __init__(
        self,
        *,
        password: str | None = None,
        unix_socket: bool = False,
        tls: bool = False,
        cluster_bus_port: int | None = None,
        extra_config: Sequence[str] = (),
        workdir: Path | None = None,
    ) -> None:
        super().__init__("redis", workdir)
        self.host = HOST
        self.port = free_port(avoid=[cluster_bus_port] if cluster_bus_port else ())
        self.password = password
        self.unix_path = self.workdir / "redis.sock" if unix_socket else None
        self.tls = tls
        self.ca_path = self.workdir / "ca.crt" if tls else None
        self.cluster_bus_port = cluster_bus_port
        self.extra_config = list(extra_config)
        self._started = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (``rediss://`` with TLS), without the password."""
        return f"{'rediss' if self.tls else 'redis'}://{self.address}/0"

    @property
    def unix_url(self) -> str:
        if self.unix_path is None:
            raise ServiceError("this RedisServer was started without unix_socket=True")
        return f"unix://{self.unix_path}?db=0"

    def start(self, timeout: float = 15.0) -> None:
        """Start and wait until it answers PING.

        Other test runs on this machine pick free ports too, so the first start moves to another
        port if the chosen one was taken in the meantime; a restart keeps its port.
        """
        ensure_installed()
        if self.tls and not (self.workdir / "server.crt").exists():
            _make_certificates(self.workdir)
        attempts = 1 if self._started else 3
        for attempt in range(attempts):
            config = self.workdir / "redis.conf"
            config.write_text(self._config_text())
            config.chmod(0o600)
            self.spawn([shutil.which("redis-server") or "redis-server", str(config)])
            try:
                self.wait_ready(self._answers_ping, timeout)
                break
            except ServiceError as exc:
                if attempt + 1 == attempts or "Address already in use" not in str(exc):
                    self.stop()  # a server that never became ready must not outlive the test
                    raise
                self.port = free_port(avoid=[self.port, self.cluster_bus_port or 0])
        self._started = True

    def kill(self) -> None:
        """SIGKILL the server and wait for it to be gone: no shutdown, no goodbye to clients."""
        process = self.live_process()
        if process is not None:
            self.signal(signal.SIGKILL)
            process.wait(timeout=10)

    def restart(self, timeout: float = 15.0) -> None:
        """Start again on the same port with the same config (after :meth:`kill` or :meth:`stop`)."""
        self.kill()
        self.start(timeout)

    def freeze(self) -> None:
        """SIGSTOP: the server keeps its sockets open but answers nothing until :meth:`thaw`."""
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def command(self, *args: str | int, timeout: float = 2.0) -> object:
        """Send one command over a fresh connection (authenticating if needed); the decoded reply."""
        return redis_command(
            (self.host, self.port), *args, password=self.password, timeout=timeout, ca_path=self.ca_path
        )

    def _answers_ping(self) -> bool:
        try:
            return self.command("PING", timeout=0.5) == "PONG"
        except (OSError, ServiceError):
            return False

    def _config_text(self) -> str:
        lines = [
            *(["port 0", f"tls-port {self.port}"] if self.tls else [f"port {self.port}"]),
            f"bind {self.host}",
            f"dir {self.workdir}",
            "daemonize no",
            'logfile ""',  # stdout, which ServerProcess writes to the log file
            'save ""',
            "appendonly no",
        ]
        if self.password is not None:
            lines.append(f"requirepass {self.password}")
        if self.tls:
            lines += [
                f"tls-cert-file {self.workdir / 'server.crt'}",
                f"tls-key-file {self.workdir / 'server.key'}",
                f"tls-ca-cert-file {self.ca_path}",
                "tls-auth-clients no",
            ]
        if self.unix_path is not None:
            lines += [f"unixsocket {self.unix_path}", "unixsocketperm 700"]
        if self.cluster_bus_port is not None:
            lines += [
                "cluster-enabled yes",
                "cluster-config-file nodes.conf",
                "cluster-node-timeout 2000",
                f"cluster-port {self.cluster_bus_port}",
            ]
            if self.password is not None:
                lines.append(f"masterauth {self.password}")
        return "\n".join(lines + self.extra_config) + "\n"


class RedisCluster:
    """A Redis Cluster of ``nodes`` primaries (no replicas), slots split evenly, on 127.0.0.1."""

    def __init__(self, nodes: int = 3, *, password: str | None = None, tls: bool = False) -> None:
        if nodes < 1:
            raise ValueError(f"a cluster needs at least one node, got nodes={nodes}")
        self.host = HOST
        self.password = password
        self.tls = tls
        taken: list[int] = []
        self.nodes: list[RedisServer] = []
        for _ in range(nodes):
            bus = free_port(avoid=taken)
            extra = ["tls-cluster yes"] if tls else []
            node = RedisServer(password=password, tls=tls, cluster_bus_port=bus, extra_config=extra)
            while node.port in taken or node.port == bus:
                node.port = free_port(avoid=[*taken, bus])
            taken += [bus, node.port]
            self.nodes.append(node)

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def port(self) -> int:
        return self.nodes[0].port

    @property
    def url(self) -> str:
        """A URL naming the first node; a cluster client discovers the others from it."""
        return self.nodes[0].url

    @property
    def ca_path(self) -> Path | None:
        """The CA that signed every node's certificate (with ``tls=True``)."""
        return self.nodes[0].ca_path

    @property
    def startup_nodes(self) -> list[str]:
        return [node.address for node in self.nodes]

    def start(self, timeout: float = 30.0) -> None:
        if self.tls:  # one CA and certificate for every node, so a client trusts them all
            _make_certificates(self.nodes[0].workdir)
            for node in self.nodes[1:]:
                for name in ("ca.crt", "server.crt", "server.key"):
                    shutil.copy2(self.nodes[0].workdir / name, node.workdir / name)
        for node in self.nodes:
            node.start()
        try:
            self._assign_slots()
            first = self.nodes[0]
            for node in self.nodes[1:]:
                assert node.cluster_bus_port is not None  # every node of a cluster has one (above)
                first.command("CLUSTER", "MEET", node.host, node.port, node.cluster_bus_port)
            for node in self.nodes:
                node.wait_ready(self._healthy_from(node), timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def kill(self, index: int = 0) -> None:
        self.nodes[index].kill()

    def restart(self, index: int = 0, timeout: float = 30.0) -> None:
        """Restart one node on its port; it rejoins from its ``nodes.conf``."""
        node = self.nodes[index]
        node.restart()
        node.wait_ready(self._healthy_from(node), timeout)

    def freeze(self, index: int = 0) -> None:
        self.nodes[index].freeze()

    def thaw(self, index: int = 0, timeout: float = 30.0) -> None:
        """SIGCONT one node and wait until every node sees the cluster healthy again."""
        self.nodes[index].thaw()
        for node in self.nodes:
            node.wait_ready(self._healthy_from(node), timeout)

    def _assign_slots(self) -> None:
        count = len(self.nodes)
        for index, node in enumerate(self.nodes):
            low = index * _SLOTS // count
            high = (index + 1) * _SLOTS // count - 1
            # Distinct epochs up front, as redis-cli does, so no epoch collision must be resolved.
            node.command("CLUSTER", "SET-CONFIG-EPOCH", index + 1)
            node.command("CLUSTER", "ADDSLOTSRANGE", low, high)

    def _healthy_from(self, node: RedisServer) -> Callable[[], bool]:
        expected = len(self.nodes)

        def healthy() -> bool:
            try:
                info = node.command("CLUSTER", "INFO", timeout=0.5)
            except (OSError, ServiceError):
                return False
            fields = dict(line.split(":", 1) for line in str(info).splitlines() if ":" in line)
            return (
                fields.get("cluster_state") == "ok"
                and fields.get("cluster_known_nodes") == str(expected)
                and fields.get("cluster_slots_ok") == str(_SLOTS)
            )

        return healthy


def _make_certificates(workdir: Path) -> None:
    """A throwaway CA (``ca.crt``) and a server certificate for 127.0.0.1 signed by it."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ServiceError("a TLS test server needs the openssl command; apt-get install openssl")
    (workdir / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        [openssl, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=hicache test CA"],
        [openssl, "req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"],
        [openssl, "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "server.crt", "-days", "2", "-extfile", "san.ext"],
    ]
    for argv in steps:
        done = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise ServiceError(f"{' '.join(argv[:3])} failed: {done.stderr[-2000:]}")


# --- a minimal RESP client, enough for readiness checks and cluster setup -------------------------


def redis_command(
    address: tuple[str, int],
    *args: str | int,
    password: str | None = None,
    timeout: float = 2.0,
    ca_path: Path | None = None,
) -> object:
    """Send one command and return its reply (str, int, None or list); an error reply raises ServiceError.

    With ``ca_path`` the connection is TLS, verified against that CA.
    """
    with socket.create_connection(address, timeout=timeout) as raw:
        sock = ssl.create_default_context(cafile=str(ca_path)).wrap_socket(raw, server_hostname=address[0]) if ca_path else raw
        reader = sock.makefile("rb")
        if password is not None:
            sock.sendall(_encode(("AUTH", password)))
            _read_reply(reader)
        sock.sendall(_encode(args))
        return _read_reply(reader)


def _encode(args: Sequence[str | int]) -> bytes:
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def _read_reply(reader) -> object:
    line = reader.readline()
    if not line.endswith(b"\r\n"):
        raise ServiceError(f"connection closed in the middle of a reply: {line!r}")
    kind, body = line[:1], line[1:-2].decode()
    if kind == b"+":
        return body
    if kind == b"-":
        raise ServiceError(f"redis replied with an error: {body}")
    if kind == b":":
        return int(body)
    if kind == b"$":
        size = int(body)
        return None if size < 0 else reader.read(size + 2)[:-2].decode(errors="replace")
    if kind == b"*":
        size = int(body)
        return None if size < 0 else [_read_reply(reader) for _ in range(size)]
    raise ServiceError(f"unexpected reply from redis: {line!r}")
