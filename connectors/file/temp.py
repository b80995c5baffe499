"""The file backend's temp files: names that say who wrote them, and cleanup after dead writers.

Pages and ``namespace.json`` files are written to ``<root>/.tmp`` (on the root's filesystem, so a
rename publishes them) under a name ``host.pid.start.token.kind``: host and pid say which process
writes it, ``start`` (the process's start time) tells a reused pid apart. When a backend starts on
a root it removes the leftovers of writers that are certainly dead, and anything older than
:data:`STALE_TEMP_AGE_S` whose writer it cannot check (another host's).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import time

from hicache_storage.errors import ConfigError

# The file backend's logger, so one name configures everything that backend does.
logger = logging.getLogger("hicache_storage.connectors.file")

#: The directory under the root holding temp files and the trash of cleared namespaces.
TMP_DIR = ".tmp"
#: A temp file whose writer we cannot prove dead is removed once it is this old.
STALE_TEMP_AGE_S = 3600.0


class TempNames:
    """Fresh, unique paths in one temp directory, each naming this process as its writer.

    Recomputes the writer's name after a fork, so a child's temp files name the child.
    Thread-safe: threads racing on the first call compute the same name.
    """

    def __init__(self, tmp_dir: str) -> None:
        self._tmp = tmp_dir
        self._writer = (0, "")  # (pid, tag) naming our temp files; recomputed after a fork

    def path(self, suffix: str) -> str:
        """A path no other writer uses, ending in ``.suffix`` (``tmp``, ``trash``, ``probe``)."""
        pid, tag = self._writer
        if pid != os.getpid():  # first use, or a forked child: name temp files after this process
            pid = os.getpid()
            tag = f"{host_tag()}.{pid}.{process_start(pid)}"
            self._writer = (pid, tag)
        return f"{self._tmp}/{tag}.{secrets.token_hex(8)}.{suffix}"


def prepare_tmp_dir(tmp_dir: str) -> None:
    """Make ``tmp_dir`` 0o700 if missing; ``ConfigError`` if it is a symlink or a file, or cannot be made."""
    try:
        os.mkdir(tmp_dir, 0o700)
        os.chmod(tmp_dir, 0o700)
    except FileExistsError:
        st = os.lstat(tmp_dir)
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(
                f"{tmp_dir!r} must be a real directory (it is a symlink or a file); remove it",
                field="root",
                backend="file",
            ) from None
    except OSError as exc:
        raise ConfigError(
            f"cannot create {tmp_dir!r} ({exc.strerror}); root must be a directory this process can write",
            field="root",
            backend="file",
        ) from None


def remove_stale_temp(tmp_dir: str) -> int:
    """Remove temp files and trash left by dead writers; returns how many were removed.

    What cannot be removed is logged and left; a file that vanishes meanwhile is skipped.
    """
    removed = 0
    now = time.time()
    host = host_tag()
    with os.scandir(tmp_dir) as entries:
        leftovers = list(entries)
    for entry in leftovers:
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue  # its writer just published or removed it
        if not writer_is_gone(entry.name, host) and age < STALE_TEMP_AGE_S:
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed += 1
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("file backend: cannot remove stale temp %s (%s)", entry.path, exc.strerror or exc)
    if removed:
        logger.info("file backend: removed %d stale temp files under %s", removed, tmp_dir)
    return removed


def unlink_quietly(path: str) -> None:
    """Remove a file that may already be gone."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def host_tag() -> str:
    """This host's name as a temp-name component: lowercase ``[0-9a-z-]``, at most 63 characters."""
    return re.sub(r"[^0-9a-z-]", "-", socket.gethostname().lower())[:63] or "host"


def process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux), so a reused pid is told apart; "0" if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()
    except (OSError, IndexError):
        return "0"


def writer_is_gone(temp_name: str, host: str) -> bool:
    """Whether the writer named in a temp file's name (host.pid.start.token.kind) is certainly dead."""
    fields = temp_name.split(".")
    if len(fields) != 5 or fields[0] != host or not fields[1].isdigit():
        return False
    pid, start = int(fields[1]), fields[2]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, owned by someone else
    return start != "0" and process_start(pid) != start
