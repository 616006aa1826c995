"""Client-job processes: spawn one in its own process group, tell whether a recorded one still
lives, wait for one that is not our child to end, stop one (SIGTERM to its group, SIGKILL after
a grace period), and say how one ended.

A pid alone does not identify a process across an agent restart (pids are reused), so the agent
records the process's start time too (`/proc/<pid>/stat` field 22 on Linux) and only treats a
pid as its client job when both match.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog

log = structlog.get_logger()


def spawn(
    module: str,
    args: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    log_file: Path,
) -> subprocess.Popen[bytes]:
    """Run `python -m module args...` in its own session (so its process group can be signalled
    as a whole), with stdout and stderr appended to `log_file`."""
    with log_file.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if there is no such process
    (or the platform has no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = stat[stat.rfind(")") + 2 :].split()
    if fields[0] == "Z":
        return None  # a zombie has exited; only its exit status is left
    return int(fields[19])


def alive(pid: int, started: int | None) -> bool:
    """Whether the process recorded as (`pid`, `started`) is still running."""
    if pid <= 0:
        return False
    now = start_time(pid)
    if now is not None:
        return started is None or now == started
    if Path("/proc").is_dir():
        return False
    try:  # no /proc: the pid's existence is all there is to go on
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_gone(pid: int, started: int | None, stop: threading.Event, poll: float) -> bool:
    """Wait until the process recorded as (`pid`, `started`) is gone: True; False when `stop`
    is set first. For a process that is not our child (one that outlived an earlier agent),
    which `wait()` cannot wait for: its liveness is polled every `poll` seconds."""
    while alive(pid, started):
        if stop.wait(poll):
            return False
    return True


def describe_exit(code: int) -> str:
    """How a process that left no word of its own ended, from its exit status (-N: signal N)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "unknown signal"
    if -code == signal.SIGKILL:
        name += ": the OOM killer, or killed by hand?"
    return f"killed by signal {-code} ({name})"


def stop_group(pid: int, started: int | None, grace: float, *, poll: float = 0.05) -> bool:
    """SIGTERM the process group led by `pid`, SIGKILL it if `pid` still lives after `grace`
    seconds. Returns whether SIGKILL was needed. A process that is already gone is fine."""
    if not alive(pid, started):
        return False
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not alive(pid, started):
            return False
        time.sleep(poll)
    if not alive(pid, started):
        return False
    log.warning("client_job.kill", pid=pid, grace_s=grace)
    _signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while alive(pid, started) and time.monotonic() < deadline:
        time.sleep(poll)
    return True


def _signal_group(pid: int, signum: signal.Signals) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass
    except PermissionError:  # not a group leader we own: signal the process alone
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

