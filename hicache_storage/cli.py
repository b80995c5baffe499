"""The ``hicache-storage`` command: list backends, run the conformance suite, benchmark a backend's I/O,
and the commands other packages register (``bench``, the multi-turn benchmark that runs the HiCache
core: see :mod:`hicache_storage.commands`).

Every bad input (an unknown command or option, a value of the wrong form, a config or store spec
that cannot be used, a server that does not answer when the command starts) is one line on
stderr that says what was wrong, and exit status 2, before any work starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

from hicache_storage.commands import UsageError, add_plugin_commands, at_least
from hicache_storage.config import parse_size
from hicache_storage.conformance.preflight import one_line
from hicache_storage.errors import StorageError

T = TypeVar("T")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (StorageError, UsageError) as exc:
        print(f"hicache-storage: error: {one_line(str(exc))}", file=sys.stderr)
        return 2


class OneLineParser(argparse.ArgumentParser):
    """An argument parser that reports a bad argument as one line naming where the usage is
    (argparse's own prints the whole usage first), with exit status 2. Subcommands inherit it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="hicache-storage",
        description="Storage backends for the L3 tier of hierarchical KV caches (SGLang HiCache).",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    listing = commands.add_parser("list", help="list backends: availability, missing extras, capabilities")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.set_defaults(run=run_list)

    describe = commands.add_parser(
        "describe",
        help="open a store from a spec and print what it is now: its levels and their live capabilities (JSON)",
        description="Open the store a spec names (backend, config, layers; see hicache_storage.spec.StoreSpec), "
        "print its levels, outermost first, with the capabilities each has once open, then close it. "
        "`list` shows what each connector class declares; this shows what an instance says after connecting.",
    )
    describe.add_argument("spec", help='a store spec: a JSON object such as \'{"backend": "memory"}\' or @path (json, toml, yaml)')
    describe.set_defaults(run=run_describe)

    conformance = commands.add_parser(
        "conformance",
        help="run the conformance suite against a backend and write a report",
        description="Run the shared conformance suite against one backend. Exits non-zero if any clause "
        "fails or if no clause executed.",
    )
    conformance.add_argument("backend", help="registered name or package.module:Class")
    conformance.add_argument("--config", help="backend config: a JSON object or @path (json, toml, yaml)")
    conformance.add_argument("--layers", help="layer specs, innermost first, as a JSON list, e.g. '[{\"kind\": \"integrity\"}]'")
    conformance.add_argument("--wrappers", dest="old_layers", help=argparse.SUPPRESS)  # the old name of --layers
    conformance.add_argument(
        "--report-dir", default="conformance-report", help="directory for <backend>.json and <backend>.md (default: %(default)s)"
    )
    conformance.add_argument("--report-name", help="report file stem (default: the backend name)")
    conformance.add_argument("--quick", action="store_true", help="skip the slow clauses (concurrency, processes, state machine)")
    conformance.add_argument("-k", dest="keyword", help="only clauses matching this pytest -k expression")
    conformance.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failing clause")
    conformance.set_defaults(run=run_conformance)

    bench_io = commands.add_parser(
        "bench-io",
        help="storage microbenchmark: SDK vs the raw client, zero-copy vs copy, page_first vs layer_first",
        description="Batch put/get/exists throughput and latency percentiles of one backend, with the raw "
        "client doing the same I/O in the same run so the SDK's overhead shows as a ratio.",
    )
    bench_io.add_argument("backend", help="registered name or package.module:Class")
    bench_io.add_argument("--config", help="backend config: a JSON object or @path (json, toml, yaml)")
    bench_io.add_argument("--layers", help="layer specs as a JSON list (measured as part of the SDK path)")
    bench_io.add_argument("--wrappers", dest="old_layers", help=argparse.SUPPRESS)  # the old name of --layers
    bench_io.add_argument("--page-sizes", default="64K,1M,4M", help="comma-separated page sizes (default: %(default)s)")
    bench_io.add_argument("--batch-sizes", default="1,16,64", help="comma-separated pages per call (default: %(default)s)")
    bench_io.add_argument("--bytes-per-case", default="64M", help="bytes moved per page size and batch (default: %(default)s)")
    bench_io.add_argument("--out", default="results", help="directory for bench-io-<backend>.{json,md} (default: %(default)s)")
    bench_io.set_defaults(run=run_bench_io)

    add_plugin_commands(commands)
    return parser


def positive_size(text: str) -> int:
    """``64K``, ``1M``, ``4M``, ``1G`` or a plain number of bytes (:func:`~hicache_storage.config.parse_size`), above 0."""
    try:
        value = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text.strip()!r} (use e.g. 64K, 1M, 4M)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text.strip()!r}")
    return value


