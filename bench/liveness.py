"""Benchmark: 1,000 light sites heartbeating every 5 s while 100 of them run a job; heartbeat
lag, and how soon 10 killed sites are found dead.

The services as in bench/scale.py (its private RabbitMQ node: 1,000 sites hold ~3,000
connections), the sites in light-site hosts of at most `scale.HOST_SITES` each
(`scale.start_hosts`), the job's sites spread evenly over them (`spread`), every site its own
broker user and heartbeats every HEARTBEAT_S; a last host holds the VICTIMS sites that are
killed. The runner declares a site offline `--site-ttl` after its last heartbeat, looked for
every SWEEP_S.
Default here 9 s (1.8 intervals; the runner's own default is 15 s, 3 intervals): detection
within 2 intervals of a kill needs a TTL under 2 intervals, so a beat may be up to 4 s late, but
a lost one makes its site offline until the next.

1. All sites online; a FedAvg job (1 MiB model, bench/rounds.py's) starts on s1..s100.
2. For `--measure` seconds while it runs, the sites' last heartbeats are read from Redis every
   POLL_S; each new one gives `lag` = when it was seen - its `sent_at_ms` (so a lag is at most
   POLL_S too high, never too low). `heartbeat_lag_s_p50/p99/max`.
3. The victims' host is SIGKILLed; `dead_site_detection_s_max`: the longest time from the kill
   to a victim leaving the online set (`since_last_beat` beside it: from its last heartbeat,
   read 1 s after the kill, when the beats then in flight have been recorded).
   Goal: within 2 heartbeat intervals of the kill.
4. The job is aborted; every other site must still be online (no false positives).

    .venv/bin/python bench/liveness.py [--sites 1000] [--job-sites 100] [--measure 30]
        [--site-ttl 9]

Prints JSON and writes bench/results/liveness.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import secrets
import signal
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.fixtures (the service launchers, SeaweedFS)

import redis  # noqa: E402
from rounds import HEARTBEAT_S, job_archive  # noqa: E402  (beside this script)
from scale import HOST_SITES, rss, start_hosts, start_services, write_sites  # noqa: E402
from scheduling import start_scheduler, submit, wait_final  # noqa: E402
from support import bench_settings, load_average, write_results  # noqa: E402

from fedhive.jobs.status import JobStatus  # noqa: E402
from fedhive.logging import configure  # noqa: E402
from fedhive.names import Names  # noqa: E402
from fedhive.proto.v1 import admin_pb2, job_pb2  # noqa: E402
from tests.fixtures.infra import stop_process, wait_for  # noqa: E402
from tests.fixtures.job_store import stage  # noqa: E402
from tests.fixtures.private_infra import PrivateBroker  # noqa: E402
from tests.fixtures.site_agent import start_host  # noqa: E402

VICTIMS = 10
SWEEP_S = 0.5
POLL_S = 0.05
MiB = 1024 * 1024


def percentile(values: list[float], q: float) -> float:
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 3)


def run(count: int, job_sites: int, measure_s: float, site_ttl_s: float) -> dict[str, Any]:
    namespace = f"bench-live-{secrets.token_hex(3)}"
    sites = [f"s{n}" for n in range(1, count + 1)]
    victims = sites[-VICTIMS:]
    with bench_settings(namespace) as (settings, _s3), tempfile.TemporaryDirectory() as tmp, \
            ExitStack() as stack:
        root = Path(tmp)
        broker = stack.enter_context(PrivateBroker(root / "broker"))
        settings = dataclasses.replace(settings, amqp_url=broker.amqp_url)
        services = start_services(settings, root, stack, "--site-ttl", str(site_ttl_s),
                                  "--sweep-interval", str(SWEEP_S), "--sync-timeout", "120")
        bus, state, names = services.bus, services.state, Names(namespace)
        site_dirs = write_sites(settings, root, sites, bus.user, stack, broker.ctl)
        started = time.monotonic()
        hosts = start_hosts(spread(site_dirs[:-VICTIMS], job_sites), root, stack)
        victim_host = start_host(site_dirs[-VICTIMS:], root / "host-victims.log")
        stack.callback(stop_process, victim_host)
        wait_for(lambda: len(state.online_sites()) == count, timeout=120 + count / 5,
                 what=f"{count} sites online")
        all_online_s = time.monotonic() - started

        stack.callback(stop_process, start_scheduler(settings, root / "scheduler.log", 1))
        job_id = submit(bus, names, stage(services.blobs, names,
                                          job_archive(sites[:job_sites], 100_000)))
        wait_for(lambda: state.get_job(job_id).status == JobStatus.RUNNING, timeout=300,
                 what="the job to run")

        lags = heartbeat_lags(settings.redis_url, names, measure_s)
        in_job = set(sites[:job_sites])
        all_lags = [lag for _, lag in lags]
        record = state.get_job(job_id)
        assert record.status == JobStatus.RUNNING, \
            f"the job ended early: {record.status.value} ({record.status_reason})"

        os.killpg(victim_host.pid, signal.SIGKILL)
        killed = time.time()
        found: dict[str, float] = {}
        last_beat: dict[str, float] = {}
        while len(found) < VICTIMS and time.time() - killed < 60:
            if not last_beat and time.time() - killed > 1:  # the beats in flight have landed
                last_beat = {beat.site: beat.sent_at_ms / 1000 for beat in state.live_sites()
                             if beat.site in victims}
            online = set(state.online_sites())
            for site in victims:
                if site not in online:
                    found.setdefault(site, time.time())
            time.sleep(0.05)
        assert len(found) == VICTIMS, f"victims still online: {set(victims) - set(found)}"
        survivors = set(sites) - set(victims) - set(state.online_sites())
        record = state.get_job(job_id)
        assert record.status == JobStatus.RUNNING, \
            f"the job ended after the kill: {record.status.value} ({record.status_reason})"

        bus.call(names.service_queue("job-store"),
                 admin_pb2.AbortJobRequest(job_id=job_id, reason="bench over"),
                 job_pb2.JobRecord, timeout=30)
        (record,) = wait_final(state, [job_id], 120)
        return {
            "sites": count, "job_sites": job_sites, "hosts": len(hosts) + 1,
            "heartbeat_interval_s": HEARTBEAT_S, "site_ttl_s": site_ttl_s, "sweep_s": SWEEP_S,
            "all_online_s": round(all_online_s, 1),
            "heartbeats_seen": len(lags),
            "heartbeat_lag_s_p50": percentile(all_lags, 50),
            "heartbeat_lag_s_p99": percentile(all_lags, 99),
            "heartbeat_lag_s_max": round(max(all_lags), 3),
            "heartbeats_lagging_over_1s": sum(lag > 1 for lag in all_lags),
            "heartbeat_lag_s_max_sites_in_the_job": round(
                max(lag for site, lag in lags if site in in_job), 3),
            "heartbeat_lag_s_max_other_sites": round(
                max(lag for site, lag in lags if site not in in_job), 3),
            "dead_site_detection_s_max": round(max(found.values()) - killed, 2),
            "dead_site_detection_s_min": round(min(found.values()) - killed, 2),
            "detection_since_last_beat_s_max": round(
                max(found[s] - last_beat[s] for s in victims if s in last_beat), 2),
            "false_offline_sites": len(survivors),
            "job_final_status": str(record.status),
            "hosts_rss_mib": round(rss(hosts) / MiB, 1),
        }


def spread(site_dirs: list[Path], job_sites: int) -> list[Path]:
    """`site_dirs` reordered so that `start_hosts`' hosts (consecutive chunks) each hold an equal
    share of the first `job_sites` (the job's), as the job's sites would be spread over
    machines. In order, one host would hold all of them: 100 client-job threads computing in
    one process hold its heartbeat threads off the GIL for seconds, a light-host artefact (a
    real site's client job is a process of its own) that made sites miss their TTL."""
    hosts = -(-len(site_dirs) // HOST_SITES)
    share = -(-job_sites // hosts)
    job, rest = site_dirs[:job_sites], site_dirs[job_sites:]
    chunks = [job[h * share:(h + 1) * share] for h in range(hosts)]
    out: list[Path] = []
    for chunk in chunks:
        take = HOST_SITES - len(chunk)
        out += chunk + rest[:take]
        rest = rest[take:]
    return out + rest


def heartbeat_lags(redis_url: str, names: Names, seconds: float) -> list[tuple[str, float]]:
    """(site, lag = seen - sent) of the heartbeats that arrive within `seconds`, read every
    POLL_S from the sites' zset (site -> the last recorded `sent_at_ms`, written by the same
    script as the live record): one small read, where every site's record parsed 5 times a
    second took this process ~5 % of a core and gave the lags a 0.2 s resolution."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)

    def recorded() -> dict[str, float]:
        return dict(client.zrange(names.sites_key, 0, -1, withscores=True))

    seen = recorded()
    lags: list[tuple[str, float]] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(POLL_S)
        now_ms = time.time() * 1000
        for site, sent_at_ms in recorded().items():
            if sent_at_ms > seen.get(site, 0):
                seen[site] = sent_at_ms
                lags.append((site, (now_ms - sent_at_ms) / 1000))
    client.close()
    return lags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=1000)
    parser.add_argument("--job-sites", type=int, default=100)
    parser.add_argument("--measure", type=float, default=30.0)
    parser.add_argument("--site-ttl", type=float, default=9.0)
    parser.add_argument("--output", type=Path, default=ROOT / "bench/results/liveness.json")
    args = parser.parse_args()
    configure("bench-liveness", level="WARNING")  # logs to stderr: stdout is the JSON result
    load_before = load_average()
    results = run(args.sites, args.job_sites, args.measure, args.site_ttl)
    results.update(goals={"heartbeat_lag_s_max": 1.0,
                          "dead_site_detection_s_max": 2 * HEARTBEAT_S},
                   python=platform.python_version(), cpus=os.cpu_count(),
                   loadavg_1_5_15_at_start=load_before, loadavg_1_5_15_at_end=load_average(),
                   command=" ".join(["bench/liveness.py", *sys.argv[1:]]))
    write_results(results, args.output)


if __name__ == "__main__":
    main()
