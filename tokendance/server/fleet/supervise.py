"""Run a server command so that nothing of it outlives its owner:

    python -m tokendance.server.fleet.supervise PIDFILE -- COMMAND...

The command runs in a session of its own (vLLM's server starts an engine-core process, which a
killed server leaves running); its pid goes to PIDFILE. When this process is told to stop
(SIGTERM, SIGINT) or its parent dies (a Ray replica killed outright runs no clean-up of its own),
the whole session is stopped: SIGTERM, then SIGKILL. When the command exits, what it left is
killed and its exit status is this process's. Plain Python, no imports beyond the standard
library (it runs beside vLLM in any environment)."""

from __future__ import annotations

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


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m tokendance.server.fleet.supervise PIDFILE -- COMMAND...", file=sys.stderr)
        return 2
    parent, stopping = os.getppid(), []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _frame: stopping.append(number))
    child = subprocess.Popen(argv[2:], start_new_session=True)
    with open(argv[0], "w") as f:
        f.write(str(child.pid))
    while child.poll() is None:
        if stopping or os.getppid() != parent:
            stop_session(child.pid)
            return 0
        time.sleep(0.5)
    stop_session(child.pid, grace_s=2.0)  # whatever the command left behind
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
