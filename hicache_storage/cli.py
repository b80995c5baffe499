"""The ``hicache-storage`` command: list backends, run the conformance suite (more to come)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from hicache_storage.errors import StorageError


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except StorageError as exc:
        print(f"hicache-storage: error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hicache-storage",
        description="Storage backends for the L3 tier of hierarchical KV caches (SGLang HiCache).",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    listing = commands.add_parser("list", help="list backends: availability, missing extras, capabilities")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.set_defaults(run=run_list)

    conformance = commands.add_parser(
        "conformance",
        help="run the conformance suite against a backend and write a report",
        description="Run the shared conformance suite against one backend. Exits non-zero if any clause "
        "fails or if no clause executed.",
    )
    conformance.add_argument("backend", help="registered name or package.module:Class")
    conformance.add_argument("--config", help="backend config: a JSON object or @path (json, toml, yaml)")
    conformance.add_argument("--wrappers", help="wrapper specs as a JSON list, e.g. '[{\"kind\": \"integrity\"}]'")
    conformance.add_argument(
        "--report-dir", default="conformance-report", help="directory for <backend>.json and <backend>.md (default: %(default)s)"
    )
    conformance.add_argument("--quick", action="store_true", help="skip the slow clauses (concurrency, processes, state machine)")
    conformance.add_argument("-k", dest="keyword", help="only clauses matching this pytest -k expression")
    conformance.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failing clause")
    conformance.set_defaults(run=run_conformance)
    return parser


def run_list(args: argparse.Namespace) -> int:
    from hicache_storage.registry import describe_backends

    infos = describe_backends()
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": info.spec.name,
                        "origin": info.spec.origin,
                        "target": info.spec.target,
                        "available": info.available,
                        "missing": info.missing,
                        "install": f"pip install 'hicache-storage[{info.spec.extra}]'" if info.missing and info.spec.extra else None,
                        "capabilities": info.capabilities.as_dict() if info.capabilities else None,
                        "error": info.error,
                    }
                    for info in infos
                ],
                indent=2,
            )
        )
        return 0
    rows = [("NAME", "AVAILABLE", "ORIGIN", "CAPABILITIES / WHAT IS MISSING")]
    for info in infos:
        if info.missing:
            hint = f"pip install 'hicache-storage[{info.spec.extra}]'" if info.spec.extra else "pip install " + " ".join(info.missing)
            detail = f"missing {', '.join(info.missing)}: {hint}"
        elif info.error:
            detail = f"cannot load: {info.error}"
        else:
            caps = info.capabilities.as_dict() if info.capabilities else {}
            detail = ", ".join(k if v is True else f"{k}={v}" for k, v in caps.items() if v not in (False, None))
        rows.append((info.spec.name, "yes" if info.available else "no", info.spec.origin, detail))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    return 0


def run_conformance(args: argparse.Namespace) -> int:
    import pytest

    from hicache_storage.registry import resolve

    resolve(args.backend)  # fail fast, with the registry's error, on an unknown name or missing extra
    report_dir = Path(args.report_dir)
    stem = report_dir / args.backend.replace(":", "-").replace("/", "-")
    with tempfile.TemporaryDirectory(prefix="hicache-conformance-") as scratch:
        # An empty ini file and rootdir: the caller's own pytest configuration must not leak in.
        ini = Path(scratch) / "pytest.ini"
        ini.write_text("[pytest]\n")
        pytest_args = ["-c", str(ini), "--rootdir", scratch, "-p", "no:cacheprovider", "-q", "-rfE"]
        pytest_args += ["--pyargs", "hicache_storage.conformance", "--hicache-backend", args.backend]
        pytest_args += ["--hicache-report", str(stem)]
        if args.config:
            pytest_args += ["--hicache-config", args.config]
        if args.wrappers:
            pytest_args += ["--hicache-wrappers", args.wrappers]
        if args.quick:
            pytest_args += ["-m", "not slow"]
        if args.keyword:
            pytest_args += ["-k", args.keyword]
        if args.exitfirst:
            pytest_args += ["-x"]
        exit_code = int(pytest.main(pytest_args))
    report_json = stem.with_suffix(".json")
    if not report_json.exists():
        print(f"hicache-storage: no report was written ({report_json}); pytest exited {exit_code}", file=sys.stderr)
        return exit_code or 1
    data = json.loads(report_json.read_text())
    counts = data["counts"]
    print(f"report: {stem.with_suffix('.md')} ({', '.join(f'{n} {k}' for k, n in counts.items())})")
    if not data["ok"]:
        return exit_code or 1
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
