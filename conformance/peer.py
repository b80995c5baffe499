"""The other process in the cross-process clauses: reads a page, writes one, reports both as JSON.

Run as ``python -m hicache_storage.conformance.peer``. It reads one JSON request line on stdin,
answers with one JSON line on stdout (the page it read, the page it wrote, both in hex) and
then, if the request says ``stay``, keeps its backend open until it reads another line, so the
caller can read the written page while this process still runs. It closes its backend and exits.
"""

from __future__ import annotations

import json
import sys

from hicache_storage.conformance.pages import page_for
from hicache_storage.keys import KeyScope, Namespace
from hicache_storage.spec import open_store, store_spec


def main() -> int:
    request = json.loads(sys.stdin.readline())
    fields = {k: v for k, v in request["namespace"].items() if k != "fingerprint"}
    scope = KeyScope(Namespace(**fields))
    with open_store(store_spec(request["backend"], request["config"], request.get("layers"))) as store:
        size = request["size"]
        [read] = store.get([scope.key(request["read"])], size)
        key = scope.key(request["write"])
        written = page_for(key, size)
        assert store.put([key], [written]) == [True], "the peer's put failed"
        answer = {"read": read.hex() if read is not None else None, "wrote": written.hex()}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
        if request.get("stay"):
            sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
