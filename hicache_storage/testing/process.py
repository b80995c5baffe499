"""Run a real server on loopback for tests: free ports, readiness loop, logs on failure, stop by PID.

Each server module (``redis_server``, ``seaweedfs``, ``mooncake_master``) builds on
:class:`ServerProcess`. Servers bind 127.0.0.1 only and are always stopped by the PID we started.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path


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


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def which_or_fail(binary: str, hint: str) -> str:
    path = shutil.which(binary)
    if path is None:
        raise ServiceError(f"{binary!r} is not on PATH; {hint}")
    return path


class ServerProcess:
    """One server process with its own work directory and log file."""

    def __init__(self, name: str, workdir: Path | None = None) -> None:
        self.name = name
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix=f"hicache-{name}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def spawn(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        if self.process is not None and self.process.poll() is None:
            raise ServiceError(f"{self.name} is already running (pid {self.process.pid})")
        log = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # a stray SIGINT to the test run does not hit the server
            )
        finally:
            log.close()

    def wait_ready(self, ready: Callable[[], bool], timeout: float = 30.0) -> None:
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
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        """Send a signal to the server (SIGSTOP / SIGCONT / SIGKILL in fault tests)."""
        if self.running():
            os.kill(self.process.pid, signum)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL. Safe to call twice."""
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                os.kill(self.process.pid, signal.SIGCONT)  # a frozen server cannot handle SIGTERM
                self.process.terminate()
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
            except ProcessLookupError:
                pass
        self.process = None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log at {self.log_path})"
        return f"--- last {len(text)} lines of {self.log_path} ---\n" + "\n".join(text)
