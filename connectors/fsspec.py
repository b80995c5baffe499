"""Any filesystem fsspec can open: ``memory://``, ``file://``, ``s3://`` (s3fs), ``gs://``, ...

One file per page at ``<url path>/<namespace>/<shard>/<part>/<page hash>``. How a page is
published depends on the filesystem, and the capabilities say what each one gives:

* **local** (``file://`` or a plain path): written to a temporary file in the page's directory,
  then renamed over the page, so a reader sees the old page, the new page or nothing. Reads go
  straight into the caller's segments from an open file, so a page replaced during a read is
  still read whole (the open file keeps the old one).
* **object stores** (``s3://``, ``gs://``, ``az://``...): one object per page, which the store
  publishes atomically; read with one request.
* **memory://**: one ``pipe`` that swaps an immutable value into fsspec's process-wide dict
  (instances with the same URL in one process share it). Not persistent, not shared across
  processes.
* anything else: temporary file plus ``mv``, atomic only where that filesystem's ``mv`` is; its
  capabilities claim nothing about persistence or sharing.

A writer that dies between the temporary file and the rename leaves a ``<page>.tmp-<id>`` file:
never read as a page, removed by ``clear``. Network timeouts are the filesystem's own (for s3fs,
``storage_options={"config_kwargs": {"connect_timeout": ..., "read_timeout": ...}}``).

A stored length that differs from the target's is a miss. Batches run on a thread pool of
``max_concurrency`` workers; every public method is thread-safe. Credentials go in
``secret_storage_options`` (masked in reprs and reports), the rest in ``storage_options``.
"""

from __future__ import annotations

import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pydantic

from hicache_storage.buffers import Segments, fill_segments, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.redaction import LOG_REDACTOR
from hicache_storage.errors import (
    AuthenticationError,
    BackendUnavailableError,
    ConfigError,
    MissingDependencyError,
    PermissionDeniedError,
    StorageError,
    StorageTimeoutError,
)
from hicache_storage.connectors.per_key import PerKeyConnector
from hicache_storage.keys import Namespace, PageKey


_LOCAL = frozenset({"file", "local"})
_MEMORY = frozenset({"memory"})
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "oci", "tos", "cos", "r2"})
_AUTH_CODES = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidClientTokenId", "ExpiredToken", "InvalidToken")


class FsspecConfig(BackendConfig):
    url: str = pydantic.Field(
        ..., min_length=1, description="where pages live, e.g. 'memory://kv', 'file:///mnt/kv', 's3://bucket/kv'"
    )
    storage_options: dict[str, Any] = pydantic.Field(
        default_factory=dict, description="options for the filesystem, e.g. s3fs's client_kwargs={'endpoint_url': ...}"
    )
    secret_storage_options: dict[str, pydantic.SecretStr] = pydantic.Field(
        default_factory=dict, description="credential options, masked in reprs and reports, e.g. {'secret': '...'}"
    )
    max_concurrency: int = pydantic.Field(8, ge=1, le=256, description="parallel page operations per batch")


