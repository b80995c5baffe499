"""How every deprecation in this package is said: the old name, its replacement, and when it goes.

Imports nothing of the package, so any module can warn without an import cycle; the old names
themselves live in :mod:`hicache_storage.compat`.
"""

from __future__ import annotations

import warnings


def renamed_message(old: str, new: str) -> str:
    """``old`` is now ``new``, and the old name goes in the next release."""
    return f"{old} is deprecated: use {new} (the old name is removed in the next release)"


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """One :class:`DeprecationWarning` with :func:`renamed_message`."""
    warnings.warn(renamed_message(old, new), DeprecationWarning, stacklevel=stacklevel)
