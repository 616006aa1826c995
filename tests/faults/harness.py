"""The fault suite's system and the hands that break it, shared by tests/faults and
bench/faults.py.

`fault_system(settings, tmp, sites)` runs the whole system (tests/fixtures/e2e.py's
`running_system`: job-store, one scheduler replica with `max_jobs` 1, the job-runner, and an
agent per site on its own broker user) with short timeouts, the sites of
tests/fixtures/fault_sites.py (a `slow_start` resource, a client job that can be held before
its first heartbeat), a watcher of the job status events and the invariant checker, as a
`Faults`:

* jobs: `submit(workflow, **flow_job options)`, `status`, `wait_status` (polls every 10 ms, so
  a fault can strike within a state that lasts a moment), `go` (lets a `Hold` job complete);
* faults: `kill(service)` (SIGKILL of its process group) and `restart(service)` for each of
  `SERVICES`, `freeze` / `thaw` (SIGSTOP / SIGCONT), and the processes of a job:
  `server_job`, `client_job`, `trainer`;
* `begin(scenario)` opens a `Trial` (its jobs and how each may end; `current` is the one under
  way); `verify(trial)` waits until its jobs are final, checks every invariant
  (tests/faults/invariants.py), the expected outcomes and that every service is up: an
  `Outcome`;
* `restore()`: undoes what a trial changed (`undo`), starts again whatever is down, thaws what
  is frozen and aborts what a failed trial left unfinished, so the next trial starts whole.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhive.config import Settings
from fedhive.errors import FedhiveError, NotFound
from fedhive.jobs.status import JobStatus
from tests.faults.invariants import Checker, JobEvents, JobProcess, Violation, job_processes
from tests.fixtures.e2e import SCHEDULER_OPTIONS, System, running_system
from tests.fixtures.fault_sites import CLIENT_JOB, RESOURCES
from tests.fixtures.infra import wait_for
from tests.fixtures.job_runner import RunnerProcess, flow_job
from tests.fixtures.rabbitmqctl import CTL
from tests.fixtures.site_agent import SiteAgentProcess

SERVICES = ("job-store", "scheduler", "job-runner", "site-agent")
# Sites answer allocate/deploy/start within 5 s (a slow_start takes 3); a client job that stops
# beating is judged gone after 3 s, a site after 3 s (the runner fixture's --site-ttl).
RUNNER_ARGS = ("--sync-timeout", "5", "--job-ttl", "3")
POLL_S = 0.01


class SetupFailed(AssertionError):
    """The system never reached the state a fault was to strike in."""


@dataclass
class Trial:
    """One scenario run: its jobs, the final statuses each may end in, what was seen when the
    fault struck, and what went wrong beyond the invariants (`problems`)."""

    scenario: str
    expect: dict[str, frozenset[JobStatus]] = field(default_factory=dict)
    struck_at: str = ""
    problems: list[str] = field(default_factory=list)
    sites_stay: bool = False  # no site may be judged gone from its jobs (the fault spared them)

    def job(self, job_id: str, *allowed: JobStatus) -> str:
        self.expect[job_id] = frozenset(allowed)
        return job_id


@dataclass
class Outcome:
    trial: Trial
    statuses: dict[str, JobStatus | None]  # None: the record is gone
    violations: list[Violation]
    unexpected: list[str]  # jobs that ended otherwise than expected, and the trial's problems

    @property
    def ok(self) -> bool:
        return not self.violations and not self.unexpected

    def describe(self) -> str:
        lines = [f"{self.trial.scenario} (struck at {self.trial.struck_at or '-'}): "
                 + ", ".join(f"{job} {s.value if s else 'gone'}"
                             for job, s in self.statuses.items())]
        lines += [f"  violation: {v}" for v in self.violations]
        lines += [f"  unexpected: {u}" for u in self.unexpected]
        return "\n".join(lines)


class Faults:
    def __init__(self, system: System, events: JobEvents, sites: int = 2) -> None:
        self.system = system
        self.events = events
        self.agents: list[SiteAgentProcess] = system.agents[:sites]
        self.extra_runners: list[RunnerProcess] = []
        self.frozen: set[int] = set()
        self.checker = Checker(system, events, self.runner_logs)
        self.current: Trial | None = None  # the trial under way (what a failed one left)
        self.undo: list[Callable[[], None]] = []  # what a trial changed, undone by restore

    def begin(self, scenario: str, **options: Any) -> Trial:
        self.current = Trial(scenario, **options)
        return self.current

    def close(self) -> None:
        self._undo()
        self.thaw()
        for runner in self.extra_runners:
            runner.stop()
        self.checker.close()
        self.events.close()

    @property
    def sites(self) -> list[str]:
        return [agent.site for agent in self.agents]

    @property
    def settings(self) -> Settings:
        return self.system.settings

    def runner_logs(self) -> list[Path]:
        return [self.system.runner.log_path, *(r.log_path for r in self.extra_runners)]

    # jobs -------------------------------------------------------------------------------------
    def submit(self, workflow: dict[str, Any], **options: Any) -> str:
        options.setdefault("sites", self.sites)
        return self.system.submit(flow_job(workflow, **options))

    def status(self, job_id: str) -> JobStatus:
        return self.system.job(job_id).status

    def wait_status(self, job_id: str, status: JobStatus, timeout: float = 40) -> None:
        """Until the job is `status`; SetupFailed when it ended otherwise or took too long."""
        deadline = time.monotonic() + timeout
        while (current := self.status(job_id)) is not status:
            if current.is_final or time.monotonic() > deadline:
                record = self.system.job(job_id)
                raise SetupFailed(f"job {job_id} never became {status.value}: it is "
                                  f"{current.value} ({record.status_reason})")
            time.sleep(POLL_S)

    def wait_until(self, what: str, condition: Any, timeout: float = 40) -> Any:
        try:
            return wait_for(condition, timeout=timeout, interval=POLL_S, what=what)
        except AssertionError as err:
            raise SetupFailed(str(err)) from None

    def go(self, job_id: str) -> None:
        self.system.go(job_id)

    # processes --------------------------------------------------------------------------------
    def kill(self, service: str, agent: int = 0) -> None:
        system = self.system
        if service == "job-store":
            system.store.kill()
        elif service == "scheduler":
            for scheduler in system.live_schedulers():
                system.kill(scheduler)
        elif service == "job-runner":
            system.runner.kill()
        elif service == "site-agent":
            self.agents[agent].kill()
        else:
            raise ValueError(f"unknown service {service!r}")

    def restart(self, service: str, agent: int = 0) -> None:
        system = self.system
        if service == "job-store":
            system.store.start()
            system.store.wait_ready(system.bus)
        elif service == "scheduler":
            system.start_scheduler(*SCHEDULER_OPTIONS)
        elif service == "job-runner":
            system.runner.start()
        elif service == "site-agent":
            self.agents[agent].launch()
        else:
            raise ValueError(f"unknown service {service!r}")

    def server_job(self, job_id: str) -> JobProcess | None:
        return next((p for p in job_processes([job_id]) if p.kind == "server job"), None)

    def client_job(self, job_id: str, agent: SiteAgentProcess) -> JobProcess | None:
        return next((p for p in job_processes([job_id]) if p.kind == "client job"
                     and Path(p.where) == agent.site_dir), None)

    def trainer(self, job_id: str, agent: SiteAgentProcess) -> JobProcess | None:
        return next((p for p in job_processes([job_id]) if p.kind == "trainer"
                     and p.where.startswith(str(agent.site_dir))), None)

    def site_pids(self, agent: SiteAgentProcess) -> list[int]:
        """The site's agent and the client jobs and trainers it runs (as a frozen host's)."""
        assert agent.proc is not None
        ours = [p.pid for p in job_processes(self._job_ids())
                if p.kind != "server job" and p.where.startswith(str(agent.site_dir))]
        return [agent.proc.pid, *ours]

    def _job_ids(self) -> list[str]:
        return [record.job_id for record in self.system.state.list_jobs()]

    def freeze(self, pids: Sequence[int]) -> None:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            self.frozen.add(pid)

    def thaw(self) -> None:
        for pid in sorted(self.frozen):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.frozen.clear()

    @staticmethod
    def kill_process(process: JobProcess, *, group: bool = True) -> None:
        """SIGKILL, as the OOM killer would (`group`: its whole process group)."""
        try:
            if group:
                os.killpg(process.pid, signal.SIGKILL)
            else:
                os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    # checks -----------------------------------------------------------------------------------
    def verify(self, trial: Trial, *, wait_s: float = 60, settle_s: float = 30) -> Outcome:
        violations = self.checker.check(list(trial.expect), wait_s=wait_s, settle_s=settle_s)
        statuses: dict[str, JobStatus | None] = {}
        unexpected = list(trial.problems)
        for job_id, allowed in trial.expect.items():
            try:
                record = self.system.job(job_id)
            except NotFound:
                statuses[job_id] = None
                continue
            statuses[job_id] = record.status
            if record.status.is_final and record.status not in allowed:
                unexpected.append(f"{job_id} ended {record.status.value} "
                                  f"({record.status_reason}), expected "
                                  f"{' or '.join(sorted(s.value for s in allowed))}")
            gone = {site: state["gone"] for site, state in record.site_states.items()
                    if state.get("gone")}
            if trial.sites_stay and gone:
                unexpected.append(f"{job_id}: sites judged gone: {gone}")
        unexpected += [f"the {name} is down after the trial (it did not survive the fault, or "
                       f"did not restart): {tail}" for name, tail in self.down().items()]
        return Outcome(trial, statuses, violations, unexpected)

    def down(self) -> dict[str, str]:
        """Services whose process is not running -> the end of its log (a trial that killed
        none must find none: one that exited on its own did not survive the fault)."""
        system = self.system
        found = {}
        if system.store.proc is None or system.store.proc.poll() is not None:
            found["job-store"] = system.store.log_tail(5)
        if system.runner.proc is None or system.runner.proc.poll() is not None:
            found["job-runner"] = system.runner.log()[-1000:]
        if not system.live_schedulers():
            found["scheduler"] = system.schedulers[-1].log()[-1000:]
        for agent in self.agents:
            if agent.proc is None or agent.proc.poll() is not None:
                found[f"site agent {agent.site}"] = agent.log()[-1000:]
        return found

    def restore(self) -> None:
        """Undo what the last trial changed, start again whatever is down (a trial that failed
        half-way), thaw what is frozen."""
        self._undo()
        self.thaw()
        for runner in self.extra_runners:
            runner.stop()
        self.extra_runners.clear()
        system = self.system
        if system.store.proc is None or system.store.proc.poll() is not None:
            self.restart("job-store")
        if system.runner.proc is None or system.runner.proc.poll() is not None:
            self.restart("job-runner")
        if not system.live_schedulers():
            self.restart("scheduler")
        for agent in self.agents:
            if agent.proc is None or agent.proc.poll() is not None:
                agent.launch()
        system.wait_online(*self.sites)
        self.end_leftovers()

    def _undo(self) -> None:
        while self.undo:
            self.undo.pop()()

    def end_leftovers(self) -> None:
        """Abort the jobs a failed trial left unfinished (a `Hold` job would hold the one slot
        for ever), and wait until they ended."""
        left = [r.job_id for r in self.system.state.list_jobs() if not r.status.is_final]
        for job_id in left:
            with suppress(FedhiveError):  # it may have ended meanwhile
                self.system.abort(job_id)
        self.checker.wait_final(left, 60)


@contextmanager
def fault_system(settings: Settings, tmp: Path, sites: Sequence[str], *,
                 ctl: Sequence[str] = CTL, clean_broker: bool = True,
                 ) -> Iterator[Faults]:
    tmp.mkdir(parents=True, exist_ok=True)
    with running_system(settings, tmp, sites, launched=len(sites), schedulers=1,
                        runner_args=RUNNER_ARGS, ctl=ctl, clean_broker=clean_broker,
                        resources=RESOURCES, client_job_module=CLIENT_JOB) as system:
        faults = Faults(system, JobEvents(system.bus), sites=len(sites))
        try:
            yield faults
        finally:
            faults.close()
