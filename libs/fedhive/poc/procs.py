"""Detached processes: start one in its own session with its log, tell whether it still runs,
stop its process group, and find every process a POC left (by the marker in its environment).

A process is identified by pid and create time together (`ProcessEntry`): a pid reused by
the kernel for another program never matches, so nothing else is ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import psutil

from fedhive.poc.layout import MARKER
from fedhive.poc.state import ProcessEntry

_SAME_START = 0.01  # seconds: create times are read from the same kernel value
_exit_codes: dict[int, int] = {}  # pid -> exit status of the children this process reaped


def spawn(name: str, argv: Sequence[str], *, env: Mapping[str, str], log: Path,
          cwd: Path) -> ProcessEntry:
    """Start `argv` detached: its own session (so its group can be signalled as a whole and a
    Ctrl-C at the terminal does not reach it), stdin from /dev/null, stdout and stderr to
    `log` (truncated)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                close_fds=True)
    try:
        created = psutil.Process(proc.pid).create_time()
    except psutil.NoSuchProcess:
        created = 0.0  # already gone: `alive` says so, and its log says why
    return ProcessEntry(name, proc.pid, created, str(log), list(argv))


def _process(entry: ProcessEntry) -> psutil.Process | None:
    """The running process `entry` names, or None (gone, a zombie, or the pid was reused)."""
    try:
        proc = psutil.Process(entry.pid)
        if abs(proc.create_time() - entry.create_time) > _SAME_START:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            _reap(entry.pid)
            return None
        return proc
    except psutil.Error:
        return None


def _reap(pid: int) -> None:
    """Collect the exit status of a child of this process (the demo starts and stops a POC in
    one process), kept for `exit_code`; for any other process it does nothing."""
    with contextlib.suppress(ChildProcessError, OSError):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _exit_codes[pid] = os.waitstatus_to_exitcode(status)


def alive(entry: ProcessEntry) -> bool:
    return _process(entry) is not None


def exit_code(entry: ProcessEntry) -> int | None:
    """The exit status of a process this process started, once it ended (None otherwise)."""
    _reap(entry.pid)
    return _exit_codes.get(entry.pid)


def stop_groups(entries: Iterable[ProcessEntry], grace: float) -> list[str]:
    """SIGTERM the process group of every entry still running, wait up to `grace` seconds for
    them all, then SIGKILL the groups left. Returns the names that needed SIGKILL."""
    running = [(entry, proc) for entry in entries if (proc := _process(entry)) is not None]
    for entry, _ in running:
        _signal_group(entry.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while running and time.monotonic() < deadline:
        running = [(entry, proc) for entry, proc in running if _process(entry) is not None]
        if running:
            time.sleep(0.05)
    for entry, _ in running:
        _signal_group(entry.pid, signal.SIGKILL)
    for entry, _ in running:
        _wait_gone(entry, 5.0)
    return [entry.name for entry, _ in running]


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _wait_gone(entry: ProcessEntry, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _process(entry) is not None and time.monotonic() < deadline:
        time.sleep(0.05)


def marked(root: Path, spare: Iterable[ProcessEntry] = ()) -> list[psutil.Process]:
    """Every process (but this one) whose environment carries the POC marker of `root`: what
    a POC started and their children (server jobs, client jobs and trainers, which run in
    sessions of their own), but this one and `spare`. Not "every process whose working
    directory is in `root`": that would include the user's shell."""
    value, skip = str(root), {os.getpid(), *(entry.pid for entry in spare)}
    found = []
    for proc in psutil.process_iter():
        if proc.pid in skip:
            continue
        try:
            if proc.environ().get(MARKER) == value:
                found.append(proc)
        except psutil.Error:
            continue  # gone meanwhile, a zombie, or not ours to read
    return found


def stop_marked(root: Path, grace: float, spare: Iterable[ProcessEntry] = ()) -> int:
    """SIGTERM every marked process (but `spare`), SIGKILL those still there after `grace`;
    how many."""
    procs = marked(root, spare)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, left = psutil.wait_procs(procs, timeout=grace)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(left, timeout=5)
    return len(procs)
