"""The test-server base: a work directory is removed after a clean stop and kept, with its path
logged, when the server failed, crashed or had to be killed, so its log can be read."""

from __future__ import annotations

import shutil
import signal
import sys
import textwrap

import pytest

from hicache_storage.testing.process import ServerProcess, ServiceError

#: A stand-in server: logs a line, then either exits at once with ``exit_code`` (a server that
#: never becomes ready) or marks itself ready and runs until signalled, or until a file named
#: ``crash`` appears in its directory, when it exits with ``exit_code``; optionally ignores SIGTERM.
SERVER = textwrap.dedent(
    """
    import pathlib, signal, sys, time
    exit_code, fails_at_start, ignore_term = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1"
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("stand-in server up", flush=True)
    if fails_at_start:
        sys.exit(exit_code)
    pathlib.Path("ready").touch()
    while not pathlib.Path("crash").exists():
        time.sleep(0.02)
    sys.exit(exit_code)
    """
)


def start(server: ServerProcess, *, exit_code: int = 0, fails_at_start: bool = False, ignore_term: bool = False) -> None:
    server.spawn([sys.executable, "-c", SERVER, str(exit_code), "1" if fails_at_start else "0", "1" if ignore_term else "0"])
    server.wait_ready(lambda: (server.workdir / "ready").exists(), timeout=30)


def kept_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "keeping its work directory" in r.getMessage()]


def test_a_clean_stop_removes_the_work_directory(caplog):
    server = ServerProcess("clean")
    start(server)
    workdir = server.workdir
    assert workdir.name.startswith("hicache-clean-") and server.log_path.exists()
    server.stop()
    assert not workdir.exists() and server.unclean is None
    server.stop()  # safe twice
    assert kept_warnings(caplog) == []


def test_a_server_that_never_becomes_ready_keeps_its_log(caplog):
    server = ServerProcess("broken")
    with pytest.raises(ServiceError, match="exited with code 3"):
        start(server, exit_code=3, fails_at_start=True)
    server.stop()
    server.stop()
    assert server.unclean is not None and "not ready" in server.unclean
    assert "stand-in server up" in server.log_path.read_text()
    assert kept_warnings(caplog) == [
        f"broken: {server.unclean}; keeping its work directory for diagnosis: {server.workdir}"
    ], "the path is logged once, however often stop() is called"
    shutil.rmtree(server.workdir)


def test_a_server_that_dies_on_its_own_keeps_its_log(caplog):
    server = ServerProcess("crashing")
    start(server, exit_code=7)
    (server.workdir / "crash").touch()
    assert server.process is not None and server.process.wait(timeout=30) == 7
    server.stop()
    assert server.unclean == "exited on its own with code 7" and server.workdir.exists()
    assert str(server.workdir) in kept_warnings(caplog)[0]
    shutil.rmtree(server.workdir)


def test_a_server_ignoring_sigterm_is_killed_and_keeps_its_log(caplog):
    server = ServerProcess("stubborn")
    start(server, ignore_term=True)
    server.stop(grace=0.2)
    assert not server.running() and server.workdir.exists()
    assert server.unclean == "did not exit within 0.2s of SIGTERM and was killed"
    assert kept_warnings(caplog)
    shutil.rmtree(server.workdir)


def test_a_server_known_to_be_slow_to_exit_is_killed_without_keeping_anything(caplog):
    class Slow(ServerProcess):
        slow_to_exit = True

    server = Slow("slow")
    start(server, ignore_term=True)
    server.stop(grace=0.2)
    assert not server.workdir.exists() and kept_warnings(caplog) == []


def test_a_server_killed_on_purpose_then_stopped_is_clean(caplog):
    server = ServerProcess("killed")
    start(server)
    server.signal(signal.SIGKILL)  # what fault tests do
    assert server.process is not None and server.process.wait(timeout=30) == -signal.SIGKILL
    server.stop()
    assert server.unclean is None and not server.workdir.exists() and kept_warnings(caplog) == []


def test_a_failed_start_retried_successfully_is_clean():
    server = ServerProcess("retried")
    with pytest.raises(ServiceError):
        start(server, exit_code=2, fails_at_start=True)
    start(server)  # e.g. the port was taken: started again, and this time it worked
    server.stop()
    assert server.unclean is None and not server.workdir.exists()


def test_a_work_directory_given_by_the_caller_is_never_removed(tmp_path):
    server = ServerProcess("given", tmp_path / "given")
    start(server)
    server.stop()
    assert (tmp_path / "given" / "given.log").exists()


def test_a_shared_directory_goes_with_the_last_server_running_in_it():
    """Like a Mooncake master and its storage node: the master's stop leaves the directory while
    the node still runs and logs there; once both are stopped, it goes."""
    owner = ServerProcess("owner")
    guest = ServerProcess("guest", owner.workdir)
    start(owner)
    start(guest)
    owner.stop()
    assert owner.workdir.exists() and guest.log_path.exists()
    start(owner)  # a restart of the owner alone, as MooncakeMaster.restart does
    guest.stop()
    owner.stop()
    assert not owner.workdir.exists()



def test_listens_on_names_only_the_servers_own_ports(tmp_path) -> None:
    """A port another process listens on does not make our server ready (a connect would)."""
    import socket

    from hicache_storage.testing.process import free_port

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    foreign = listener.getsockname()[1]
    own = free_port(avoid=[foreign])
    server = ServerProcess("listener", tmp_path / "srv")
    program = f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {own})); s.listen(); time.sleep(60)"
    server.spawn([sys.executable, "-c", program])
    try:
        server.wait_ready(lambda: server.listens_on(own), timeout=30)
        assert not server.listens_on(foreign)
        assert not server.listens_on(own, foreign)
    finally:
        server.stop()
        listener.close()
    assert not server.listens_on(own), "a stopped server listens on nothing"


def test_freezing_a_server_that_is_not_running_raises(tmp_path) -> None:
    server = ServerProcess("stand-in", tmp_path / "srv")
    start(server, fails_at_start=False)
    (server.workdir / "crash").touch()
    server.process.wait(timeout=30)
    with pytest.raises(ServiceError, match="not running: cannot freeze"):
        server.signal(signal.SIGSTOP)
    server.signal(signal.SIGCONT)  # thawing in a cleanup stays harmless
    server.stop()


def test_freezing_returns_once_every_thread_of_the_server_is_stopped(tmp_path) -> None:
    from pathlib import Path

    server = ServerProcess("stand-in", tmp_path / "srv")
    program = "import threading, time\nfor _ in range(4): threading.Thread(target=lambda: [0 for _ in iter(int, 1)], daemon=True).start()\ntime.sleep(60)"
    server.spawn([sys.executable, "-c", program])
    try:
        tasks = Path(f"/proc/{server.pid}/task")
        server.wait_ready(lambda: len(list(tasks.iterdir())) >= 5, timeout=30)
        server.signal(signal.SIGSTOP)
        states = {(task / "stat").read_text().rpartition(")")[2].split()[0] for task in tasks.iterdir()}
        assert states <= {"T", "t"}, states
        server.signal(signal.SIGCONT)
    finally:
        server.stop()
