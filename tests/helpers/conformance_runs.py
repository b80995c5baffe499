"""Run ``hicache-storage conformance`` several times in one process: ``python conformance_runs.py``.

Reads a JSON object ``{name: [argv...]}`` from RUNS_FILE; for each name, in order, calls the CLI's
``main(argv)`` as ``python -m hicache_storage.cli`` would, with the process's stdout and stderr
going to ``<log_dir>/<name>.log``, and prints ``{"name": ..., "exit": ...}`` as one JSON line once
that run is over. A run still going after ``RUN_TIMEOUT_S`` has every thread's stack written to
its log and ends the process. A process pays the CLI's start (torch, pytest, hypothesis: seconds) once for
all its runs, not once per run. Each run is its own pytest session on fresh namespaces; modules
the first run imported (the suite's, assertion-rewritten) serve the later ones.

Usage: ``python conformance_runs.py LOG_DIR RUNS_FILE``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

from hicache_storage.cli import main

#: As long as one run of the CLI was given when each ran in a process of its own.
RUN_TIMEOUT_S = 300


def run_logged(argv: list[str], log: Path) -> int:
    """``main(argv)`` with file descriptors 1 and 2 (and so every writer in the run) on ``log``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with log.open("w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        # to the log's own descriptor: pytest's capture moves fd 2 elsewhere during each clause
        faulthandler.dump_traceback_later(RUN_TIMEOUT_S, exit=True, file=out)
        try:
            return main(argv)
        except SystemExit as exc:  # pytest.UsageError and argparse exit through here
            return exc.code if isinstance(exc.code, int) else 1
        finally:
            faulthandler.cancel_dump_traceback_later()
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


if __name__ == "__main__":
    log_dir, runs_file = Path(sys.argv[1]), Path(sys.argv[2])
    for name, argv in json.loads(runs_file.read_text()).items():
        code = run_logged(argv, log_dir / f"{name}.log")
        print(json.dumps({"name": name, "exit": code}), flush=True)
