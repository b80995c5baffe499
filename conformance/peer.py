"""The other process in the cross-process clause: reads a page, writes one, reports both as JSON.

Run as ``python -m hicache_storage.conformance.peer`` with a JSON request on stdin.
"""

from __future__ import annotations

import json
import os
import sys

from hicache_storage.keys import KeyScope, Namespace
from hicache_storage.registry import create_backend


def main() -> int:
    request = json.load(sys.stdin)
    fields = {k: v for k, v in request["namespace"].items() if k != "fingerprint"}
    scope = KeyScope(Namespace(**fields))
    store = create_backend(request["backend"], request["config"])
    if request.get("wrappers"):
        from hicache_storage.wrappers import wrap

        store = wrap(store, request["wrappers"])
    with store:
        size = request["size"]
        [read] = store.get([scope.key(request["read"])], size)
        written = os.urandom(size)
        assert store.put([scope.key(request["write"])], [written]) == [True]
    json.dump({"read": read.hex() if read is not None else None, "wrote": written.hex()}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
