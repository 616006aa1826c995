"""Benchmark: the fault suite's scenarios as trials, counting every broken invariant.

Runs the fault system of tests/faults (`tests.faults.harness.fault_system`: the job-store, a
scheduler, the job-runner and two site agents on their own broker users, all real processes) on
the configured RabbitMQ and Redis under a namespace of its own, and a second one on a private
RabbitMQ node and Redis started here (for the broker restart and the Redis crash; never the
shared ones). Each trial is one scenario of tests/faults/scenarios.py, then `Faults.verify`
checks the invariants of tests/faults/invariants.py over its jobs. First every scenario of the
test matrix once (each service killed at each job state; server job, client job and trainer
kills; two runners; a frozen site; the broker and Redis restarts), then random draws (scenario,
state, moment) up to `--trials`; with `--soak` every trial is a random draw (default 200).
Last, the probes of issue #16 point 1: each site's own credentials against the other site and
the services, and a broker user that is not the services' against the running services.

    .venv/bin/python bench/faults.py [--trials 40] [--seed N] [--soak] [--output PATH]

RabbitMQ (as a user that may run rabbitmqctl) and Redis from the environment; S3 too when
FEDHIVE_S3_ENDPOINT_URL is set, otherwise a SeaweedFS started here. Prints JSON and writes
bench/results/faults.json (`--soak`: faults_soak.json): `trials`, `jobs`, the jobs with each
kind of violation (`jobs_lost`, `jobs_run_twice`, `jobs_stuck`, `jobs_final_status`),
`leaked_processes` and `leaked_allocations` (violations), `unexpected_outcomes` (jobs that
ended otherwise than their scenario says, or a scenario's own check failing),
`setup_failures` (trials whose state was never reached), `site_probes_tried`,
`site_probes_allowed`, the outcomes per scenario and every violation. Goal: every loss, leak
and allowed count 0, with at least 40 trials and 30 probes.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import secrets
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.faults (the scenarios and the invariant checker)

from support import bench_settings, load_average, write_results  # noqa: E402  (bench/support.py, beside this script)

from fedhive import brokerusers  # noqa: E402
from fedhive.jobs.status import JobStatus  # noqa: E402
from fedhive.logging import configure  # noqa: E402
from tests.faults import scenarios as sc  # noqa: E402
from tests.faults.harness import SERVICES, Faults, Outcome, Trial, fault_system  # noqa: E402
from tests.faults.probes import rogue_probes, site_probes  # noqa: E402
from tests.fixtures.private_infra import PrivateBroker, PrivateRedis  # noqa: E402
from tests.fixtures.rabbitmqctl import CTL  # noqa: E402

S = JobStatus
JOB_KINDS = {"lost": "jobs_lost", "run_twice": "jobs_run_twice", "stuck": "jobs_stuck",
             "final_status": "jobs_final_status"}
COUNTED = {"process_left": "leaked_processes", "allocation_left": "leaked_allocations"}
KEPT = 200  # violations and failures listed in the result (all are counted)


@dataclass
class Systems:
    shared: Faults
    private: Faults
    broker: PrivateBroker
    redis: PrivateRedis


@dataclass(frozen=True)
class Draw:
    name: str
    private: bool
    run: Callable[[Systems, random.Random], Trial]


def on_shared(scenario: Callable[..., Trial], *args: Any,
              **options: Any) -> Callable[[Systems, random.Random], Trial]:
    def run(systems: Systems, rng: random.Random) -> Trial:
        return scenario(systems.shared, *args, **options)
    return run


def matrix() -> list[Draw]:
    """The scenarios of tests/faults, each once."""
    draws = [Draw(f"kill {service} at {state.value}", False,
                  on_shared(sc.kill_service, service, state))
             for service in SERVICES for state in sc.STATES]
    for state in (S.DISPATCHED, S.RUNNING):
        draws.append(Draw(f"kill the server job at {state.value}", False,
                          on_shared(sc.kill_server_job, state)))
        draws += [Draw(f"kill a client job at {state.value}", False,
                       on_shared(sc.kill_client_job, state, after_heartbeat=after))
                  for after in (False, True)]

    def broker(systems: Systems, rng: random.Random) -> Trial:
        return sc.restart_broker(systems.private, systems.broker)

    def redis(systems: Systems, rng: random.Random) -> Trial:
        return sc.restart_redis(systems.private, systems.redis, delay=0.5)

    return [*draws,
            Draw("kill a trainer", False, on_shared(sc.kill_trainer)),
            Draw("a second runner with the same id", False, on_shared(sc.second_runner_same_id)),
            Draw("two runners", False, on_shared(sc.two_runners)),
            Draw("freeze a site", False, on_shared(sc.freeze_site)),
            Draw("cut the runner from Redis as a job turns RUNNING", False,
                 on_shared(sc.cut_redis_as_a_job_starts)),
            Draw("restart the broker", True, broker),
            Draw("restart Redis", True, redis)]


def random_draws() -> tuple[list[Draw], list[int]]:
    """Every scenario with a random state and moment, weighted (tests/faults/scenarios.py)."""

    def shared(scenario: sc.Scenario) -> Callable[[Systems, random.Random], Trial]:
        return lambda systems, rng: scenario.run(systems.shared, rng)

    def private(name: str) -> Callable[[Systems, random.Random], Trial]:
        return lambda systems, rng: sc.run_private(systems.private, name, systems.broker,
                                                   systems.redis, rng)

    draws = [Draw(scenario.name, False, shared(scenario)) for scenario in sc.SCENARIOS]
    draws += [Draw(name, True, private(name)) for name in sc.PRIVATE]
    return draws, [*sc.WEIGHTS, *(1 for _ in sc.PRIVATE)]


@dataclass
class Tally:
    trials: int = 0
    jobs: int = 0
    job_kinds: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    counted: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    outcomes: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    seconds: list[float] = field(default_factory=list)

    def add(self, name: str, outcome: Outcome, seconds: float) -> None:
        self.jobs += len(outcome.statuses)
        self.seconds.append(seconds)
        for status in outcome.statuses.values():
            self.outcomes[name][status.value if status else "record gone"] += 1
        for violation in outcome.violations:
            if violation.kind in JOB_KINDS:
                self.job_kinds[violation.kind].add(violation.job_id)
            else:
                self.counted[violation.kind] += 1
            self.violations.append(f"{outcome.trial.scenario}: {violation}")
        self.unexpected += [f"{outcome.trial.scenario}: {u}" for u in outcome.unexpected]

    def failed(self, name: str, faults: Faults, error: BaseException) -> None:
        trial = faults.current
        jobs = ""
        if trial is not None:
            jobs = "; ".join(f"{job} {faults.status(job).value}" for job in trial.expect)
        self.failures.append(f"{name}: {type(error).__name__}: {str(error)[:400]} [{jobs}]")

    def results(self) -> dict[str, Any]:
        found: dict[str, Any] = {"trials": self.trials, "jobs": self.jobs}
        found.update({key: len(self.job_kinds[kind]) for kind, key in JOB_KINDS.items()})
        found.update({key: self.counted[kind] for kind, key in COUNTED.items()})
        found.update(unexpected_outcomes=len(self.unexpected),
                     setup_failures=len(self.failures),
                     trial_s_median=round(sorted(self.seconds)[len(self.seconds) // 2], 1)
                     if self.seconds else None,
                     outcomes={name: dict(counts) for name, counts in self.outcomes.items()},
                     violations=self.violations[:KEPT], unexpected=self.unexpected[:KEPT],
                     failures=self.failures[:KEPT])
        return found


def run_trial(systems: Systems, draw: Draw, rng: random.Random, tally: Tally,
              number: str) -> None:
    faults = systems.private if draw.private else systems.shared
    faults.restore()
    started = time.monotonic()
    tally.trials += 1
    try:
        trial = draw.run(systems, rng)
        outcome = faults.verify(trial)
    except Exception as error:  # the state was never reached (or the system broke): counted
        tally.failed(draw.name, faults, error)
        print(f"[{number}] {draw.name}: FAILED {type(error).__name__}: {error}",
              file=sys.stderr)
        return
    tally.add(draw.name, outcome, time.monotonic() - started)
    print(f"[{number}] {'ok' if outcome.ok else 'NOT OK'} {outcome.describe()}",
          file=sys.stderr)


def probes(faults: Faults, rogue_url: str, tally: Tally) -> dict[str, Any]:
    faults.restore()
    results = site_probes(faults)
    trial = faults.begin("rogue broker user")
    job_id = trial.job(faults.submit(sc.HOLD), S.FINISHED_COMPLETED)
    faults.wait_status(job_id, S.RUNNING)
    results += rogue_probes(faults, rogue_url, job_id)
    faults.go(job_id)
    tally.add("probes' job", faults.verify(trial), 0.0)
    allowed = [f"{r.name}: {r.outcome}" for r in results if r.allowed]
    return {"site_probes_tried": len(results), "site_probes_allowed": len(allowed),
            "probes_allowed": allowed}


@contextmanager
def rogue_user(amqp_url: str, namespace: str) -> Iterator[str]:
    """A broker user allowed everything on the namespace who is not the services' user."""
    name = f"{namespace}-rogue"
    everything = rf"^({re.escape(namespace)}|amq\.)"
    user = brokerusers.BrokerUser(name, brokerusers.new_password(), brokerusers.Permissions(
        everything, everything, everything))
    brokerusers.create_users([user], brokerusers.vhost_of(amqp_url), CTL,
                             namespace=None)
    try:
        yield brokerusers.with_user(amqp_url, name, user.password)
    finally:
        brokerusers.delete_users([name], CTL)


