"""The file backend's directory tree: where a key's page lives, and directories checked to be real.

Layout below the root (every name is ``[0-9a-z_-]``, so nothing can climb out of it)::

    <namespace fingerprint>/<shard>/<part>/<hash[:2]>/<hash>

Every directory between the root and a page must be a real directory: a symlink in its place is
refused (it could lead out of the root). The root itself is created 0o700 and never a symlink.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import sys
from typing import Any

from hicache_storage.errors import ConfigError, ErrorStatus, InvalidKeyError, PermissionDeniedError, StorageError
from hicache_storage.keys import PageKey

# The file backend's logger, so one name configures everything that backend does.
logger = logging.getLogger("hicache_storage.connectors.file")

#: One name below the root: a namespace fingerprint, shard, part, fan-out or page hash.
COMPONENT_RE = re.compile(r"[0-9a-z][0-9a-z_-]{0,127}")
#: Names from the root to a page file: namespace / shard / part / fan-out / page.
PAGE_DEPTH = 5


class DirectoriesVanished(Exception):
    """A concurrent clear() kept removing a page's directories while it was being written."""


def locate(key: PageKey) -> tuple[str, str]:
    """(relative directory, relative file path) for ``key``; ``InvalidKeyError`` unless it renders to 4 safe names."""
    rendered = key.render("/")
    parts = rendered.split("/")
    if len(parts) != 4 or not all(COMPONENT_RE.fullmatch(part) for part in parts):
        raise InvalidKeyError(
            f"key renders to {rendered!r}; the file backend needs 4 '/'-separated names of [0-9a-z_-] "
            "starting with a letter or digit (build keys with KeyScope.key)",
            backend="file",
        )
    page_hash = parts[3]
    rel_dir = f"{parts[0]}/{parts[1]}/{parts[2]}/{page_hash[:2]}"
    return rel_dir, f"{rel_dir}/{page_hash}"


class PageDirectories:
    """The directories under ``root`` known to be real, checked (or made) once each.

    Also remembers which namespace directories have their ``namespace.json`` written, since both
    facts go stale together when a namespace is cleared. Safe to call from several threads: a
    stale or missing entry only costs the system calls of checking again.
    """

    def __init__(self, root: str, *, fsync: bool) -> None:
        self._root = root
        self._fsync = fsync
        self._verified: set[str] = set()  # relative dirs known to be real directories
        self._described: set[str] = set()  # namespace dirs whose namespace.json exists

    def verify(self, rel_dir: str, *, create: bool) -> bool:
        """Check each directory from the root down to ``rel_dir``, making missing ones with ``create``.

        Returns ``False`` if one is missing (never with ``create``; if a concurrent ``clear()``
        keeps removing them, raises :class:`DirectoriesVanished`). Raises ``PermissionDeniedError``
        for a symlink in place of a directory. Checked directories are remembered, so a page's
        directories cost system calls only the first time.
        """
        if rel_dir in self._verified:
            return True
        if not create:
            return self._walk(rel_dir, create=False)
        for _ in range(3):  # a concurrent clear() can remove a parent while we descend
            if self._walk(rel_dir, create=True):
                return True
            self.forget(rel_dir)
        raise DirectoriesVanished(rel_dir)

    def forget(self, rel_dir: str) -> None:
        """Check ``rel_dir`` and its parents again next time (they vanished behind our back)."""
        names = rel_dir.split("/")
        for depth in range(1, len(names) + 1):
            self._verified.discard("/".join(names[:depth]))
        self._described.discard(names[0])

    def forget_namespace(self, top: str) -> None:
        """Forget everything known under the namespace directory ``top`` (it was cleared)."""
        prefix = top + "/"
        known = self._verified.copy()
        self._verified = {rel for rel in known if rel != top and not rel.startswith(prefix)}
        self._described.discard(top)

    def is_described(self, top: str) -> bool:
        """Whether ``<top>/namespace.json`` is known to exist."""
        return top in self._described

    def mark_described(self, top: str) -> None:
        """Record that ``<top>/namespace.json`` exists."""
        self._described.add(top)

    def _walk(self, rel_dir: str, *, create: bool) -> bool:
        names = rel_dir.split("/")
        for depth in range(1, len(names) + 1):
            rel = "/".join(names[:depth])
            if rel in self._verified:
                continue
            path = f"{self._root}/{rel}"
            if create:
                try:
                    os.mkdir(path, 0o700)
                    os.chmod(path, 0o700)  # mkdir's mode is narrowed by the umask; make it exactly owner-only
                    if self._fsync:
                        fsync_dir(os.path.dirname(path))
                    self._verified.add(rel)
                    continue
                except FileExistsError:
                    pass
                except FileNotFoundError:
                    return False
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return False
            if stat.S_ISLNK(st.st_mode):
                raise PermissionDeniedError(
                    f"{path!r} is a symlink; the file backend never follows symlinks under its root "
                    "(one could lead out of it). Remove the link or use a root without links inside.",
                    backend="file",
                )
            if not stat.S_ISDIR(st.st_mode):
                raise StorageError(
                    f"{path!r} should be a directory of pages but is not; remove it",
                    backend="file",
                    status=ErrorStatus.PERMANENT,
                )
            self._verified.add(rel)
        return True


def prepare_root(root: str) -> str:
    """The absolute root, created 0o700 if missing; refuses a symlink or a non-directory."""
    path = os.path.abspath(os.path.expanduser(root))
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # the latter: a file where a parent should be
        try:
            os.makedirs(path, mode=0o700)
            os.chmod(path, 0o700)
        except FileExistsError:
            return prepare_root(path)  # another process made it first: check what it made
        except OSError as exc:
            raise ConfigError(f"cannot create root {path!r}: {exc.strerror}", field="root", backend="file") from None
        return path
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(
            f"root {path!r} is a symlink (to {os.readlink(path)!r}); pass the real directory "
            f"({os.path.realpath(path)!r}) so nothing under the root is reached through a link",
            field="root",
            backend="file",
        )
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"root {path!r} exists and is not a directory; pass a directory, or a path to create one at", field="root", backend="file")
    return path


def remove_tree(path: str) -> None:
    """Remove a cleared namespace's tree; what cannot be removed is logged, not raised."""
    if os.path.islink(path):
        os.unlink(path)
        return

    def report(_function: object, failed: str, error: Any) -> None:
        # onexc passes the exception, the older onerror an exc_info tuple.
        reason = error[1] if isinstance(error, tuple) else error
        logger.warning("file backend: cannot remove %s while clearing (%s)", failed, reason)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=report)
    else:
        shutil.rmtree(path, onerror=report)


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
