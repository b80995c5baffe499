"""Bad input to ``hicache-storage conformance``: one line on stderr, exit code 2, no report.

Each bad input goes through the command's entry point (``hicache_storage.cli.main``, what the
``hicache-storage`` script calls) in this process; what needs a process of its own runs the real
command in a subprocess: a missing pytest (simulated by a ``sitecustomize`` on PYTHONPATH whose
import hook refuses the module, as an environment without it would), a good run, and the pytest
plugin. Before this, a bad config failed every clause with the same error (thousands of lines)
and still wrote a report of errors.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hicache_storage.cli import main


def run_conformance(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicache_storage.cli", "conformance", *args, "--report-dir", str(tmp_path / "report")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def run_in_process(capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The same command through ``main`` in this process, as a CompletedProcess of what it printed."""
    argv = ["conformance", *args, "--report-dir", str(tmp_path / "report")]
    code = main(argv)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, captured.out, captured.err)


def assert_one_clear_error(result: subprocess.CompletedProcess[str], tmp_path: Path, *expected: str) -> None:
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("hicache-storage conformance: ")
    for text in expected:
        assert text in lines[0]
    assert result.stdout == ""
    assert not (tmp_path / "report").exists(), "a report was written for a run that never started"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def unwritable_directory(tmp_path: Path) -> str:
    """An existing directory this process cannot create entries in, root or not."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        return str(locked)
    return "/proc/1"  # a real directory in which nobody, root included, may create a file


def test_malformed_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_in_process(capsys, tmp_path, "file", "--config", '{"root": ')
    assert_one_clear_error(result, tmp_path, "not valid JSON", "pass a JSON object")


def test_wrong_field_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_in_process(capsys, tmp_path, "file", "--config", f'{{"root": "{tmp_path / "pages"}", "io_threads": "many"}}')
    assert_one_clear_error(result, tmp_path, "io_threads='many'", "valid integer")


def test_unknown_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_in_process(capsys, tmp_path, "file", "--config", f'{{"root": "{tmp_path / "pages"}", "nvme": true}}')
    assert_one_clear_error(result, tmp_path, "unknown config key 'nvme'", "valid keys: ")


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_in_process(capsys, tmp_path, "file", "--config", f"@{tmp_path / 'absent.toml'}")
    assert_one_clear_error(result, tmp_path, "cannot read config file", "absent.toml", "No such file")


def test_root_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a-file").write_bytes(b"")
    result = run_in_process(capsys, tmp_path, "file", "--config", f'{{"root": "{tmp_path / "a-file"}"}}')
    assert_one_clear_error(result, tmp_path, "is not a directory", "pass a directory")


def test_root_below_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a-file").write_bytes(b"")
    result = run_in_process(capsys, tmp_path, "file", "--config", f'{{"root": "{tmp_path / "a-file" / "pages"}"}}')
    assert_one_clear_error(result, tmp_path, "cannot create root", "Not a directory")


def test_root_that_is_not_writable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_in_process(capsys, tmp_path, "file", "--config", f'{{"root": "{unwritable_directory(tmp_path)}"}}')
    assert_one_clear_error(result, tmp_path, "root must be a directory this process can write")


def test_bad_layer_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_in_process(capsys, tmp_path, "memory", "--layers", '[{"kind": "retyr"}]')
    assert_one_clear_error(result, tmp_path, "unknown kind 'retyr'", "valid kinds: ")


def test_unknown_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_in_process(capsys, tmp_path, "no-such-store")
    assert_one_clear_error(result, tmp_path, "unknown storage backend 'no-such-store'", "known backends: ")


def test_server_that_does_not_answer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("redis")
    result = run_in_process(capsys, tmp_path, "redis", "--config", f'{{"url": "redis://127.0.0.1:{closed_port()}"}}')
    assert_one_clear_error(result, tmp_path, "cannot use Redis", "check that the server is running")


@pytest.mark.parametrize("module", ["pytest", "hypothesis"])
def test_missing_suite_dependency_names_the_extra(tmp_path: Path, module: str) -> None:
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        textwrap.dedent(
            f"""
            import sys

            class NotInstalled:
                def find_spec(self, name, path=None, target=None):
                    if name.partition(".")[0] == {module!r}:
                        raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                    return None

            sys.meta_path.insert(0, NotInstalled())
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")]))}
    probe = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, env=env)
    assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, "the blocker did not take effect"
    result = run_conformance(tmp_path, "memory", env=env)
    assert_one_clear_error(result, tmp_path, f"{module} is not installed", "pip install 'hicache-storage[conformance]'")


def test_good_input_still_runs_and_reports(tmp_path: Path) -> None:
    result = run_conformance(tmp_path, "file", "--config", f'{{"root": "{tmp_path / "pages"}"}}', "-k", "roundtrip_segments")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (tmp_path / "report" / "file.json").exists()


def test_pytest_plugin_reports_a_bad_config_once(tmp_path: Path) -> None:
    """``pytest --pyargs hicache_storage.conformance`` checks the options once too: a usage error."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-c", os.devnull]
        + ["--pyargs", "hicache_storage.conformance", "--hicache-backend", "file", "--hicache-config", '{"nvme": true}']
        + ["--hicache-report", str(tmp_path / "report" / "file")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == int(pytest.ExitCode.USAGE_ERROR), result.stdout[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ERROR: hicache-storage conformance: unknown config key 'nvme'"), lines
    assert not (tmp_path / "report").exists()