def run(trials: int, seed: int, soak: bool) -> dict[str, Any]:
    rng = random.Random(seed)
    run_id = secrets.token_hex(3)
    namespace = f"bench-faults-{run_id}"
    load_before = load_average()
    started = time.monotonic()
    tally = Tally()
    results: dict[str, Any] = {}
    planned = [] if soak else matrix()
    draws, weights = random_draws()
    planned += rng.choices(draws, weights, k=max(0, trials - len(planned)))
    with ExitStack() as stack:
        settings, s3 = stack.enter_context(bench_settings(namespace))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedhive-faults-")))
        shared = stack.enter_context(fault_system(settings, tmp / "shared",
                                                  [f"bf{run_id}-a", f"bf{run_id}-b"]))
        broker = stack.enter_context(PrivateBroker(tmp / "rabbitmq"))
        redis = stack.enter_context(PrivateRedis(tmp / "redis"))
        private = stack.enter_context(fault_system(
            replace(settings, amqp_url=broker.amqp_url, redis_url=redis.url,
                    namespace=f"{namespace}-p"),
            tmp / "private", [f"bp{run_id}-a", f"bp{run_id}-b"], ctl=broker.ctl,
            clean_broker=False))
        rogue = stack.enter_context(rogue_user(settings.amqp_url, namespace))
        systems = Systems(shared, private, broker, redis)
        try:
            for number, draw in enumerate(planned, 1):
                run_trial(systems, draw, rng, tally, f"{number}/{len(planned)}")
            results.update(probes(shared, rogue, tally))
        except Exception as error:  # a system that could not be made whole again: reported
            results["aborted"] = f"{type(error).__name__}: {error}"[:2000]
    results = {**tally.results(), **results}
    results.update(
        goals={"jobs_lost": 0, "jobs_run_twice": 0, "jobs_stuck": 0, "leaked_processes": 0,
               "leaked_allocations": 0, "site_probes_allowed": 0, "trials": ">= 40",
               "site_probes_tried": ">= 30"},
        seed=seed, soak=soak, wall_s=round(time.monotonic() - started, 1), s3=s3,
        python=platform.python_version(), cpus=os.cpu_count(),
        loadavg_1_5_15_at_start=load_before, loadavg_1_5_15_at_end=load_average(),
        command=" ".join(["bench/faults.py", *sys.argv[1:]]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, help="trials in all (default 40; 200 with "
                        "--soak)")
    parser.add_argument("--seed", type=int, help="of the random draws (default: a new one, "
                        "recorded in the result)")
    parser.add_argument("--soak", action="store_true",
                        help="every trial a random draw (a longer randomised run)")
    parser.add_argument("--output", type=Path, help="default bench/results/faults.json "
                        "(faults_soak.json with --soak)")
    args = parser.parse_args()
    configure("bench-faults", level="WARNING")  # logs to stderr: stdout is the JSON result
    trials = args.trials if args.trials is not None else 200 if args.soak else 40
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    output = args.output or ROOT / "bench" / "results" / (
        "faults_soak.json" if args.soak else "faults.json")
    results = run(trials, seed, args.soak)
    write_results(results, output)
    if "aborted" in results:
        sys.exit(f"bench/faults.py: aborted: {results['aborted']}")


if __name__ == "__main__":
    main()