class FsspecBackend(PerKeyConnector):
    name = "fsspec"
    Config = FsspecConfig
    config: FsspecConfig
    capabilities = Capabilities(delete=True, clear=True)

    def __init__(self, config: FsspecConfig | dict | str | None = None) -> None:
        super().__init__(config)
        cfg: FsspecConfig = self.config
        try:
            import fsspec
            from fsspec.core import url_to_fs
        except ImportError:
            raise MissingDependencyError("fsspec", "fsspec", "fsspec") from None
        self._where = _redact(cfg.url)
        try:
            protocol = fsspec.core.split_protocol(cfg.url)[0] or "file"
            filesystem_class = fsspec.get_filesystem_class(protocol)
        except ImportError as exc:
            raise MissingDependencyError("fsspec", _package_for(exc), None) from None
        except ValueError as exc:
            raise ConfigError(f"fsspec cannot open {self._where!r}: {exc}", field="url", backend=self.name) from None
        protocols = {filesystem_class.protocol} if isinstance(filesystem_class.protocol, str) else set(filesystem_class.protocol)
        options = dict(cfg.storage_options)
        if protocols & _LOCAL:
            self._kind = "local"
            self.capabilities = self.capabilities.replace(persistent=True, shared_across_processes=True, outlives_writer=True)
        elif protocols & _MEMORY:
            self._kind = "memory"
        elif protocols & _OBJECT_STORES:
            self._kind = "object"
            self.capabilities = self.capabilities.replace(
                persistent=True, shared_across_processes=True, outlives_writer=True, shared_across_hosts=True
            )
            # A cached listing would hide pages other processes wrote since.
            options.setdefault("use_listings_cache", False)
        else:
            self._kind = "other"
        secrets = {name: secret.get_secret_value() for name, secret in cfg.secret_storage_options.items()}
        options.update(secrets)
        # s3fs and friends log signed headers (a session token among them) at DEBUG.
        self._log_secrets = [value for value in secrets.values() if isinstance(value, str)]
        LOG_REDACTOR.add(self._log_secrets)
        try:
            self._fs, root = url_to_fs(cfg.url, **options)
        except (TypeError, ValueError) as exc:
            LOG_REDACTOR.remove(self._log_secrets)
            raise ConfigError(
                f"fsspec cannot open {self._where!r} with these storage_options ({type(exc).__name__})",
                field="storage_options",
                backend=self.name,
            ) from None
        self._root = root.rstrip("/")
        self._pool = ThreadPoolExecutor(max_workers=cfg.max_concurrency, thread_name_prefix="hicache-fsspec")
        try:
            self._check_root()
        except BaseException:
            self._close()
            raise

    # --- hooks (exists, get, put and delete: PerKeyConnector's, over the calls below) -------

    def _clear(self, namespace: Namespace) -> None:
        directory = f"{self._root}/{namespace.fingerprint}"
        try:
            self._fs.rm(directory, recursive=True)
        except FileNotFoundError:
            pass  # nothing of this namespace was ever written
        except Exception as exc:
            self._raise(exc, "clear")
        finally:
            self._fs.invalidate_cache(directory)

    def _close(self) -> None:
        self._pool.shutdown(wait=True)
        LOG_REDACTOR.remove(self._log_secrets)

    def __repr__(self) -> str:
        return f"<FsspecBackend url={self._where!r} kind={self._kind}>"

    # --- one key each -------------------------------------------------------------------------

    def _path(self, key: PageKey) -> str:
        return f"{self._root}/{key.render('/')}"

    def _exists_one(self, key: PageKey) -> bool:
        return bool(self._fs.isfile(self._path(key)))

    def _get_one(self, key: PageKey, target: Segments) -> bool:
        path = self._path(key)
        try:
            if self._kind == "local":
                return _read_file_into(self._fs, path, target)
            data = self._fs.cat_file(path)
        except FileNotFoundError:
            return False
        if len(data) != segments_size(target):
            return False
        fill_segments(target, data)
        return True

    def _put_one(self, key: PageKey, source: Segments) -> bool:
        path = self._path(key)
        if self._kind in ("memory", "object"):
            self._fs.pipe_file(path, b"".join(source))
            return True
        temporary = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            self._write_file(temporary, source)
        except FileNotFoundError:  # first page of its directory
            self._fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            self._write_file(temporary, source)
        try:
            self._fs.mv(temporary, path)
        except BaseException:
            self._fs.rm_file(temporary)
            raise
        return True

    def _write_file(self, path: str, source: Segments) -> None:
        with self._fs.open(path, "wb") as handle:
            for view in source:
                handle.write(view)

    def _delete_one(self, key: PageKey) -> bool:
        path = self._path(key)
        # Object stores delete a missing key without complaint, so ask first there.
        if self._kind == "object" and not self._fs.isfile(path):
            return False
        try:
            self._fs.rm_file(path)
        except FileNotFoundError:
            return False
        return True

    # --- batches, probing and errors ----------------------------------------------------------

    def _check_root(self) -> None:
        """Fail at construction, naming the URL, if the location cannot be used."""
        try:
            if self._kind == "local":
                self._fs.makedirs(self._root, exist_ok=True)
            elif self._kind == "object":
                bucket = self._root.split("/", 1)[0]
                self._fs.ls(bucket, detail=False)  # raises for a missing bucket or bad credentials
        except FileNotFoundError:
            raise ConfigError(f"{self._where!r}: the bucket or directory does not exist; create it first", field="url", backend=self.name) from None
        except Exception as exc:
            self._raise(exc, "connect")

    def _translate(self, exc: BaseException) -> StorageError | None:
        return _translate(exc, self._where)


def _read_file_into(fs: Any, path: str, target: Segments) -> bool:
    """Read a local file straight into ``target``; ``False`` unless its size is the target's."""
    with fs.open(path, "rb") as handle:
        if handle.seek(0, 2) != segments_size(target):
            return False
        handle.seek(0)
        for view in target:
            filled = 0
            while filled < view.nbytes:
                count = handle.readinto(view[filled:])
                if not count:
                    return False  # shrank under us: only possible if something bypassed rename
                filled += count
    return True


def _translate(exc: BaseException, where: str) -> StorageError | None:
    """A typed StorageError for a filesystem or network failure (``None`` for anything else)."""
    kind = type(exc).__name__
    if isinstance(exc, PermissionError):
        if _service_code(exc) in _AUTH_CODES:
            return AuthenticationError(f"{where!r} rejected the credentials ({kind}); check secret_storage_options")
        return PermissionDeniedError(f"no permission for {where!r} ({kind}); check the credentials' rights or file modes")
    if isinstance(exc, TimeoutError) or "timeout" in kind.lower():
        return StorageTimeoutError(f"{where!r} did not answer in time ({kind})")
    if isinstance(exc, (ConnectionError, OSError)) or "connect" in kind.lower() or "endpoint" in kind.lower():
        return BackendUnavailableError(f"cannot reach {where!r} ({kind}); is the store running?")
    return None


def _service_code(exc: BaseException) -> str | None:
    """The store's error code (e.g. ``SignatureDoesNotMatch``) behind a translated OSError.

    s3fs and friends raise a plain ``PermissionError`` chained to the botocore error that has it.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code"):
            return str(response["Error"]["Code"])
        current = current.__cause__ or current.__context__
    return None


def _package_for(exc: ImportError) -> str:
    """The package fsspec says a protocol needs ("Install s3fs to access S3" -> "s3fs")."""
    match = re.search(r"[Ii]nstall\s+([A-Za-z0-9_.\-]+)", str(exc))
    return match.group(1) if match else exc.name or "the filesystem's package"


def _redact(url: str) -> str:
    """The URL without a query string or ``user:password@`` part, safe for messages."""
    url = url.split("?", 1)[0]
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        rest = rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"
