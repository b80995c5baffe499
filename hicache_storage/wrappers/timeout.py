"""Transitional: the old path of :mod:`hicache_storage.layers.timeout`."""


from hicache_storage.compat import _RENAMED
from hicache_storage.layers import timeout as _new

globals().update({k: v for k, v in vars(_new).items() if not k.startswith("__")})
globals().update({name: value for name, (value, _) in _RENAMED.items()})
