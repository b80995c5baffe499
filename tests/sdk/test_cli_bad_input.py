"""Every bad input to ``hicache-storage``: exit status 2 and one line on stderr that names it, before
any work starts (no progress bar, no output, nothing written).

The table runs the CLI's ``main`` in this process (argparse's own errors exit through
``SystemExit``); one case runs the real command in a subprocess, for the process's exit status.
``test_cli_conformance_errors.py`` covers the conformance command's bad configs and servers in
depth, ``test_bench_multiturn.py`` and ``test_bench_hybrid.py`` the bench's workload checks.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_storage.cli import main


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: (argv, text the one line must hold). ``{tmp}`` is replaced by a scratch directory.
BAD_INPUTS = [
    # the command line itself
    ([], "the following arguments are required: COMMAND"),
    (["no-such-command"], "invalid choice: 'no-such-command'"),
    (["list", "--tabular"], "unrecognized arguments: --tabular"),
    # bench: its options
    (["bench", "--tiers", "L1+L9"], "bench --tiers: unknown tier configuration 'L1+L9'; choose from off, L1, L1+L2, L1+L2+L3"),
    (["bench", "--tiers", "L1,,L1+L2"], "unknown tier configuration ''"),
    (["bench", "--clients", "many"], "argument --clients: invalid int value: 'many'"),
    (["bench", "--layout", "column_first"], "argument --layout: invalid choice: 'column_first'"),
    (["bench", "--layers", "0"], "argument --layers: must be at least 1, got 0"),
    (["bench", "--kv-heads", "0"], "argument --kv-heads: must be at least 1, got 0"),
    (["bench", "--head-dim", "-8"], "argument --head-dim: must be at least 1, got -8"),
    (["bench", "--prefetch-threshold", "-1"], "argument --prefetch-threshold: must be at least 0, got -1"),
    (["bench", "--cheap-prefill-tokens-per-s", "0"], "argument --cheap-prefill-tokens-per-s: must be positive, got 0"),
    (["bench", "--model", "hybrid-swa", "--experiment", "branch-backup", "--shared-tokens", "0"], "argument --shared-tokens: must be at least 1"),
    (["bench", "--model", "hybrid-swa", "--experiment", "branch-backup", "--branches", "0"], "argument --branches: must be at least 1, got 0"),
    (["bench", "--page-size", "0"], "must be a positive multiple of page_size (0)"),
    # bench: its L3 backend, checked before the first run starts
    (["bench", "--config", '{"root": "/tmp/kv"}'], "--config configures the --backend named with it; add --backend"),
    (["bench", "--backend", "no-such-store"], "unknown storage backend 'no-such-store'"),
    (["bench", "--backend", "file", "--config", '{"root": '], "not valid JSON"),
    (["bench", "--backend", "file", "--config", '{"root": "{tmp}", "nvme": true}'], "unknown config key 'nvme'"),
    (["bench", "--backend", "redis", "--config", '{"url": "redis://127.0.0.1:{port}"}'], "Connection refused; check that the server is running"),
    # bench-io
    (["bench-io", "memory", "--batch-sizes", "1,x"], "bench-io --batch-sizes: not a whole number: 'x'"),
    (["bench-io", "memory", "--batch-sizes", "0"], "bench-io --batch-sizes: must be at least 1, got 0"),
    (["bench-io", "memory", "--page-sizes", "12Q"], "bench-io --page-sizes: not a size: '12Q'"),
    (["bench-io", "memory", "--bytes-per-case", "lots"], "bench-io --bytes-per-case: not a size: 'lots'"),
    (["bench-io", "no-such-store"], "unknown storage backend 'no-such-store'"),
    (["bench-io", "memory", "--layers", '[{"kind": "compress"}]'], "unknown kind 'compress'"),
    # describe and conformance
    (["describe", '{"backend": "memory", "config": '], "not valid JSON"),
    (["describe", "@{tmp}/absent.yaml"], "cannot read config file"),
    (["conformance", "no-such-store"], "unknown storage backend 'no-such-store'"),
    (["conformance", "memory", "--layers", "not-json"], "layer specs are not valid JSON"),
]


@pytest.mark.parametrize(("argv", "expected"), BAD_INPUTS, ids=[" ".join(argv) or "(nothing)" for argv, _ in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line(argv: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = closed_port()
    argv = [arg.replace("{tmp}", str(tmp_path)).replace("{port}", str(port)) for arg in argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's errors leave through here
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line:\n{err}"
    assert expected in err, err
    assert err.startswith("hicache-storage"), err
    assert out == ""
    assert list(tmp_path.iterdir()) == [], "a command refused at the start wrote files"


def test_the_process_exits_2_for_an_unknown_tier(tmp_path: Path) -> None:
    """The command as a user types it (it once exited 1 with the message as SystemExit's text)."""
    result = subprocess.run(
        [sys.executable, "-m", "hicache_storage.cli", "bench", "--tiers", "L1+L9", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "hicache-storage: error: bench --tiers: unknown tier configuration 'L1+L9'; choose from off, L1, L1+L2, L1+L2+L3"
    ]
    assert result.stdout == "" and not (tmp_path / "out").exists()

