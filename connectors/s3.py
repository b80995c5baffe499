"""Amazon S3 and S3-compatible stores (SeaweedFS, MinIO, Ceph RGW...) through boto3.

One object per page, named ``<prefix><namespace>/<shard>/<part>/<page hash>``. Contract details:

* **Atomic**: S3 publishes an object whole on ``PutObject`` / ``CompleteMultipartUpload``, so a
  reader sees an old page, a new page or nothing, never a mix.
* **Reads** stream the response body into the caller's segments in order (no whole-value copy).
  A stored length that differs from the target's is a miss; so is an object whose S3 checksum
  (when the store returns one) does not match the bytes received.
* **Writes** send the caller's segments without joining them; pages above
  ``multipart_threshold`` go up as a multipart upload in ``multipart_part_size`` parts.
* **Batches** run on a thread pool of ``max_concurrency`` workers sharing one boto3 client
  (boto3 clients are thread-safe). Every public method is thread-safe.
* **Errors**: a missing bucket is a :class:`ConfigError`, bad credentials an
  :class:`AuthenticationError`, a refused request a :class:`PermissionDeniedError`, throttling a
  :class:`ThrottledError`, an unreachable or failing endpoint a :class:`BackendUnavailableError`
  or :class:`StorageTimeoutError`. A missing key is a miss. Secrets never appear in messages.

The credentials need ``s3:GetObject``, ``s3:PutObject``, ``s3:DeleteObject`` and
``s3:ListBucket``: without ListBucket, AWS answers a missing key with 403 instead of 404, which
this connector must report as :class:`PermissionDeniedError`, not as a miss.
"""

from __future__ import annotations

import base64
import io
import logging
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import pydantic

from hicache_storage.buffers import Segments, segments_size
from hicache_storage.capabilities import Capabilities
from hicache_storage.config import BackendConfig
from hicache_storage.errors import (
    AuthenticationError,
    BackendUnavailableError,
    ConfigError,
    ErrorStatus,
    MissingDependencyError,
    PermissionDeniedError,
    StorageError,
    StorageTimeoutError,
    ThrottledError,
)
from hicache_storage.connectors.per_key import PerKeyConnector
from hicache_storage.keys import Namespace, PageKey
from hicache_storage.redaction import LOG_REDACTOR

log = logging.getLogger(__name__)

MiB = 1 << 20
_MIN_PART = 5 * MiB  # S3's smallest part (all but the last)
_MAX_PARTS = 10_000
_READ_CHUNK = 4 * MiB  # bytes asked of the HTTP stream per readinto call
_DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys



class S3Config(BackendConfig):
    bucket: str = pydantic.Field(..., min_length=3, description="bucket holding the pages; it must exist")
    prefix: str = pydantic.Field("", description="object key prefix, e.g. 'kv-cache/'; a '/' is added if missing")
    endpoint_url: str | None = pydantic.Field(
        None, description="S3-compatible endpoint such as 'http://127.0.0.1:8333'; omit for AWS"
    )
    region: str | None = pydantic.Field(None, description="region name; omit to use the AWS config/env default")
    access_key_id: str | None = pydantic.Field(None, description="access key id; omit to use the AWS credential chain")
    secret_access_key: pydantic.SecretStr | None = pydantic.Field(None, description="secret key (given with access_key_id)")
    session_token: pydantic.SecretStr | None = pydantic.Field(None, description="session token for temporary credentials")
    profile: str | None = pydantic.Field(None, description="AWS config profile to take credentials and region from")
    addressing_style: Literal["path", "virtual", "auto"] = pydantic.Field(
        "path", description="'path' for most S3-compatible stores; 'virtual' or 'auto' for AWS"
    )
    verify: bool | str = pydantic.Field(True, description="verify TLS: true, false, or a CA bundle path")
    max_concurrency: int = pydantic.Field(16, ge=1, le=1024, description="parallel requests per batch (thread pool size)")
    max_attempts: int = pydantic.Field(3, ge=1, le=20, description="botocore attempts per request, first one included")
    retry_mode: Literal["standard", "adaptive", "legacy"] = pydantic.Field("standard", description="botocore retry mode")
    connect_timeout: float = pydantic.Field(5.0, gt=0, description="seconds to open a connection")
    read_timeout: float = pydantic.Field(30.0, gt=0, description="seconds to wait for data on an open connection")
    multipart_threshold: int = pydantic.Field(
        64 * MiB, ge=_MIN_PART, description="pages of more bytes than this go up as multipart uploads"
    )
    multipart_part_size: int = pydantic.Field(16 * MiB, ge=_MIN_PART, description="bytes per multipart part (>= 5 MiB)")
    checksum_algorithm: Literal["CRC32", "CRC32C"] | None = pydantic.Field(
        "CRC32",
        description="S3 checksum sent on writes (multipart: full-object) and checked on reads; null for stores "
        "that reject S3 checksums (CRC32C needs awscrt)",
    )

    @pydantic.field_validator("verify")
    @classmethod
    def _ca_bundle_exists(cls, verify: bool | str) -> bool | str:
        if isinstance(verify, str) and not Path(verify).expanduser().is_file():
            raise ValueError(f"CA bundle {verify!r} is not a file; give the path of a PEM bundle, or true/false")
        return verify

    @pydantic.field_validator("secret_access_key")
    @classmethod
    def _credentials_come_in_pairs(cls, secret: pydantic.SecretStr | None, info: pydantic.ValidationInfo) -> pydantic.SecretStr | None:
        # A field validator, not a model validator: its error is reported against this secret
        # field, whose value error messages mask.
        if (info.data.get("access_key_id") is None) != (secret is None):
            raise ValueError("give access_key_id and secret_access_key together, or neither to use the AWS credential chain")
        return secret


