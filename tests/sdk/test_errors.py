"""Every error says whether trying again can help: a status apart from its kind, a default per
class, overridable per raise; the old class split still reads the same."""

from __future__ import annotations

import errno

import pytest

from hicache_storage import errors
from hicache_storage.connectors.redis.errors import reply_status
from hicache_storage.errors import ErrorStatus, PermanentError, RetryableError, StorageError
from hicache_storage.layers.faults import ERROR_KINDS


def concrete_errors() -> list[type[StorageError]]:
    return [value for value in vars(errors).values() if isinstance(value, type) and issubclass(value, StorageError)]


def make(kind: type[StorageError], **status) -> StorageError:
    if kind is errors.UnknownBackendError:
        return kind("nope", ["file"])
    if kind is errors.MissingDependencyError:
        return kind("s3", "boto3", "s3")
    return kind("message", **status)


@pytest.mark.parametrize("kind", concrete_errors(), ids=lambda k: k.__name__)
def test_every_class_has_a_status_and_the_old_split_agrees_with_it(kind):
    error = make(kind)
    assert error.status is kind.default_status
    assert error.retryable is (error.status is ErrorStatus.TEMPORARY)
    assert error.permanent is not error.retryable
    if issubclass(kind, RetryableError):
        assert error.retryable
    elif kind is not errors.CapacityError:  # space comes back: a full store is not given up
        assert error.permanent


def test_a_raise_overrides_its_class_default():
    assert StorageError("EIO", status=ErrorStatus.TEMPORARY).retryable
    assert not errors.BackendUnavailableError("TLS", status="permanent").retryable
    assert errors.ConfigError("x", field="f", status=ErrorStatus.TEMPORARY).retryable
    assert errors.StorageTimeoutError("slow", status=ErrorStatus.PERSISTENT).permanent
    assert isinstance(errors.AuthenticationError("bad"), PermanentError), "the old classes still catch"


def test_every_injectable_fault_kind_has_a_status():
    for kind, error in ERROR_KINDS.items():
        if issubclass(error, StorageError):
            assert make(error).status in ErrorStatus, kind


@pytest.mark.parametrize(
    ("reply", "status"),
    [
        ("LOADING Redis is loading the dataset in memory", ErrorStatus.TEMPORARY),
        ("BUSY Redis is busy running a script", ErrorStatus.TEMPORARY),
        ("READONLY You can't write against a read only replica.", ErrorStatus.TEMPORARY),
        ("WRONGTYPE Operation against a key holding the wrong kind of value", ErrorStatus.PERMANENT),
        ("ERR unknown command 'GETEX'", ErrorStatus.PERMANENT),
    ],
)
def test_redis_error_replies_of_no_other_kind(reply, status):
    assert reply_status(reply) is status


@pytest.mark.parametrize(
    ("number", "status"),
    [(errno.EIO, ErrorStatus.TEMPORARY), (errno.EMFILE, ErrorStatus.TEMPORARY),
     (errno.ENAMETOOLONG, ErrorStatus.PERMANENT), (errno.EINVAL, ErrorStatus.PERMANENT)],
    ids=lambda v: errno.errorcode[v] if isinstance(v, int) else v.value,
)
def test_the_errno_decides_a_file_errors_status(tmp_path, monkeypatch, number, status):
    import os

    from hicache_storage import KeyScope, Namespace, Store, create_backend

    def failing(*args: object) -> int:
        raise OSError(number, os.strerror(number))

    store = Store(create_backend("file", {"root": str(tmp_path / "kv")}))
    monkeypatch.setattr(os, "pwritev", failing)
    try:
        with pytest.raises(StorageError) as caught:
            store.put([KeyScope(Namespace("m", "bfloat16", 16)).key("0" * 64)], [b"page"])
        assert type(caught.value) is StorageError and caught.value.status is status
    finally:
        store.close()
