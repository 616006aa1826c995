"""The fault suite's invariant checker: what must hold of every job whatever died when, read
from the job records in Redis (their status history), the job status events, the services'
logs, the site agents and the machine's processes. Used after every scenario by tests/faults
and bench/faults.py.

For each job:
* `stuck`: it reached a final status (within the wait);
* `final_status`: its history holds exactly one FINISHED:* entry, the record's status; the
  status events announced no other final status;
* `run_twice`: one DISPATCHED -> RUNNING change; one server job launched (the job-runners'
  `job_runner.server_job_launched`; a re-attach is not a launch); at most one client job per
  site (its `client_job.reported` lines, the agent's `site_agent.started` lines);
* `lost`: its record exists; a FINISHED:COMPLETED job's result object is in S3;
* `allocation_left` (once ended): no live site agent holds resources for it or runs it
  (`ListSiteJobsRequest`), no job-runner keeps it in the running-jobs table;
* `process_left` (once ended): no server job (by working directory), client job (by command
  line) or trainer (by `FEDHIVE_JOB_ID`) of it is alive on this machine.

The last two are given time to settle: ending a job is asynchronous (sites are told, client
jobs end their run), so they are polled until they hold or `settle_s` ran out.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
from google.protobuf.message import Message

from fedhive.bus import Delivery, RabbitBus
from fedhive.client.pipe import ENV_JOB_ID
from fedhive.errors import FedhiveError, NotFound
from fedhive.jobs.record import JobRecord
from fedhive.jobs.serde import status_from_proto
from fedhive.jobs.status import JobStatus
from fedhive.names import Names
from fedhive.proto.v1 import job_pb2, site_pb2
from fedhive.state.runs import RunTable
from fedhive.structs import struct_to_dict
from tests.fixtures.e2e import System
from tests.fixtures.site_agent import SiteAgentProcess

KINDS = ("lost", "final_status", "run_twice", "stuck", "process_left", "allocation_left")
SETTLING = ("process_left", "allocation_left")
_SJ_CWD = re.compile(r"/([A-Za-z0-9][A-Za-z0-9_-]*)/workspace(?: \(deleted\))?$")


@dataclass(frozen=True)
class Violation:
    job_id: str
    kind: str  # one of KINDS
    what: str
    evidence: str

    def __str__(self) -> str:
        return f"{self.job_id}: {self.kind}: {self.what} [{self.evidence}]"


class JobEvents:
    """Every job status event of the namespace (`job.status.*`), from now on."""

    def __init__(self, bus: RabbitBus, consumer: str = "faults-watch") -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, list[JobStatus]] = defaultdict(list)
        self._consumer = bus.subscribe(consumer, [Names.job_status_event("*")], self._on,
                                       [job_pb2.JobStatusEvent])

    def _on(self, message: Message, delivery: Delivery) -> None:
        assert isinstance(message, job_pb2.JobStatusEvent)
        status = status_from_proto(message.change.to_status)
        if status is not None:
            with self._lock:
                self._seen[message.job_id].append(status)

    def finals(self, job_id: str) -> set[JobStatus]:
        with self._lock:
            return {status for status in self._seen.get(job_id, []) if status.is_final}

    def close(self) -> None:
        self._consumer.stop()


@dataclass(frozen=True)
class JobProcess:
    job_id: str
    kind: str  # "server job", "client job", "trainer"
    pid: int
    where: str  # a client job's site folder, else the process's working directory
    evidence: str  # how it was recognised

    def __str__(self) -> str:
        return f"{self.kind} pid {self.pid} ({self.evidence})"


def job_processes(job_ids: Iterable[str]) -> list[JobProcess]:
    """The live server jobs, client jobs and trainers of `job_ids` on this machine."""
    wanted = set(job_ids)
    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline", "cwd", "status"]):
        info = proc.info
        if info["status"] == psutil.STATUS_ZOMBIE:
            continue
        cmdline: list[str] = info["cmdline"] or []
        cwd: str = info["cwd"] or ""
        if "--job-id" in cmdline[:-1]:
            job_id = cmdline[cmdline.index("--job-id") + 1]
            if job_id in wanted and "--site-dir" in cmdline[:-1]:
                site_dir = cmdline[cmdline.index("--site-dir") + 1]
                found.append(JobProcess(job_id, "client job", proc.pid, site_dir,
                                        " ".join(cmdline)[-200:]))
            continue
        match = _SJ_CWD.search(cwd)
        if match and match.group(1) in wanted:
            found.append(JobProcess(match.group(1), "server job", proc.pid, cwd, f"cwd {cwd}"))
            continue
        if not (info["name"] or "").startswith("python"):
            continue
        try:
            job_id = proc.environ().get(ENV_JOB_ID, "")
        except psutil.Error:
            continue
        if job_id in wanted:
            found.append(JobProcess(job_id, "trainer", proc.pid, cwd,
                                    f"{ENV_JOB_ID}={job_id}: {' '.join(cmdline)[-120:]}"))
    return found


def _count(path: Path, *needles: str) -> int:
    if not path.exists():
        return 0
    return sum(all(n in line for n in needles)
               for line in path.read_text(errors="replace").splitlines())


class Checker:
    """Checks jobs of `system`; `runner_logs` lists the logs of every job-runner that ran."""

    def __init__(self, system: System, events: JobEvents,
                 runner_logs: Callable[[], Sequence[Path]]) -> None:
        self.system = system
        self.events = events
        self.runner_logs = runner_logs
        self.runs = RunTable.from_settings(system.settings)

    def close(self) -> None:
        self.runs.close()

    def check(self, job_ids: Sequence[str], *, wait_s: float = 60,
              settle_s: float = 30) -> list[Violation]:
        records = self.wait_final(job_ids, wait_s)
        found: list[Violation] = []
        for job_id in job_ids:
            record = records.get(job_id)
            if record is None:
                found.append(Violation(job_id, "lost", "its job record is gone",
                                       "NotFound in Redis"))
                continue
            found += self.check_record(record)
        ended = [r.job_id for r in records.values() if r.status.is_final]
        deadline = time.monotonic() + settle_s
        while True:
            settling = self.leftovers(ended)
            if not settling or time.monotonic() > deadline:
                return found + settling
            time.sleep(0.5)

    def wait_final(self, job_ids: Sequence[str], wait_s: float) -> dict[str, JobRecord]:
        """The records once every job is final, or as they are after `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            records = {}
            for job_id in job_ids:
                with contextlib.suppress(NotFound):
                    records[job_id] = self.system.state.get_job(job_id)
            if all(r.status.is_final for r in records.values()) \
                    or time.monotonic() > deadline:
                return records
            time.sleep(0.2)

    def check_record(self, record: JobRecord) -> list[Violation]:
        job_id = record.job_id
        found = []

        def violation(kind: str, what: str, evidence: str) -> None:
            found.append(Violation(job_id, kind, what, evidence))

        history = " -> ".join(change.to_status.value for change in record.history)
        if not record.status.is_final:
            violation("stuck", f"still {record.status.value}",
                      f"reason {record.status_reason!r}; history {history}")
        finals = [c.to_status for c in record.history if c.to_status.is_final]
        if record.status.is_final and finals != [record.status]:
            violation("final_status", f"{len(finals)} final entries in its history",
                      f"record {record.status.value}; history {history}")
        announced = self.events.finals(job_id) - {record.status}
        if announced:
            violation("final_status", "a status event announced another final status",
                      f"events {sorted(s.value for s in announced)}; record "
                      f"{record.status.value}")
        starts = sum(c.to_status is JobStatus.RUNNING for c in record.history)
        if starts > 1:
            violation("run_twice", f"{starts} changes to RUNNING", f"history {history}")
        launches = {str(log.name): n for log in self.runner_logs()
                    if (n := _count(log, '"job_runner.server_job_launched"',
                                    f'"job_id": "{job_id}"'))}
        if sum(launches.values()) > 1:
            violation("run_twice", f"{sum(launches.values())} server jobs launched",
                      f"job_runner.server_job_launched lines {launches}")
        for agent in self.system.agents:
            found += self._client_jobs(job_id, agent)
        if record.status is JobStatus.FINISHED_COMPLETED:
            if not record.result_key:
                violation("lost", "completed without a result key", f"history {history}")
            elif not self.system.blobs.exists(record.result_key):
                violation("lost", "its result object is not in S3", record.result_key)
        return found

    def _client_jobs(self, job_id: str, agent: SiteAgentProcess) -> list[Violation]:
        log = agent.workspace / ".agent" / "jobs" / f"{job_id}.log"
        reported = _count(log, "client_job.reported")
        started = _count(agent.log_path, '"site_agent.started"', f'"job_id": "{job_id}"')
        if reported > 1 or started > 1:
            return [Violation(job_id, "run_twice", f"{max(reported, started)} client jobs at "
                              f"{agent.site}", f"client_job.reported lines {reported} in "
                              f"{log.name}; site_agent.started lines {started}")]
        return []

    def leftovers(self, job_ids: Sequence[str]) -> list[Violation]:
        """What ended jobs still hold: processes, site allocations, running-jobs entries."""
        if not job_ids:
            return []
        found = [Violation(p.job_id, "process_left", f"its {p.kind} still runs", str(p))
                 for p in job_processes(job_ids)]
        ended = set(job_ids)
        for agent in self.system.agents:
            if agent.proc is None or agent.proc.poll() is not None:
                continue
            try:
                jobs = agent.call(site_pb2.ListSiteJobsRequest(), site_pb2.ListSiteJobsReply,
                                  timeout=10).jobs
            except FedhiveError as err:
                found.append(Violation("-", "allocation_left", f"site {agent.site} did not "
                                       "list its jobs", str(err)))
                continue
            for job in jobs:
                if job.job_id in ended and (job.state == "RUNNING" or job.allocation.fields):
                    found.append(Violation(
                        job.job_id, "allocation_left", f"site {agent.site} still holds it",
                        f"state {job.state}, allocation {struct_to_dict(job.allocation)}, "
                        f"pid {job.pid}"))
        for entry in self.runs.all():
            if entry.job_id in ended:
                found.append(Violation(entry.job_id, "allocation_left",
                                       "still in the running-jobs table",
                                       f"runner {entry.runner}, phase {entry.phase}"))
        return found


def report(violations: Sequence[Violation]) -> str:
    return "\n".join(str(v) for v in violations)