def _usable(option: str, parse: Callable[[str], T], text: str) -> T:
    """``parse(text)``, or a :class:`UsageError` naming ``option`` (for options parsed after argparse)."""
    try:
        return parse(text)
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"{option}: {exc}") from None


def layer_option(args: argparse.Namespace) -> str | None:
    """``--layers``, or ``--wrappers`` (its old name: one line on stderr says so); both is a usage error."""
    if args.old_layers is None:
        return args.layers
    if args.layers is not None:
        raise UsageError("--wrappers is the old name of --layers: give --layers only")
    from hicache_storage.deprecation import renamed_message

    print(f"hicache-storage: {renamed_message('--wrappers', '--layers')}", file=sys.stderr)
    args.layers = args.old_layers
    return args.layers


def run_bench_io(args: argparse.Namespace) -> int:
    from hicache_storage.benchmarks.storage_io.measure import render_markdown, run_bench_io, write_results
    from hicache_storage.spec import open_store, store_spec

    page_sizes = [_usable("bench-io --page-sizes", positive_size, s) for s in args.page_sizes.split(",")]
    batch_sizes = [_usable("bench-io --batch-sizes", at_least(1), s) for s in args.batch_sizes.split(",")]
    bytes_per_case = _usable("bench-io --bytes-per-case", positive_size, args.bytes_per_case)
    with open_store(store_spec(args.backend, args.config, layer_option(args))) as store:
        result = run_bench_io(store, page_sizes=page_sizes, batch_sizes=batch_sizes, bytes_per_case=bytes_per_case)
    print(render_markdown(result))
    print(f"written: {write_results(result, Path(args.out))}")
    return 0


def run_describe(args: argparse.Namespace) -> int:
    from hicache_storage.spec import open_store

    with open_store(args.spec) as store:
        print(json.dumps(store.describe(), indent=2))
    return 0


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


#: What the conformance suite imports to run, all in the ``conformance`` extra.
CONFORMANCE_MODULES = ("pytest", "hypothesis")


def run_conformance(args: argparse.Namespace) -> int:
    missing = [name for name in CONFORMANCE_MODULES if not _importable(name)]
    if missing:
        print(
            f"hicache-storage conformance: the suite runs on {' and '.join(CONFORMANCE_MODULES)}, and "
            f"{', '.join(missing)} is not installed; install the extra: pip install 'hicache-storage[conformance]'",
            file=sys.stderr,
        )
        return 2
    import pytest

    from hicache_storage.conformance.preflight import check_options, one_line

    try:
        # One error here, before any clause runs, instead of the same error from every clause.
        check_options(args.backend, args.config, layer_option(args))
    except StorageError as exc:
        print(f"hicache-storage conformance: {one_line(str(exc))}", file=sys.stderr)
        return 2
    report_dir = Path(args.report_dir)
    stem = report_dir / (args.report_name or args.backend.replace(":", "-").replace("/", "-"))
    with tempfile.TemporaryDirectory(prefix="hicache-conformance-") as scratch:
        # An empty ini file and rootdir: the caller's own pytest configuration must not leak in.
        ini = Path(scratch) / "pytest.ini"
        ini.write_text("[pytest]\n")
        pytest_args = ["-c", str(ini), "--rootdir", scratch, "-p", "no:cacheprovider", "-q", "-rfE"]
        pytest_args += ["--pyargs", "hicache_storage.conformance", "--hicache-backend", args.backend]
        pytest_args += ["--hicache-report", str(stem)]
        if args.config:
            pytest_args += ["--hicache-config", args.config]
        if args.layers:
            pytest_args += ["--hicache-layers", args.layers]
        if args.quick:
            pytest_args += ["-m", "not slow"]
        if args.keyword:
            pytest_args += ["-k", args.keyword]
        if args.exitfirst:
            pytest_args += ["-x"]
        exit_code = int(pytest.main(pytest_args))
    report_json = stem.parent / f"{stem.name}.json"  # not with_suffix: a dotted module path has no suffix
    if not report_json.exists():
        print(f"hicache-storage: no report was written ({report_json}); pytest exited {exit_code}", file=sys.stderr)
        return exit_code or 1
    data = json.loads(report_json.read_text())
    counts = data["counts"]
    print(f"report: {stem.parent / f'{stem.name}.md'} ({', '.join(f'{n} {k}' for k, n in counts.items())})")
    if not data["ok"]:
        return exit_code or 1
    return exit_code


def _importable(module: str) -> bool:
    # Found, not imported: a plugin imported before pytest.main cannot have its asserts rewritten.
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
