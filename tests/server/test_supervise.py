"""`python -m tokendance.server.fleet.supervise`: the session of the command it runs (a server and the
processes the server started) never outlives it, whether it is told to stop, its parent dies
outright, the fleet's owner it watches is gone, or the command exits leaving processes behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import wait_until

# a "server" that starts a helper process of its own and then waits
SERVER = [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"]


def session_processes(leader: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == leader and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def supervised(tmp_path: Path, command: list[str], parent: bool = False, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    """(the process started: the supervisor, or a parent of it; the command's pid, once its helper runs)."""
    pidfile = tmp_path / "server.pid"
    supervise = [sys.executable, "-m", "tokendance.server.fleet.supervise", str(pidfile), "--", *command]
    if parent:  # a parent that starts the supervisor and waits: killing it is a replica killed outright
        supervise = [sys.executable, "-c", f"import subprocess, time; subprocess.Popen({supervise!r}); time.sleep(300)"]
    process = subprocess.Popen(supervise, env={**os.environ, **(env or {})})
    wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=30)
    leader = int(pidfile.read_text())
    wait_until(lambda: len(session_processes(leader)) >= 2, timeout=30)
    return process, leader


def test_stopping_the_supervisor_stops_the_servers_whole_session(tmp_path):
    process, leader = supervised(tmp_path, SERVER)
    process.terminate()
    assert process.wait(timeout=30) == 0
    assert session_processes(leader) == []


def test_a_parent_killed_outright_takes_the_servers_session_with_it(tmp_path):
    parent, leader = supervised(tmp_path, SERVER, parent=True)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    wait_until(lambda: session_processes(leader) == [], timeout=30)


def test_a_server_that_exits_leaves_nothing_behind_and_its_status(tmp_path):
    leaver = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen(['sleep', '300']); time.sleep(1); sys.exit(3)"]
    process, leader = supervised(tmp_path, leaver)
    assert process.wait(timeout=30) == 3
    assert session_processes(leader) == []


def test_a_fleet_owner_that_is_gone_takes_the_servers_session_with_it(tmp_path):
    owner = subprocess.Popen(["sleep", "300"])  # stands for `tokendance serve`, killed outright
    process, leader = supervised(tmp_path, SERVER, env={"TOKENDANCE_FLEET_OWNER": str(owner.pid)})
    assert session_processes(leader)
    owner.kill()
    owner.wait()
    assert process.wait(timeout=30) == 0
    assert session_processes(leader) == []
