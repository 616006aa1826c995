"""The server-job process seen from the runner: launch it, tell whether it ended, stop it.

The SJ runs in its own process group (so stopping it stops whatever it started) and does not
depend on the runner: a restarted runner finds it by pid, checked against its create time so a
reused pid is never taken for it (nor killed). A runner on another host (one that took the job
over from a runner that is gone) cannot see that process: its liveness record alone tells
whether it runs, and it is stopped by a request it reads from Redis (`RunTable.ask_stop`).

SJs are forked by a fork server (`multiprocessing`'s, started on the first launch) that has
imported `fedhive.fl.server_job` and the runner's modules once: a Python start-up with those
imports costs ~0.4 CPU-s, most of a tiny job's server side. The forked SJ is not the runner's
child; its exit status comes back through the fork server (`ChildProcess.poll`).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from multiprocessing.popen_forkserver import Popen as ForkedPopen

import psutil

from fedhive.fl.server_job import forked_main
from fedhive.state.runs import RunEntry

from .context import RunnerContext

# What the fork server imports before forking SJs: the SJ and the runner's own entry module
# (a forked child re-runs the parent's main module; imported already, that costs nothing).
PRELOAD = ["fedhive.fl.server_job", "fedhive_services.job_runner.main"]
_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(PRELOAD)


def launch(ctx: RunnerContext, entry: RunEntry, env: dict[str, str], sites: list[str],
           *, resume_from: str = "") -> RunEntry:
    """Start the SJ; `resume_from`: the job whose checkpoint it continues (`fedhive resume`)."""
    workspace = os.path.join(entry.workspace, "workspace")
    os.makedirs(workspace, exist_ok=True)
    argv = server_job_argv(entry, workspace, sites, ctx.config.sj_liveness_s, resume_from)
    # Popen directly, not Process.start: a started Process is joined when the runner exits,
    # and the SJ must outlive a stopped runner.
    proc = ForkedPopen(_FORKS.Process(
        target=forked_main, name=f"server-job.{entry.job_id}",
        args=(argv, workspace, os.path.join(workspace, "server_job.log"), env)))
    ctx.children[entry.job_id] = proc
    try:
        started = psutil.Process(proc.pid).create_time()
    except psutil.Error:
        started = 0.0  # it already ended: the monitor learns how from `ended`
    return RunEntry(**{**entry.__dict__, "host": socket.gethostname(), "pid": proc.pid,
                       "pid_started": started})


def elsewhere(entry: RunEntry) -> bool:
    """The SJ runs on another host: its pid says nothing here."""
    return bool(entry.host) and entry.host != socket.gethostname()


def server_job_argv(entry: RunEntry, workspace: str, sites: list[str], liveness_s: float,
                    resume_from: str = "") -> list[str]:
    """The command line of `fedhive.fl.server_job` for this run."""
    argv = ["--job-id", entry.job_id, "--app-dir", os.path.join(entry.workspace, "app"),
            "--workspace", workspace, "--liveness-interval", str(liveness_s)]
    for site in sites:
        argv += ["--site", site]
    if resume_from:
        argv += ["--resume-from", resume_from]
    return argv


def _process(entry: RunEntry) -> psutil.Process | None:
    """The SJ if it still exists (not a zombie), else None."""
    if not entry.pid or elsewhere(entry):
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
    if elsewhere(entry) or _process(entry) is not None:
        return None  # elsewhere: its liveness record tells (the monitor reads it)
    return "server job process vanished (not a child of this runner: exit status unknown)"


def stop(ctx: RunnerContext, entry: RunEntry) -> None:
    """SIGTERM to the SJ's process group, SIGKILL after the grace period; an SJ on another host
    is asked to stop through Redis."""
    if elsewhere(entry):
        ctx.runs.ask_stop(entry.job_id)
        ctx.log.info("job_runner.server_job_asked_to_stop", job_id=entry.job_id,
                     host=entry.host)
        return
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
