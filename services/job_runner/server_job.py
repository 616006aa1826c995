"""The server-job process seen from the runner: launch it, tell whether it ended, stop it.

The SJ runs in its own process group (so stopping it stops whatever it started) and does not
depend on the runner: a restarted runner finds it by pid, checked against its create time so a
reused pid is never taken for it (nor killed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from fedhive.state.runs import RunEntry

from .context import RunnerContext


def child_env() -> dict[str, str]:
    """The SJ's environment: the runner's own, unchanged (PATH, PYTHONPATH, locale and the
    FEDHIVE_*/AWS_* variables the runner's `Settings` came from). The one place the runner reads
    its environment, only to hand it down."""
    return dict(os.environ)


def launch(ctx: RunnerContext, entry: RunEntry, env: dict[str, str], sites: list[str],
           ) -> RunEntry:
    workspace = os.path.join(entry.workspace, "workspace")
    os.makedirs(workspace, exist_ok=True)
    command = [sys.executable, "-m", "fedhive.fl.server_job", "--job-id", entry.job_id,
               "--app-dir", os.path.join(entry.workspace, "app"), "--workspace", workspace,
               "--liveness-interval", str(ctx.config.sj_liveness_s)]
    for site in sites:
        command += ["--site", site]
    with open(os.path.join(workspace, "server_job.log"), "ab") as log:
        proc = subprocess.Popen(command, cwd=workspace, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    ctx.children[entry.job_id] = proc
    try:
        started = psutil.Process(proc.pid).create_time()
    except psutil.Error:
        started = 0.0  # it already ended: the monitor learns how from `ended`
    return RunEntry(**{**entry.__dict__, "pid": proc.pid, "pid_started": started})


def _process(entry: RunEntry) -> psutil.Process | None:
    """The SJ if it still exists (not a zombie), else None."""
    if not entry.pid:
        return None
    try:
        proc = psutil.Process(entry.pid)
        if abs(proc.create_time() - entry.pid_started) > 0.01:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.Error:
        return None
    return proc


def ended(ctx: RunnerContext, entry: RunEntry) -> str | None:
    """None while the SJ runs; once it ended, what is known of how (exit code or signal)."""
    child = ctx.children.get(entry.job_id)
    if child is not None:
        code = child.poll()
        if code is None:
            return None
        if code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exit code {code}"
    if _process(entry) is not None:
        return None
    return "server job process vanished (not a child of this runner: exit status unknown)"


def stop(ctx: RunnerContext, entry: RunEntry) -> None:
    """SIGTERM to the SJ's process group, SIGKILL after the grace period."""
    proc = _process(entry)
    if proc is None:
        return
    try:
        os.killpg(entry.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + ctx.config.abort_grace_s
    while time.monotonic() < deadline:
        if ended(ctx, entry) is not None:
            return
        time.sleep(0.05)
    try:
        os.killpg(entry.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    child = ctx.children.get(entry.job_id)
    if child is not None:
        child.wait()


def exists(entry: RunEntry) -> bool:
    """The SJ `entry` names still runs on this host (the same process, not a reused pid)."""
    return _process(entry) is not None