class S3Backend(PerKeyConnector):
    name = "s3"
    Config = S3Config
    config: S3Config
    capabilities = Capabilities(
        zero_copy_write=True,
        bounded_calls=True,  # botocore's connect_timeout and read_timeout (always set) bound every call
        delete=True,
        clear=True,
        persistent=True,
        shared_across_processes=True,
        outlives_writer=True,
        shared_across_hosts=True,
    )

    def __init__(self, config: S3Config | dict | str | None = None) -> None:
        super().__init__(config)
        cfg: S3Config = self.config
        try:
            import boto3
            import botocore.config
            import botocore.exceptions
        except ImportError as exc:
            raise MissingDependencyError("s3", exc.name or "boto3", "s3") from None
        if cfg.checksum_algorithm == "CRC32C":
            _crc32c_function()  # fail now, not on the first write
        self._prefix = cfg.prefix.lstrip("/")
        if self._prefix and not self._prefix.endswith("/"):
            self._prefix += "/"
        self._endpoint = _redact_url(cfg.endpoint_url) if cfg.endpoint_url else "AWS S3"
        self.capabilities = self.capabilities.replace(max_value_size=min(5 << 40, _MAX_PARTS * cfg.multipart_part_size))
        try:
            session = boto3.session.Session(profile_name=cfg.profile)
        except botocore.exceptions.ProfileNotFound:
            raise ConfigError(f"AWS profile {cfg.profile!r} is not in the AWS config files", field="profile", backend=self.name) from None
        client_config = botocore.config.Config(
            s3={"addressing_style": cfg.addressing_style},
            retries={"max_attempts": cfg.max_attempts, "mode": cfg.retry_mode},
            connect_timeout=cfg.connect_timeout,
            read_timeout=cfg.read_timeout,
            max_pool_connections=cfg.max_concurrency,
            # The connector computes and checks checksums itself (without copying the page);
            # botocore's own would read every body a second time.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        try:
            self._client = session.client(
                "s3",
                endpoint_url=cfg.endpoint_url,
                region_name=cfg.region,
                aws_access_key_id=cfg.access_key_id,
                aws_secret_access_key=cfg.secret_access_key.get_secret_value() if cfg.secret_access_key else None,
                aws_session_token=cfg.session_token.get_secret_value() if cfg.session_token else None,
                verify=cfg.verify,
                config=client_config,
            )
        except ValueError as exc:  # botocore's InvalidEndpoint / InvalidRegion
            raise ConfigError(
                f"botocore refused endpoint_url {self._endpoint!r} / region {cfg.region!r}: {type(exc).__name__}",
                field="endpoint_url",
                backend=self.name,
            ) from None
        # botocore's debug log prints the session token (a signed header); keep it out.
        self._log_secrets = [secret.get_secret_value() for secret in (cfg.secret_access_key, cfg.session_token) if secret]
        LOG_REDACTOR.add(self._log_secrets)
        self._pool = ThreadPoolExecutor(max_workers=cfg.max_concurrency, thread_name_prefix="hicache-s3")
        try:
            self._check_bucket()
        except BaseException:
            self._close()
            raise

    # --- hooks (exists, get, put and delete: PerKeyConnector's, over the calls below) -------

    def _clear(self, namespace: Namespace) -> None:
        prefix = f"{self._prefix}{namespace.fingerprint}/"
        paginator = self._client.get_paginator("list_objects_v2")
        pending: list[dict[str, str]] = []
        try:
            for page in paginator.paginate(Bucket=self.config.bucket, Prefix=prefix):
                pending.extend({"Key": item["Key"]} for item in page.get("Contents", ()))
                while len(pending) >= _DELETE_BATCH:
                    self._delete_objects(pending[:_DELETE_BATCH])
                    del pending[:_DELETE_BATCH]
            if pending:
                self._delete_objects(pending)
        except Exception as exc:
            self._raise(exc, "clear")

    def _close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()
        LOG_REDACTOR.remove(self._log_secrets)

    def __repr__(self) -> str:
        return f"<S3Backend endpoint={self._endpoint!r} bucket={self.config.bucket!r} prefix={self._prefix!r}>"

    # --- one key each -------------------------------------------------------------------------

    def _object_key(self, key: PageKey) -> str:
        return self._prefix + key.render("/")

    def _exists_one(self, key: PageKey) -> bool:
        try:
            self._client.head_object(Bucket=self.config.bucket, Key=self._object_key(key))
        except Exception as exc:
            if _error_code(exc) in _NOT_FOUND:
                return False
            raise
        return True

    def _get_one(self, key: PageKey, target: Segments) -> bool:
        algorithm = self.config.checksum_algorithm
        extra = {"ChecksumMode": "ENABLED"} if algorithm else {}
        try:
            response = self._client.get_object(Bucket=self.config.bucket, Key=self._object_key(key), **extra)
        except Exception as exc:
            if _error_code(exc) in _NOT_FOUND:
                return False
            raise
        body = response["Body"]
        try:
            if response.get("ContentLength") != segments_size(target):
                return False  # another layout's page, or a foreign object: a miss, never a partial fill
            _stream_into(body, target)
        finally:
            body.close()
        if algorithm:
            expected = response.get(f"Checksum{algorithm}")
            # A multipart object stored with a composite checksum ("<crc>-<parts>") cannot be
            # checked against the whole value; the length check above still applies.
            if expected and "-" not in expected and expected != _checksum(algorithm, target):
                log.warning("s3: checksum mismatch for %s; treating it as a miss", key)
                return False
        return True

    def _put_one(self, key: PageKey, source: Segments) -> bool:
        size = segments_size(source)
        if size > self.config.multipart_threshold:
            self._put_multipart(key, source, size)
            return True
        extra = {}
        algorithm = self.config.checksum_algorithm
        if algorithm:
            extra[f"Checksum{algorithm}"] = _checksum(algorithm, source)
        self._client.put_object(
            Bucket=self.config.bucket,
            Key=self._object_key(key),
            Body=_SegmentsReader(source),
            ContentLength=size,
            **extra,
        )
        return True

    def _put_multipart(self, key: PageKey, source: Segments, size: int) -> None:
        bucket, object_key = self.config.bucket, self._object_key(key)
        algorithm = self.config.checksum_algorithm
        create_extra = {"ChecksumAlgorithm": algorithm, "ChecksumType": "FULL_OBJECT"} if algorithm else {}
        upload_id = self._client.create_multipart_upload(Bucket=bucket, Key=object_key, **create_extra)["UploadId"]
        try:
            parts = []
            part_size = self.config.multipart_part_size
            for number, start in enumerate(range(0, size, part_size), start=1):
                part = _slice_segments(source, start, min(part_size, size - start))
                part_extra = {f"Checksum{algorithm}": _checksum(algorithm, part)} if algorithm else {}
                response = self._client.upload_part(
                    Bucket=bucket,
                    Key=object_key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=_SegmentsReader(part),
                    ContentLength=segments_size(part),
                    **part_extra,
                )
                parts.append({"PartNumber": number, "ETag": response["ETag"], **part_extra})
            complete_extra = (
                {f"Checksum{algorithm}": _checksum(algorithm, source), "ChecksumType": "FULL_OBJECT"} if algorithm else {}
            )
            self._client.complete_multipart_upload(
                Bucket=bucket, Key=object_key, UploadId=upload_id, MultipartUpload={"Parts": parts}, **complete_extra
            )
        except BaseException:
            try:
                self._client.abort_multipart_upload(Bucket=bucket, Key=object_key, UploadId=upload_id)
            except Exception:  # the store may be gone; it expires abandoned uploads itself
                log.debug("s3: could not abort multipart upload of %s", key, exc_info=True)
            raise

    def _delete_one(self, key: PageKey) -> bool:
        # S3's DeleteObject succeeds whether or not the key existed, so ask first.
        if not self._exists_one(key):
            return False
        self._client.delete_object(Bucket=self.config.bucket, Key=self._object_key(key))
        return True

    def _delete_objects(self, objects: list[dict[str, str]]) -> None:
        response = self._client.delete_objects(Bucket=self.config.bucket, Delete={"Objects": objects, "Quiet": True})
        errors = response.get("Errors") or []
        if errors:
            first = errors[0]
            code = str(first.get("Code") or "")
            message = (
                f"S3 refused to delete {len(errors)} of {len(objects)} objects, e.g. {first.get('Key')!r}: "
                f"{code} {first.get('Message', '')}".rstrip()
            )
            if code in _AUTH:
                raise AuthenticationError(f"{message}; check access_key_id / secret_access_key")
            if code in _DENIED:
                raise PermissionDeniedError(f"{message}; the key's policy must allow s3:DeleteObject")
            raise StorageError(message, status=ErrorStatus.TEMPORARY if code in _PASSING else ErrorStatus.PERMANENT)

    # --- batches, probing and errors ----------------------------------------------------------

    def _check_bucket(self) -> None:
        bucket = self.config.bucket
        try:
            self._client.head_bucket(Bucket=bucket)
        except Exception as exc:
            if _error_code(exc) == "403":
                # HEAD answers carry no body, so a bad secret and a denied request both read
                # "403"; a GET on the bucket tells them apart.
                try:
                    self._client.list_objects_v2(Bucket=bucket, MaxKeys=1)
                except Exception as detail:
                    exc = detail
            self._raise(exc, "connect")

    def _translate(self, exc: BaseException) -> StorageError | None:
        return _translate(exc, self._endpoint, self.config.bucket)


# --- streaming -----------------------------------------------------------------------------------


class _SegmentsReader(io.RawIOBase):
    """A seekable file over a page's segments; ``read`` hands out views, never copies.

    botocore reads the body to sign it and again to send it (and rewinds to retry), so it must
    be seekable and report its length.
    """

    def __init__(self, segments: Segments) -> None:
        super().__init__()
        self._segments = segments
        self._size = segments_size(segments)
        self._position = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def read(self, size: int = -1) -> bytes | memoryview:
        """Up to ``size`` bytes from one segment (a short read at segment ends, as files may do)."""
        if self._position >= self._size:
            return b""
        offset = self._position
        for view in self._segments:
            if offset < view.nbytes:
                end = view.nbytes if size is None or size < 0 else min(view.nbytes, offset + size)
                chunk = view[offset:end]
                self._position += chunk.nbytes
                return chunk
            offset -= view.nbytes
        return b""

    def readinto(self, buffer: Any) -> int:
        chunk = self.read(len(buffer))
        memoryview(buffer).cast("B")[: len(chunk)] = chunk
        return len(chunk)


def _stream_into(body: Any, target: Segments) -> None:
    """Fill ``target`` from a botocore StreamingBody, reading straight into the segments."""
    stream = getattr(body, "_raw_stream", None)
    if stream is None or not hasattr(stream, "readinto"):
        stream = body  # an unusual HTTP stack: fall back to read() copies
    for view in target:
        filled = 0
        while filled < view.nbytes:
            window = view[filled : filled + _READ_CHUNK]
            if hasattr(stream, "readinto"):
                count = stream.readinto(window)
            else:
                data = stream.read(window.nbytes)
                window[: len(data)] = data
                count = len(data)
            if not count:
                raise _TruncatedBody(f"the response ended after {filled} of {view.nbytes} bytes of a segment")
            filled += count


class _TruncatedBody(Exception):
    """The store closed the response before sending ContentLength bytes."""


def _slice_segments(segments: Segments, start: int, length: int) -> Segments:
    """Views of ``length`` bytes starting at ``start`` across ``segments`` (no copies)."""
    out: Segments = []
    for view in segments:
        if length <= 0:
            break
        if start >= view.nbytes:
            start -= view.nbytes
            continue
        piece = view[start : start + length]
        out.append(piece)
        length -= piece.nbytes
        start = 0
    return out


# --- checksums -----------------------------------------------------------------------------------


def _checksum(algorithm: str, segments: Segments) -> str:
    """S3's base64 of the big-endian CRC over the concatenated segments."""
    crc_function = zlib.crc32 if algorithm == "CRC32" else _crc32c_function()
    crc = 0
    for view in segments:
        crc = crc_function(view, crc)
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def _crc32c_function() -> Callable[[Any, int], int]:
    try:
        from awscrt import checksums
    except ImportError:
        raise MissingDependencyError("s3", "awscrt", None) from None
    return checksums.crc32c


# --- errors --------------------------------------------------------------------------------------

_NOT_FOUND = frozenset({"404", "NoSuchKey", "NotFound"})
_AUTH = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "InvalidClientTokenId", "AuthorizationHeaderMalformed"}
)
_THROTTLED = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests", "429"})
_DENIED = frozenset({"AccessDenied", "403", "AllAccessDisabled"})
#: Refusals that may pass: the server's own trouble, a request it timed out, a conflicting operation.
_PASSING = _THROTTLED | {"InternalError", "ServiceUnavailable", "RequestTimeout", "OperationAborted", "500", "503"}


