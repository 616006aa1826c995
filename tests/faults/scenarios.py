"""The fault scenarios, shared by tests/faults (each once, at a chosen state) and
bench/faults.py (at random, at random moments). Each drives a `Faults` system into a state,
strikes, lets the system heal and returns the `Trial` (its jobs and the final statuses they may
end in); `Faults.verify(trial)` then checks every invariant.

Jobs are small: tests/fixtures/job_runner.py's workflows (`Hold` parks a job in RUNNING until
`go`, `Watch` completes once the runner says a site is gone, writing `gone.json`), and for the
trainer a one-round ScatterAndGather whose sites train through `ClientAPIExecutor`.
`delay`: how long after reaching the state the fault strikes (the soak's random moment).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from fedhive.jobs.status import JobStatus
from fedhive.names import Names
from tests.faults.harness import SERVICES, Faults, SetupFailed, Trial
from tests.fixtures.fault_sites import HOLD_BEFORE_REPORT, HOLD_TRAINER, SLOW_START, TRAINER
from tests.fixtures.job_runner import RunnerProcess, flow
from tests.fixtures.job_store import _zip
from tests.fixtures.private_infra import PrivateBroker, PrivateRedis
from tests.fixtures.site_agent import REPO
from tests.fixtures.tripwire import Tripwire

S = JobStatus
HOLD = flow("Hold")
DONE = flow("Done", message="faults")
WATCH = flow("Watch")
STATES = (S.SUBMITTED, S.DISPATCHED, S.RUNNING)
NUMPY_SERVER = REPO / "examples" / "hello-numpy" / "app" / "config" / "config_fed_server.json"
EXECUTOR = "fedhive.fl.client_api_executor.ClientAPIExecutor"


def _strike(faults: Faults, trial: Trial, job_id: str, delay: float) -> None:
    time.sleep(delay)
    trial.struck_at = faults.status(job_id).value


# control-plane services and site agents ---------------------------------------------------
def kill_service(faults: Faults, service: str, state: JobStatus, *, delay: float = 0.0,
                 agent: int = 0) -> Trial:
    """SIGKILL of `service` while a job is `state`, then a restart: every job completes, once.

    SUBMITTED: a `Hold` job holds the one slot (`max_jobs` 1), so the next job waits SUBMITTED.
    DISPATCHED: the job-runner is stopped first (the dispatch waits in its queue) unless it is
    the one killed, in which case it dies mid-dispatch. RUNNING: a `Hold` job."""
    # A killed site agent's client jobs are re-adopted by the restarted one: not gone.
    trial = faults.begin(f"kill {service} at {state.value}", sites_stay=True)

    def strike(job_id: str) -> None:
        _strike(faults, trial, job_id, delay)
        faults.kill(service, agent)
        faults.restart(service, agent)

    if state is S.SUBMITTED:
        blocker = trial.job(faults.submit(HOLD), S.FINISHED_COMPLETED)
        faults.wait_status(blocker, S.RUNNING)
        job_id = trial.job(faults.submit(DONE), S.FINISHED_COMPLETED)
        strike(job_id)
        faults.go(blocker)
    elif state is S.DISPATCHED:
        parked = service != "job-runner"
        if parked:
            faults.system.runner.stop()
        job_id = trial.job(faults.submit(HOLD), S.FINISHED_COMPLETED)
        faults.wait_status(job_id, S.DISPATCHED)
        strike(job_id)
        if parked:
            faults.restart("job-runner")
        faults.wait_status(job_id, S.RUNNING)
        faults.go(job_id)
    else:
        job_id = trial.job(faults.submit(HOLD), S.FINISHED_COMPLETED)
        faults.wait_status(job_id, S.RUNNING)
        strike(job_id)
        faults.go(job_id)
    return trial


# a job's own processes ----------------------------------------------------------------------
def _slow_start(faults: Faults) -> dict[str, dict[str, int]]:
    """A resource_spec that keeps a job DISPATCHED for a slow start at the second site (its
    server job and the first site's client job already running)."""
    return {faults.sites[1]: {SLOW_START: 1}}


def kill_server_job(faults: Faults, state: JobStatus, *, delay: float = 0.0) -> Trial:
    """SIGKILL of a job's server job while the job is DISPATCHED (the sites are still being
    started) or RUNNING: the job ends ABNORMAL (or FAILED_TO_RUN when it never ran)."""
    trial = faults.begin(f"kill the server job at {state.value}")
    if state is S.DISPATCHED:
        job_id = trial.job(faults.submit(HOLD, resource_spec=_slow_start(faults)),
                           S.FINISHED_ABNORMAL, S.FINISHED_FAILED_TO_RUN)
        faults.wait_until(f"the server job of {job_id} while DISPATCHED",
                          lambda: faults.server_job(job_id)
                          and faults.status(job_id) is S.DISPATCHED)
    else:
        job_id = trial.job(faults.submit(HOLD), S.FINISHED_ABNORMAL)
        faults.wait_status(job_id, S.RUNNING)
    _strike(faults, trial, job_id, delay)
    server_job = faults.server_job(job_id)
    if server_job is None:
        raise SetupFailed(f"the server job of {job_id} is gone before the fault")
    faults.kill_process(server_job)
    return trial


def kill_client_job(faults: Faults, state: JobStatus, *, after_heartbeat: bool,
                    delay: float = 0.0) -> Trial:
    """SIGKILL of the first site's client job before its first job heartbeat (held before its
    report) or after it, while the job is DISPATCHED or RUNNING. The job runs `Watch`: it
    completes once the runner tells its server job the site is gone (`gone.json`)."""
    when = "after" if after_heartbeat else "before"
    trial = faults.begin(f"kill a client job {when} its first heartbeat at {state.value}")
    agent = faults.agents[0]
    files = {} if after_heartbeat else {HOLD_BEFORE_REPORT: agent.site.encode()}
    allowed = [S.FINISHED_COMPLETED]
    options = {}
    if state is S.DISPATCHED:
        options["resource_spec"] = _slow_start(faults)
        allowed.append(S.FINISHED_FAILED_TO_RUN)  # a site left during the start: minimums
    job_id = trial.job(faults.submit(WATCH, client_files=files, **options), *allowed)
    if state is S.RUNNING:
        faults.wait_status(job_id, S.RUNNING)

    def ready() -> bool:
        if faults.client_job(job_id, agent) is None:
            return False
        beat = faults.system.state.get_job_heartbeat(job_id, agent.site)
        return beat is not None if after_heartbeat else True

    faults.wait_until(f"the client job of {job_id} at {agent.site}", ready)
    if state is S.DISPATCHED and faults.status(job_id) is not S.DISPATCHED:
        raise SetupFailed(f"job {job_id} left DISPATCHED before its client job was ready")
    _strike(faults, trial, job_id, delay)
    client_job = faults.client_job(job_id, agent)
    if client_job is None:
        raise SetupFailed(f"the client job of {job_id} at {agent.site} is gone before the fault")
    faults.kill_process(client_job)
    return trial


def trainer_job(sites: list[str], held: str) -> bytes:
    """One round of ScatterAndGather (both sites needed) over hello-numpy's model; sites train
    through ClientAPIExecutor with tests/fixtures/fault_sites.py's TRAINER, which waits inside
    the task at `held`."""
    server = json.loads(NUMPY_SERVER.read_text())
    server["workflows"][0]["args"].update(num_rounds=1, min_clients=len(sites))
    client = {"format_version": 2, "executors": [{"tasks": ["train"], "executor": {
        "path": EXECUTOR, "args": {"command": "python -m fault_trainer", "launch_once": True}}}]}
    meta = {"name": "trainer", "resource_spec": {}, "min_clients": len(sites),
            "deploy_map": {"srv": ["server"], "cli": sites}}
    return _zip({
        "meta.json": json.dumps(meta).encode(),
        "srv/config/config_fed_server.json": json.dumps(server).encode(),
        "cli/config/config_fed_client.json": json.dumps(client).encode(),
        "cli/custom/fault_trainer.py": TRAINER.encode(),
        f"cli/{HOLD_TRAINER}": held.encode(),
    })


def kill_trainer(faults: Faults, *, delay: float = 0.0) -> Trial:
    """SIGKILL of a trainer in the middle of its task (it exists only while the job runs): the
    task fails at that site and ScatterAndGather, which needs both sites, fails the job."""
    trial = faults.begin("kill a trainer at RUNNING")
    agent = faults.agents[0]
    job_id = trial.job(faults.system.submit(trainer_job(faults.sites, agent.site)),
                       S.FINISHED_EXECUTION_EXCEPTION)
    faults.wait_status(job_id, S.RUNNING)
    faults.wait_until(f"the trainer of {job_id} at {agent.site}",
                      lambda: faults.trainer(job_id, agent), timeout=60)
    _strike(faults, trial, job_id, delay)
    trainer = faults.trainer(job_id, agent)
    if trainer is None:
        raise SetupFailed(f"the trainer of {job_id} at {agent.site} is gone before the fault")
    faults.kill_process(trainer, group=False)  # it shares its client job's process group
    return trial


# runners, sites -----------------------------------------------------------------------------
def second_runner_same_id(faults: Faults) -> Trial:
    """A second job-runner with the running one's `--runner-id` refuses to start; a job then
    runs once, on the first."""
    trial = faults.begin("a second job-runner with the same id")
    duplicate = RunnerProcess(faults.settings, faults.system.tmp, name="job-runner-same-id")
    faults.extra_runners.append(duplicate)
    code, output = duplicate.refused()
    if code != 2 or "is in use by the live job-runner" not in output:
        trial.problems.append(f"a second runner with the same id exited {code}: "
                              f"{output.strip()[-300:]}")
    job_id = trial.job(faults.submit(HOLD), S.FINISHED_COMPLETED)
    faults.wait_status(job_id, S.RUNNING)
    faults.go(job_id)
    return trial


def two_runners(faults: Faults, jobs: int = 4) -> Trial:
    """A second job-runner with an id of its own: both take dispatches from the one queue, and
    no job runs twice."""
    trial = faults.begin("two job-runners with different ids")
    second = RunnerProcess(faults.settings, faults.system.tmp, "--runner-id", "runner-two",
                           name="job-runner-two").start()
    faults.extra_runners.append(second)
    for _ in range(jobs):
        trial.job(faults.submit(DONE), S.FINISHED_COMPLETED)
    faults.checker.wait_final(list(trial.expect), 60)
    for runner in (faults.system.runner, second):
        if not any(runner.logged("job_runner.server_job_launched", job_id=job_id)
                   for job_id in trial.expect):
            trial.problems.append(f"{runner.log_path.name} ran none of {jobs} jobs")
    return trial


def freeze_site(faults: Faults, *, delay: float = 0.0) -> Trial:
    """A whole site (agent, client jobs) frozen by SIGSTOP past its heartbeat timeout while a
    `Watch` job runs, until the runner judged it gone (the site went offline, or its client job
    stopped reporting), then resumed by SIGCONT: the job completes, and the site ends what it
    still ran for it."""
    trial = faults.begin("a site frozen past its heartbeat timeout")
    agent = faults.agents[0]
    job_id = trial.job(faults.submit(WATCH), S.FINISHED_COMPLETED)
    faults.wait_status(job_id, S.RUNNING)
    faults.wait_until(f"the first heartbeat of {job_id} at {agent.site}",
                      lambda: faults.system.state.get_job_heartbeat(job_id, agent.site))
    _strike(faults, trial, job_id, delay)
    faults.freeze(faults.site_pids(agent))
    try:
        faults.wait_until(f"{agent.site} judged gone from {job_id}",
                          lambda: faults.system.job(job_id).site_states[agent.site]["gone"])
    finally:
        faults.thaw()
    return trial


# the infrastructure (a private broker node and Redis) -----------------------------------------
def restart_broker(faults: Faults, broker: PrivateBroker, *, outage_s: float = 5.0,
                   delay: float = 0.0) -> Trial:
    """The broker stops for longer than a site's heartbeat timeout while a job runs, and comes
    back: no site is judged gone on what the runner missed while cut off, the job completes,
    and the next job runs."""
    trial = faults.begin(f"broker down {outage_s:g} s", sites_stay=True)
    job_id = trial.job(faults.submit(HOLD), S.FINISHED_COMPLETED)
    faults.wait_status(job_id, S.RUNNING)
    _strike(faults, trial, job_id, delay)
    broker.stop_app()
    try:
        time.sleep(outage_s)
    finally:
        broker.start_app()
    faults.system.wait_online(*faults.sites, timeout=60)
    faults.go(job_id)
    trial.job(faults.submit(DONE), S.FINISHED_COMPLETED)
    return trial


def restart_redis(faults: Faults, redis: PrivateRedis, state: JobStatus = S.RUNNING, *,
                  outage_s: float = 3.0, delay: float = 0.0) -> Trial:
    """Redis is killed (SIGKILL) while a job is DISPATCHED (the runner is starting it) or
    RUNNING, and restarted from its append-only file: the job's record survives, it completes,
    and the next job runs."""
    trial = faults.begin(f"Redis killed at {state.value}, down {outage_s:g} s",
                         sites_stay=True)
    job_id = trial.job(faults.submit(HOLD), S.FINISHED_COMPLETED)
    faults.wait_status(job_id, state)
    _strike(faults, trial, job_id, delay)
    redis.kill()
    try:
        time.sleep(outage_s)
    finally:
        redis.start()
    faults.wait_status(job_id, S.RUNNING, timeout=60)
    faults.go(job_id)
    trial.job(faults.submit(DONE), S.FINISHED_COMPLETED)
    return trial


def cut_redis_as_a_job_starts(faults: Faults, *, outage_s: float = 3.0) -> Trial:
    """The job-runner loses Redis right after its DISPATCHED -> RUNNING was answered, before
    its next write (its Redis connections go through a tripwire that cuts them then, and
    refuses new ones for `outage_s`): the job must still be watched to its end, and the next
    job run. The runner keeps the tripwire (healed) until `restore()`: a restart would hide
    what the running process left undone."""
    trial = faults.begin("the runner cut from Redis as a job turns RUNNING", sites_stay=True)
    runner = faults.system.runner
    direct = runner.settings
    upstream = urlsplit(direct.redis_url)
    wire = Tripwire(upstream.hostname or "127.0.0.1", upstream.port or 6379)

    def undo() -> None:
        runner.stop()
        runner.settings = direct
        runner.start()
        wire.close()

    runner.stop()
    runner.settings = replace(direct, redis_url=wire.for_url(direct.redis_url))
    faults.undo.append(undo)
    runner.start()
    names = Names(faults.settings.namespace)
    wire.arm(names.jobs_by_status_key(S.DISPATCHED.value).encode(),
             names.jobs_by_status_key(S.RUNNING.value).encode())  # only the CAS names both
    job_id = trial.job(faults.submit(HOLD), S.FINISHED_COMPLETED)
    if not wire.tripped.wait(40):
        raise SetupFailed(f"job {job_id} never turned RUNNING")
    trial.struck_at = "DISPATCHED -> RUNNING"
    time.sleep(outage_s)
    wire.heal()
    faults.wait_status(job_id, S.RUNNING)
    faults.go(job_id)
    trial.job(faults.submit(DONE), S.FINISHED_COMPLETED)
    return trial


def gone_sites(faults: Faults, job_id: str) -> dict[str, str]:
    """What a completed `Watch` job's server job was told: site -> why it is gone."""
    record = faults.system.job(job_id)
    found: dict[str, str] = json.loads(faults.system.result(record)["gone.json"])
    return found


# the soak's draw ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[Faults, random.Random], Trial]


def _random_service(faults: Faults, rng: random.Random) -> Trial:
    service = rng.choice(SERVICES)
    return kill_service(faults, service, rng.choice(STATES), delay=rng.uniform(0, 0.5),
                        agent=rng.randrange(len(faults.agents)))


SCENARIOS = (
    Scenario("kill a service", _random_service),
    Scenario("kill a server job", lambda f, rng: kill_server_job(
        f, rng.choice((S.DISPATCHED, S.RUNNING)), delay=rng.uniform(0, 0.5))),
    Scenario("kill a client job", lambda f, rng: kill_client_job(
        f, rng.choice((S.DISPATCHED, S.RUNNING)), after_heartbeat=rng.random() < 0.5,
        delay=rng.uniform(0, 0.5))),
    Scenario("kill a trainer", lambda f, rng: kill_trainer(f, delay=rng.uniform(0, 1))),
    Scenario("a second runner with the same id", lambda f, rng: second_runner_same_id(f)),
    Scenario("two runners", lambda f, rng: two_runners(f, jobs=rng.randint(2, 4))),
    Scenario("freeze a site", lambda f, rng: freeze_site(f, delay=rng.uniform(0, 1))),
    Scenario("cut the runner from Redis as a job turns RUNNING",
             lambda f, rng: cut_redis_as_a_job_starts(f, outage_s=rng.uniform(1, 4))),
)
WEIGHTS = (6, 2, 3, 1, 1, 1, 1, 1)  # services and states are many; the rest one or two each
PRIVATE = ("restart the broker", "restart Redis")


def run_private(faults: Faults, name: str, broker: PrivateBroker, redis: PrivateRedis,
                rng: random.Random) -> Trial:
    if name == "restart the broker":
        return restart_broker(faults, broker, outage_s=rng.uniform(4, 6),
                              delay=rng.uniform(0, 1))
    return restart_redis(faults, redis, rng.choice((S.DISPATCHED, S.RUNNING)),
                         outage_s=rng.uniform(1, 4), delay=rng.uniform(0, 0.3))

