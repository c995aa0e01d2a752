"""Run a server command so that nothing of it outlives its owner:

    python -m tokendance.server.fleet.supervise PIDFILE -- COMMAND...

The command runs in a session of its own (vLLM's server starts an engine-core process, which a
killed server leaves running); its pid goes to PIDFILE. When this process is told to stop
(SIGTERM, SIGINT) or its parent dies (a Ray replica killed outright runs no clean-up of its own),
the whole session is stopped: SIGTERM, then SIGKILL. So is it when the fleet's owner
(`tokendance serve`, its pid in TOKENDANCE_FLEET_OWNER) is gone: a replica whose endpoint died
stops its server even where Ray leaves the replica running. When the command exits, what it left
is killed and its exit status is this process's.

It also holds what the owner uses to leave nothing behind (`adopt_orphans`, `descendants`,
`stop_processes`). Plain Python, no imports beyond the standard library (it runs beside vLLM in
any environment)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

GRACE_S = 10.0  # from SIGTERM to SIGKILL


def stop_session(leader: int, grace_s: float = GRACE_S) -> None:
    """SIGTERM every process of the session `leader` leads, then SIGKILL what is left after `grace_s`."""
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(leader, sig)
        except ProcessLookupError:
            return
        while time.monotonic() < deadline:
            try:
                os.waitpid(leader, os.WNOHANG)
            except ChildProcessError:
                pass
            try:
                os.killpg(leader, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def _state_and_parent(pid: int | str) -> tuple[str, int] | None:
    """(state letter, parent pid) from /proc; None for a process that is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    stat = _state_and_parent(pid)
    return stat is not None and stat[0] != "Z"


def adopt_orphans() -> bool:
    """Make this process the child subreaper of everything it starts (Linux's PR_SET_CHILD_SUBREAPER):
    a descendant whose parent dies (Ray's raylet, killed with the rest of a process group) is
    re-parented here rather than to init, so `descendants` still finds it. False where the
    system has no such call."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def descendants(root: int) -> list[int]:
    """Every live process below `root` in the process tree, parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        stat = _state_and_parent(entry.name) if entry.name.isdigit() else None
        if stat is not None and stat[0] != "Z":
            children.setdefault(stat[1], []).append(int(entry.name))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        found.append(pid)
        todo += children.get(pid, [])
    return found


def stop_processes(pids: list[int], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM each of `pids`, then SIGKILL what still runs after `grace_s`; reaps those that are
    this process's children. Returns the pids still alive after that (none, unless one cannot
    be killed)."""
    def reap() -> None:
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    return
            except ChildProcessError:
                return

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while True:
            reap()
            pids = [pid for pid in pids if alive(pid)]
            if not pids or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    return pids


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m tokendance.server.fleet.supervise PIDFILE -- COMMAND...", file=sys.stderr)
        return 2
    parent, stopping = os.getppid(), []
    owner = int(os.environ.get("TOKENDANCE_FLEET_OWNER") or 0)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _frame: stopping.append(number))
    child = subprocess.Popen(argv[2:], start_new_session=True)
    with open(argv[0], "w") as f:
        f.write(str(child.pid))
    while child.poll() is None:
        if stopping or os.getppid() != parent or (owner and not alive(owner)):
            stop_session(child.pid)
            return 0
        time.sleep(0.5)
    stop_session(child.pid, grace_s=2.0)  # whatever the command left behind
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
