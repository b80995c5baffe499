"""The CI-sized soak: random injected faults through the engine, resources flat, no deadlock.

Each soak runs in its own process (``python -m hicache_core.soak``) so that RSS, file
descriptors, sockets and threads are the engine's, not pytest's. The longer run and its figures
are in docs/reliability.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid

import pytest

SOAK_MINUTES = 0.7


def run_soak(tmp_path, *args: str) -> dict:
    report = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "-m", "hicache_core.soak", "--minutes", str(SOAK_MINUTES), "--json", str(report), *args],
        capture_output=True, text=True, timeout=SOAK_MINUTES * 60 + 240,
    )
    assert done.returncode == 0, f"soak failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"
    return json.loads(report.read_text())


def check(report: dict) -> None:
    assert report["passed"] and not report["failures"]
    assert report["wrong_tokens"] == 0 and report["wrong_logits"] == 0
    assert report["requests"] > 0 and report["storage_hit_tokens"] > 0
    assert report["faults"]["faults_error"] > 0 and report["faults"]["faults_hang"] + report["faults"]["faults_corrupt"] > 0
    assert report["engine_counters"]["storage_errors"] > 0 and report["engine_counters"]["storage_timeouts"] > 0
    assert len(report["samples"]) >= 4
    margins = {"rss_kib": report["config"]["rss_margin_kib"], "fds": report["config"]["fd_margin"],
               "sockets": report["config"]["socket_margin"], "threads": report["config"]["thread_margin"]}
    for name, margin in margins.items():
        assert report["growth"][name] <= margin, f"{name} grew by {report['growth'][name]}"


@pytest.mark.slow
def test_soak_file_connector(tmp_path):
    check(run_soak(tmp_path, "--seed", "3"))


@pytest.mark.slow
@pytest.mark.services
def test_soak_redis(tmp_path, redis_server):
    config = json.dumps({"url": redis_server.url, "prefix": f"soak{uuid.uuid4().hex[:8]}"})
    report = run_soak(tmp_path, "--seed", "4", "--backend", "redis", "--config", config)
    check(report)
    assert max(s["sockets"] for s in report["samples"]) > 0, "a Redis soak must hold sockets, or they were not counted"


def test_watchdog_ends_a_stalled_run(tmp_path):
    """No progress for stall_s: the watchdog prints every stack, writes a failed report, exit 3."""
    report = tmp_path / "stall.json"
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from hicache_core.soak import Watchdog
        Watchdog(1.0, Path({str(report)!r})).start()
        time.sleep(120)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert done.returncode == 3, done.stderr
    assert "soak stalled" in done.stderr and "Thread" in done.stderr
    assert json.loads(report.read_text())["passed"] is False
