"""Transitional: the old home of the layers, now :mod:`hicache_storage.layers` (old names in :mod:`hicache_storage.compat`)."""

from hicache_storage.compat import _RENAMED, wrap
from hicache_storage.layers import *  # noqa: F403

globals().update({name: value for name, (value, _) in _RENAMED.items()})
