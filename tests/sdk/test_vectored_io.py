"""Whole-buffer vectored I/O continues short transfers and chunks long buffer lists."""

import os

import pytest

from hicache_storage import vectored_io
from hicache_storage.vectored_io import preadv_full, pwritev_full


@pytest.fixture
def short_transfers(monkeypatch):
    """The kernel moves at most 3 bytes and 2 buffers per call."""
    real_read, real_write = os.preadv, os.pwritev
    monkeypatch.setattr(vectored_io, "IOV_MAX", 2)
    monkeypatch.setattr(os, "preadv", lambda fd, views, offset: real_read(fd, [views[0][:3]], offset))
    monkeypatch.setattr(os, "pwritev", lambda fd, views, offset: real_write(fd, [views[0][:3]], offset))


def test_short_transfers_are_continued(tmp_path, short_transfers):
    data = bytes(range(40))
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        pwritev_full(fd, [memoryview(data[:7]), memoryview(data[7:8]), memoryview(data[8:])], 5)
        targets = [bytearray(10), bytearray(1), bytearray(29)]
        assert preadv_full(fd, [memoryview(t) for t in targets], 5, 40) == 40
        assert b"".join(targets) == data
        assert preadv_full(fd, [memoryview(bytearray(40))], 20, 40) == 25  # the file ends first
    finally:
        os.close(fd)


def test_a_write_that_makes_no_progress_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "pwritev", lambda fd, views, offset: 0)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(OSError, match="no progress"):
            pwritev_full(fd, [memoryview(b"abc")], 0)
    finally:
        os.close(fd)
