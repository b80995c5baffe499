"""Run a real server on loopback for tests: free ports, readiness loop, logs on failure, stop by PID.

Each server module (``redis_server``, ``seaweedfs``, ``mooncake_master``) builds on
:class:`ServerProcess`. Servers bind 127.0.0.1 only and are always stopped by the PID we started.

Work directories: a server given none gets its own ``mkdtemp`` directory (config, data, log).
:meth:`ServerProcess.stop` removes it when everything went well, and keeps it, logging its path at
WARNING, when something did not, so the log is there to read: the server failed to start or to
become ready, it exited on its own, or it ignored SIGTERM and had to be killed (unless its class
is :attr:`~ServerProcess.slow_to_exit`). A directory the caller passed in is never removed.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar

log = logging.getLogger(__name__)
#: Every ServerProcess alive, so a stop can tell whether another one still runs in its directory.
_servers: weakref.WeakSet[ServerProcess] = weakref.WeakSet()


class ServiceError(RuntimeError):
    """A test server could not be installed or started; the message includes its log tail."""


def free_port(avoid: Sequence[int] = ()) -> int:
    """A TCP port on 127.0.0.1 that is free now (and not in ``avoid``)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in avoid:
            return port


def _listening_ports(pid: int) -> set[int]:
    """TCP ports a process listens on: its socket inodes matched against /proc/net/tcp{,6}."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        for fd in fd_dir.iterdir():
            try:
                target = os.readlink(fd)
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:  # the process is gone
        return set()
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def which_or_fail(binary: str, hint: str) -> str:
    path = shutil.which(binary)
    if path is None:
        raise ServiceError(f"{binary!r} is not on PATH; {hint}")
    return path


class ServerProcess:
    """One server process with its own work directory and log file.

    ``unclean`` says why the work directory must be kept (``None``: nothing went wrong so far).
    """

    #: True for a server that routinely outlasts :meth:`stop`'s grace period (SeaweedFS takes
    #: ~16 s to exit): being killed after it is then no sign of trouble and keeps no directory.
    slow_to_exit: ClassVar[bool] = False

    def __init__(self, name: str, workdir: Path | None = None) -> None:
        self.name = name
        self._owns_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix=f"hicache-{name}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.unclean: str | None = None
        self._killed = False  # we sent SIGKILL: an exit by it is ours, not a crash
        self._kept_reason: str | None = None
        _servers.add(self)

    def spawn(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        if self.process is not None and self.process.poll() is None:
            raise ServiceError(f"{self.name} is already running (pid {self.process.pid})")
        self.workdir.mkdir(parents=True, exist_ok=True)  # a clean stop removed it
        self._killed = False
        log_file = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(
                list(argv),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # a stray SIGINT to the test run does not hit the server
            )
        finally:
            log_file.close()

    def wait_ready(self, ready: Callable[[], bool], timeout: float = 30.0) -> None:
        """Poll ``ready`` until it is true; a ServiceError (with the log tail) if the server exits
        or ``timeout`` passes. A failure marks the work directory to keep; a later success unmarks it."""
        try:
            self._wait_ready(ready, timeout)
        except BaseException as exc:
            self.unclean = f"not ready: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise
        self.unclean = None

    def _wait_ready(self, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise ServiceError(f"{self.name} exited with code {self.process.returncode}\n{self.log_tail()}")
            if ready():
                return
            time.sleep(0.05)
        raise ServiceError(f"{self.name} not ready after {timeout:.0f}s\n{self.log_tail()}")

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def running(self) -> bool:
        return self.live_process() is not None

    def live_process(self) -> subprocess.Popen[bytes] | None:
        """The server's process while it runs; None before a start and once it exited."""
        process = self.process
        return process if process is not None and process.poll() is None else None

    def listens_on(self, *ports: int) -> bool:
        """Whether this server's own process listens on every one of ``ports``.

        A connect succeeding is not enough: between :func:`free_port` choosing a port and the server
        binding it, another process (a client's transfer engine, another server) can take it, and
        a connect to that port then succeeds while our server failed to bind (Linux ``/proc``).
        """
        process = self.live_process()
        if process is None:
            return False
        return set(ports) <= _listening_ports(process.pid)

    def signal(self, signum: int) -> None:
        """Send a signal to the server (SIGSTOP / SIGCONT / SIGKILL in fault tests).

        SIGSTOP to a server that is not running raises: a fault test would otherwise go on
        against a server that was never frozen.
        """
        process = self.live_process()
        if signum == signal.SIGSTOP and process is None:
            raise ServiceError(f"{self.name} is not running: cannot freeze it\n{self.log_tail()}")
        if process is not None:
            self._killed = self._killed or signum == signal.SIGKILL
            os.kill(process.pid, signum)
            if signum == signal.SIGSTOP:
                self._wait_stopped()

    def _wait_stopped(self, timeout: float = 10.0) -> None:
        """Return once /proc shows every thread of the server stopped, so that a fault test's next
        call meets a frozen server, never one still finishing the stop (``kill`` returns when
        the signal is sent, not when it has taken effect)."""
        assert self.process is not None
        tasks = Path(f"/proc/{self.process.pid}/task")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                states = [(task / "stat").read_text().rpartition(")")[2].split()[0] for task in tasks.iterdir()]
            except (OSError, IndexError):  # a thread exited meanwhile, or no /proc: look again
                states = []
            if states and all(state in ("T", "t") for state in states):
                return
            time.sleep(0.005)
        raise ServiceError(f"{self.name} (pid {self.process.pid}) did not stop within {timeout:.0f}s of SIGSTOP")

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL. Safe to call twice.

        Then the work directory this object created is removed, unless something went wrong
        (see the module docstring: it is kept and its path logged) or another server of ours
        still runs in it.
        """
        if self.process is not None:
            if self.process.poll() is None:
                try:
                    os.kill(self.process.pid, signal.SIGCONT)  # a frozen server cannot handle SIGTERM
                    self.process.terminate()
                    self.process.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    if not self.slow_to_exit:
                        self.unclean = self.unclean or f"did not exit within {grace:g}s of SIGTERM and was killed"
                    self.process.kill()
                    self.process.wait(timeout=10)
                except ProcessLookupError:
                    pass
            elif self.process.returncode != 0 and not (self._killed and self.process.returncode == -signal.SIGKILL):
                self.unclean = self.unclean or f"exited on its own with code {self.process.returncode}"
            self.process = None
        self._settle_workdir()

    def _settle_workdir(self) -> None:
        if not self._owns_workdir or not self.workdir.exists():
            return
        if self.unclean is not None:
            if self._kept_reason != self.unclean:  # once per reason, though stop() may be called twice
                log.warning("%s: %s; keeping its work directory for diagnosis: %s", self.name, self.unclean, self.workdir)
                self._kept_reason = self.unclean
            return
        if any(other is not self and other.workdir == self.workdir and other.running() for other in list(_servers)):
            return  # another process of ours runs there (and logs there): removed at the last stop
        shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log at {self.log_path})"
        return f"--- last {len(text)} lines of {self.log_path} ---\n" + "\n".join(text)