def _error_response(exc: BaseException) -> dict[str, Any] | None:
    """The parsed response an exception carries (a botocore ``ClientError``'s), else ``None``."""
    response = getattr(exc, "response", None)
    return response if isinstance(response, dict) else None


def _error_code(exc: BaseException) -> str | None:
    response = _error_response(exc)
    if response is not None:
        return str(response.get("Error", {}).get("Code", "")) or None
    return None


def _translate(exc: BaseException, endpoint: str, bucket: str) -> StorageError | None:
    """A typed StorageError for a store or network failure (``None`` for anything else).

    Messages name the endpoint and bucket and carry no credentials.
    """
    from botocore import exceptions as bce

    code = _error_code(exc)
    response = _error_response(exc) or {}  # a dict wherever there is a code
    if code is not None:
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        detail = response.get("Error", {}).get("Message") or ""
        said = f"{code}{': ' + detail if detail else ''}"
        if code in ("NoSuchBucket",) or (code == "404" and getattr(exc, "operation_name", "") == "HeadBucket"):
            return ConfigError(
                f"bucket {bucket!r} does not exist at {endpoint}; create it or set 'bucket' to an existing one",
                field="bucket",
            )
        if code in _AUTH:
            return AuthenticationError(
                f"{endpoint} rejected the credentials ({said}); check access_key_id / secret_access_key"
            )
        if code == "403":  # a HEAD answer has no body, so a wrong secret and a denied request look alike
            return PermissionDeniedError(
                f"{endpoint} refused access to bucket {bucket!r} (HTTP 403 to a HEAD request, which gives no reason); "
                "check access_key_id / secret_access_key, then the key's policy"
            )
        if code in _DENIED:
            return PermissionDeniedError(f"{endpoint} denied access to bucket {bucket!r} ({said}); check the key's policy")
        if code in _THROTTLED or status == 503:
            return ThrottledError(f"{endpoint} asked to slow down ({said}); lower max_concurrency or retry later")
        if status is not None and status >= 500:
            return BackendUnavailableError(f"{endpoint} failed with HTTP {status} ({said})")
        if code in _PASSING or status in (408, 409):
            return StorageError(f"{endpoint} refused the request with HTTP {status} ({said}); it may pass", status=ErrorStatus.TEMPORARY)
        return StorageError(
            f"{endpoint} refused the request with HTTP {status} ({said}); the request or the store's settings need a fix",
            status=ErrorStatus.PERMANENT,
        )
    if isinstance(exc, (bce.ConnectTimeoutError, bce.ReadTimeoutError, TimeoutError)) or "timeout" in type(exc).__name__.lower():
        return StorageTimeoutError(f"{endpoint} did not answer in time ({type(exc).__name__}); check the store or raise the timeouts")
    if isinstance(exc, (bce.NoCredentialsError, bce.PartialCredentialsError)):
        return AuthenticationError(
            f"no usable AWS credentials for {endpoint}: set access_key_id and secret_access_key, a profile, "
            "or the AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY environment variables"
        )
    if isinstance(exc, bce.SSLError):
        return BackendUnavailableError(f"TLS to {endpoint} failed; set 'verify' to the store's CA bundle path")
    if isinstance(exc, (bce.BotoCoreError, _TruncatedBody, OSError)) or type(exc).__module__.startswith(("urllib3", "http.")):
        return BackendUnavailableError(f"cannot reach S3 endpoint {endpoint} ({type(exc).__name__}); is the store running?")
    return None


def _redact_url(url: str) -> str:
    """The URL without a ``user:password@`` part, safe for messages."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
