"""Stopping a POC: every process it started (scheduler and job-runner first, the S3 server
last), every process still carrying its marker (server jobs, client jobs, trainers), its
broker users, and, when asked, the RabbitMQ and Redis it started."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from fedhive.brokerusers import delete_users
from fedhive.config import Settings
from fedhive.errors import FedhiveError, PocFailed
from fedhive.poc import infra, procs
from fedhive.poc.layout import PocLayout
from fedhive.poc.state import PocState, ProcessEntry, load_state

GRACE_S = 10.0  # SIGTERM to SIGKILL
Say = Callable[[str], None]


@dataclass
class StopReport:
    stopped: list[str] = field(default_factory=list)  # processes that were running
    killed: list[str] = field(default_factory=list)  # needed SIGKILL
    strays: int = 0  # marked processes found after the groups were stopped
    problems: list[str] = field(default_factory=list)  # what could not be cleaned up


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Ignore Ctrl-C and SIGTERM while cleaning up (a second Ctrl-C must not leave half a POC
    behind); a no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {signum: signal.signal(signum, signal.SIG_IGN)
              for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


CONTROL = ("scheduler", "job-runner")


def _tiers(entries: Sequence[ProcessEntry]) -> list[list[ProcessEntry]]:
    """The scheduler and the job-runner first (so nothing dispatches, or reacts to sites going
    offline, while the rest stops), then the gateway, job-store and site agents (which abort
    their client jobs), then the S3 server: what is still running may need it to the end."""
    control = [e for e in entries if e.name in CONTROL]
    s3 = [e for e in entries if e.name == "seaweedfs"]
    rest = [e for e in entries if e not in control and e not in s3]
    return [tier for tier in (control, rest, s3) if tier]


def teardown(state: PocState, layout: PocLayout, settings: Settings, ctl: Sequence[str], *,
             infra_too: bool = False, grace: float = GRACE_S) -> StopReport:
    """Stop everything `state` records; never raises for what it cannot clean up (the report
    says), so that a failed start always cleans up as far as it can."""
    report = StopReport()
    tiers = _tiers(state.processes)
    s3 = tiers.pop() if tiers and tiers[-1][0].name == "seaweedfs" else []
    for tier in tiers:
        report.stopped += [e.name for e in tier if procs.alive(e)]
        report.killed += procs.stop_groups(tier, grace)
    # server jobs (they outlive their runner by design), client jobs and trainers left
    report.strays = procs.stop_marked(layout.root, grace=3.0, spare=s3)
    if s3:
        report.stopped += [e.name for e in s3 if procs.alive(e)]
        report.killed += procs.stop_groups(s3, grace)
    if state.broker_users:
        try:
            delete_users(state.broker_users, ctl)
        except (FedhiveError, subprocess.SubprocessError) as err:
            report.problems.append(f"broker users {', '.join(state.broker_users)} are left "
                                   f"({err}): python deploy/broker_users.py delete "
                                   f"{' '.join(state.broker_users)}")
    if infra_too and state.infra_started:
        infra.stop(state.infra_started, settings)
    with contextlib.suppress(FileNotFoundError):
        layout.state_file.unlink()
    return report


def stop_poc(layout: PocLayout, settings: Settings, ctl: Sequence[str], *,
             infra_too: bool = False, say: Say = lambda _: None) -> StopReport | None:
    """Stop the POC in `layout`; None when none was started there (strays are still looked
    for and stopped)."""
    with layout.locked():
        try:
            state = load_state(layout.state_file)
        except PocFailed:
            procs.stop_marked(layout.root, grace=GRACE_S)
            raise
        if state is None:
            strays = procs.stop_marked(layout.root, grace=GRACE_S)
            return StopReport(strays=strays) if strays else None
        say(f"stopping the POC in {layout.root}")
        return teardown(state, layout, settings, ctl, infra_too=infra_too)
