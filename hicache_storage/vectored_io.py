"""Whole-buffer ``preadv`` / ``pwritev``: a short transfer is continued, never taken as done.

The file-backed connectors move a page straight between a file and the caller's segments. The
kernel may transfer fewer bytes than asked, and takes at most ``IOV_MAX`` buffers per call; these
helpers loop until the segments are full (or the file ends) and chunk the buffer list.
"""

from __future__ import annotations

import errno
import os

try:
    IOV_MAX = os.sysconf("SC_IOV_MAX")
except (AttributeError, ValueError, OSError):  # pragma: no cover - Linux always has it
    IOV_MAX = 1024


def advance(views: list[memoryview], done: int) -> list[memoryview]:
    """The views left after ``done`` bytes of them were transferred."""
    rest = list(views)
    while rest and done >= rest[0].nbytes:
        done -= rest.pop(0).nbytes
    if rest and done:
        rest[0] = rest[0][done:]
    return rest


def preadv_full(fd: int, views: list[memoryview], offset: int, want: int) -> int:
    """Read from ``offset`` into ``views`` until ``want`` bytes or end of file; returns bytes read."""
    done = 0
    rest = views
    while done < want and rest:
        n = os.preadv(fd, rest[:IOV_MAX], offset + done)
        if n == 0:
            break
        done += n
        rest = advance(rest, n)
    return done


def pwritev_full(fd: int, views: list[memoryview], offset: int) -> None:
    """Write all of ``views`` at ``offset``; a write that makes no progress raises ``OSError(EIO)``."""
    done = 0
    rest = views
    while rest:
        n = os.pwritev(fd, rest[:IOV_MAX], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        done += n
        rest = advance(rest, n)
