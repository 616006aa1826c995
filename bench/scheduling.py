"""Benchmark: how fast an idle fedhive starts a job, and how fast it drains 100 jobs.

Runs the real services as subprocesses on a namespace of its own: the job-store, the scheduler
(`--max-jobs 4`), the job-runner (which also runs the heartbeat intake) and two site agents,
each connected as its own broker user (made with deploy/broker_users.py and deleted at the end;
the intake only accepts heartbeats a site sends as itself). Jobs are tiny: a server workflow
that completes at once (tests/fixtures/job_runner.py's `Done`) and the placeholder client job.

* `submit_to_running_*`: 20 jobs one after another, each waited until final before the next:
  from the submit request (StoreSubmitJob on the bus, archive already staged in S3) to the
  RUNNING entry of the job's status history. `phases_ms` splits it, from the history
  timestamps: submit request -> SUBMITTED (job-store), SUBMITTED -> DISPATCHED (scheduler),
  DISPATCHED -> RUNNING (job-runner: allocate, deploy, start the server job and client jobs),
  RUNNING -> final (the job itself and its clean-up).
* `jobs100_total_s`: 100 jobs submitted at once; from the first submit until all are final.

    .venv/bin/python bench/scheduling.py [--sequential 20] [--jobs 100] [--max-jobs 4]

RabbitMQ (as a user that may run rabbitmqctl) and Redis from the environment; S3 too when
FEDHIVE_S3_ENDPOINT_URL is set, otherwise a SeaweedFS started here. Prints JSON and writes
bench/results/scheduling.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.fixtures (the service launchers, SeaweedFS)

from support import bench_settings, load_average, write_results  # noqa: E402  (bench/support.py, beside this script)

from fedhive.blobs import S3BlobStore  # noqa: E402
from fedhive.bus import RabbitBus  # noqa: E402
from fedhive.config import Settings  # noqa: E402
from fedhive.jobs.record import JobRecord  # noqa: E402
from fedhive.jobs.status import JobStatus  # noqa: E402
from fedhive.logging import configure  # noqa: E402
from fedhive.names import Names  # noqa: E402
from fedhive.proto.v1 import admin_pb2, job_pb2, jobstore_pb2  # noqa: E402
from fedhive.state import RedisStateStore  # noqa: E402
from tests.fixtures.gateway import clean_namespace  # noqa: E402
from tests.fixtures.infra import stop_process, wait_for  # noqa: E402
from tests.fixtures.job_runner import RunnerProcess, flow, flow_job  # noqa: E402
from tests.fixtures.job_store import JobStoreProcess, service_env, stage  # noqa: E402
from tests.fixtures.site_agent import (  # noqa: E402
    SiteAgentProcess,
    SiteUsers,
    storage_url,
    write_site,
)

S = JobStatus
SUBMITTER = job_pb2.Submitter(name="bench@a", org="a", role="lead")
PHASES = (("submit_to_submitted", None, S.SUBMITTED), ("submitted_to_dispatched", S.SUBMITTED,
          S.DISPATCHED), ("dispatched_to_running", S.DISPATCHED, S.RUNNING))


def start_scheduler(settings: Settings, log_path: Path, max_jobs: int) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from fedhive_services.scheduler.main import main; main()",
             "--max-jobs", str(max_jobs)],
            env=service_env(settings), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)

    def started() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"scheduler exited {proc.returncode}: {log_path.read_text()}")
        return b'"service.started"' in log_path.read_bytes()

    wait_for(started, timeout=30, what="the scheduler to start")
    return proc


@contextmanager
def running_services(settings: Settings, tmp: Path, sites: Sequence[str], max_jobs: int,
                     runner_args: Sequence[str] = (), **site_fields: Any,
                     ) -> Iterator[tuple[RabbitBus, RedisStateStore]]:
    """Job-store, job-runner (with the heartbeat intake; `runner_args` added to the test
    fixture's), the site agents (online; their site.json takes `site_fields`) and the
    scheduler; a client bus and the state store. Everything is stopped on exit."""
    with ExitStack() as stack:
        bus = RabbitBus(settings, name="bench-scheduling")
        stack.callback(bus.close)
        state = RedisStateStore.from_settings(settings)
        stack.callback(state.close)
        job_store = JobStoreProcess(settings, tmp / "job-store.log")
        stack.callback(job_store.stop)
        job_store.start()
        job_store.wait_ready(bus)
        stack.callback(RunnerProcess(settings, tmp, *runner_args).start().stop)
        users = SiteUsers(settings)
        stack.callback(users.close)
        urls = users.url(*sites)
        for site in sites:
            site_dir = write_site(tmp / site, site=site, broker_url=urls[site],
                                  namespace=settings.namespace, storage_url=storage_url(settings),
                                  services_user=bus.user, **site_fields)
            stack.callback(SiteAgentProcess(site, site_dir, settings.namespace, bus)
                           .launch().stop)
        wait_for(lambda: set(sites) <= set(state.online_sites()), timeout=30,
                 what="the sites to come online")
        stack.callback(stop_process, start_scheduler(settings, tmp / "scheduler.log", max_jobs))
        yield bus, state


def submit(bus: RabbitBus, names: Names, staged: str) -> str:
    reply = bus.call(names.service_queue("job-store"),
                     jobstore_pb2.StoreSubmitJob(staging_key=staged, submitter=SUBMITTER),
                     admin_pb2.SubmitJobReply, timeout=30)
    return reply.job_id


def wait_final(state: RedisStateStore, job_ids: Sequence[str], timeout: float) -> list[JobRecord]:
    records: dict[str, JobRecord] = {}

    def all_final() -> bool:
        for job_id in job_ids:
            if job_id not in records:
                record = state.get_job(job_id)
                if record.status.is_final:
                    records[job_id] = record
        return len(records) == len(job_ids)

    wait_for(all_final, timeout=timeout, what=f"{len(job_ids)} jobs to finish")
    return [records[job_id] for job_id in job_ids]


def at_ms(record: JobRecord, status: JobStatus) -> int:
    return next(c.at_ms for c in record.history if c.to_status == status)


def phases(record: JobRecord, submitted_ms: float) -> dict[str, float]:
    """Milliseconds of each phase of one job, from the request time and its status history."""
    found = {}
    for name, start, end in PHASES:
        found[name] = at_ms(record, end) - (submitted_ms if start is None else at_ms(record, start))
    found["submit_to_running"] = at_ms(record, S.RUNNING) - submitted_ms
    found["running_to_final"] = record.history[-1].at_ms - at_ms(record, S.RUNNING)
    return found


def summary(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median": round(statistics.median(ordered), 1),
            "p95": round(ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))], 1),
            "max": round(ordered[-1], 1)}


def run(sequential: int, jobs: int, max_jobs: int) -> dict[str, Any]:
    namespace = f"bench-sched-{secrets.token_hex(3)}"
    sites = [f"{namespace}-s1", f"{namespace}-s2"]
    archive = flow_job(flow("Done"), sites=sites, name="tiny")
    results: dict[str, Any] = {}
    with bench_settings(namespace) as (settings, s3), tempfile.TemporaryDirectory() as tmp:
        names = Names(namespace)
        blobs = S3BlobStore.from_settings(settings)
        load_before = load_average()
        try:
            with running_services(settings, Path(tmp), sites, max_jobs) as (bus, state):
                wait_final(state, [submit(bus, names, stage(blobs, names, archive))], 60)
                per_job = []
                for _ in range(sequential):
                    staged = stage(blobs, names, archive)
                    before_ms = time.time() * 1000
                    (record,) = wait_final(state, [submit(bus, names, staged)], 60)
                    assert record.status == S.FINISHED_COMPLETED, record.history
                    per_job.append(phases(record, before_ms))
                running = [p["submit_to_running"] for p in per_job]
                results["submit_to_running_median_ms"] = summary(running)["median"]
                results["submit_to_running_p95_ms"] = summary(running)["p95"]
                results["phases_ms"] = {name: summary([p[name] for p in per_job])
                                        for name in per_job[0]}
                staged_all = [stage(blobs, names, archive) for _ in range(jobs)]
                start = time.perf_counter()
                job_ids = [submit(bus, names, key) for key in staged_all]
                results["jobs100_submit_s"] = round(time.perf_counter() - start, 2)
                records = wait_final(state, job_ids, 600)
                results["jobs100_total_s"] = round(time.perf_counter() - start, 2)
                results["jobs100_phases_ms"] = {
                    name: summary([at_ms(r, end) - at_ms(r, begin) for r in records])
                    for name, begin, end in PHASES[1:]}
                results["jobs100_statuses"] = sorted({r.status.value for r in records})
        finally:
            blobs.close()
            clean_namespace(settings)
    results.update(goals={"submit_to_running_median_ms": 500, "jobs100_total_s": 60},
                   sequential_jobs=sequential, jobs=jobs, max_jobs=max_jobs, s3=s3,
                   python=platform.python_version(), cpus=os.cpu_count(),
                   loadavg_1_5_15_at_start=load_before,
                   loadavg_1_5_15_at_end=load_average(),
                   command=" ".join(["bench/scheduling.py", *sys.argv[1:]]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequential", type=int, default=20, help="jobs run one at a time")
    parser.add_argument("--jobs", type=int, default=100, help="jobs submitted at once")
    parser.add_argument("--max-jobs", type=int, default=4, help="the scheduler's --max-jobs")
    parser.add_argument("--output", type=Path, default=ROOT / "bench/results/scheduling.json")
    args = parser.parse_args()
    configure("bench-scheduling", level="WARNING")  # logs to stderr: stdout is the JSON result
    results = run(args.sequential, args.jobs, args.max_jobs)
    write_results(results, args.output)


if __name__ == "__main__":
    main()
