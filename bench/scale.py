"""Benchmark: FedAvg rounds with many sites, on the real services, the sites light.

The job-store, scheduler and job-runner as in bench/rounds.py, a RabbitMQ node of the bench's own
(`tests.fixtures.private_infra.PrivateBroker`: it inherits this process's file-descriptor limit,
where the machine's shared node allows 927 connections, fewer than 300 light sites hold), and
light-site host processes (`fedhive-site-agent host`) of at most HOST_SITES sites each: every
site its own broker user, control queue and heartbeats every 5 s, its client job a thread of its
host (the runner's sync timeout raised to SYNC_TIMEOUT_S: a host's deploys and starts share one
process; one host of 300 sites, ~3,600 threads, missed it on this 2-core machine; its site and
job TTLs raised to TTL_S: a host's heartbeats wait behind its client jobs). One job
per N: ScatterAndGather over a 1 MiB float32 model (inline in the messages; the task's stored once
instead past 64 sites, `fedhive.fl.task_data.FAN_OUT_BUDGET`), `--rounds` rounds,
min_clients = N, a trainer that adds 1. For each N:

* `round_s`: (the last round's report - the first's) / (rounds - 1); the first round also holds
  the client jobs' start-up;
* `sj_cpu_ms_per_result`: the server job's CPU time (user + system) between those two reports,
  divided by the results those rounds took in (N x (rounds - 1)); `sj_system_ms_per_result`
  the kernel's part of it (socket reads and writes, page faults); `host_cpu_ms_per_result` the
  light-site hosts' CPU time over the same rounds per result (a site's whole round: its task
  in, the trainer, its result out);
* `host_rss_mib`: the hosts' peak RSS (summed) while the job ran; `mib_per_site` the slope
  between the smallest and the largest N (what one more light site costs, a host's own ~55 MiB
  included once per HOST_SITES sites).

    .venv/bin/python bench/scale.py [--rounds 5] [--sites 8 32 100 300] [--keep-logs DIR]

Prints JSON and writes bench/results/scale.json (keys `round_s_<n>_sites`,
`sj_cpu_ms_per_result_<n>_sites`, and `round_s_100_sites`, `round_s_300_sites`,
`sj_cpu_ms_per_result` (the largest N's), `mib_per_extra_site`).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import platform
import secrets
import shutil
import sys
import tempfile
import threading
import zipfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.fixtures (the service launchers, SeaweedFS)

from rounds import HEARTBEAT_S, job_archive  # noqa: E402  (beside this script)
from scheduling import start_scheduler, submit, wait_final  # noqa: E402
from support import bench_settings, load_average, write_results  # noqa: E402

from fedhive.blobs import S3BlobStore  # noqa: E402
from fedhive.bus import RabbitBus  # noqa: E402
from fedhive.config import Settings  # noqa: E402
from fedhive.jobs.status import JobStatus  # noqa: E402
from fedhive.logging import configure  # noqa: E402
from fedhive.names import Names  # noqa: E402
from fedhive.state import RedisStateStore  # noqa: E402
from tests.fixtures.gateway import clean_namespace  # noqa: E402
from tests.fixtures.infra import stop_process, wait_for  # noqa: E402
from tests.fixtures.job_runner import RunnerProcess  # noqa: E402
from tests.fixtures.job_store import JobStoreProcess, stage  # noqa: E402
from tests.fixtures.private_infra import PrivateBroker  # noqa: E402
from tests.fixtures.rabbitmqctl import CTL  # noqa: E402
from tests.fixtures.site_agent import SiteUsers, start_host, storage_url, write_site  # noqa: E402

MiB = 1024 * 1024
SAMPLE_S = 0.05
SYNC_TIMEOUT_S = 120
# A host's 100 sites' heartbeat threads, and their client jobs' beats, wait for the GIL behind
# its 100 busy client jobs: at 3 beats (15 s) up to a third of the sites were declared offline
# mid-job (~1 run in 6, 2 cores), and at 300 sites a client job "stopped reporting the job" in
# round 0. Liveness under load is bench/liveness.py's measure; here both TTLs are 60 s.
TTL_S = 12 * HEARTBEAT_S
# Sites per light host: its threads share one GIL, so fewer sites a host cost less CPU per
# result (100 sites, 2 cores, two interleaved pairs: 4.5 -> 3.7 ms per result, rounds 0.57 ->
# 0.52 s at 50; 25 no better than 50) for ~0.5 MiB more per site.
HOST_SITES = 50


class Watch:
    """Samples, every SAMPLE_S, the hosts' RSS and the server job's CPU time at each new round
    its workspace's metrics.json shows (the server job is found by its working directory)."""

    def __init__(self, hosts: list[psutil.Process], runner: RunnerProcess) -> None:
        self._hosts = hosts
        self._runner = runner
        self.peak_rss = 0
        # rounds reported -> the server job's user and system, and the hosts' CPU seconds then
        self.cpu_at_round: dict[int, tuple[float, float, float]] = {}
        self.job_id = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        server_job: psutil.Process | None = None
        seen: tuple[int, int] | None = None  # metrics.json's (mtime, size) last parsed
        while not self._stop.wait(SAMPLE_S):
            self.peak_rss = max(self.peak_rss, rss(self._hosts))
            if not self.job_id:
                continue
            workspace = self._runner.workspace(self.job_id)
            if server_job is None:
                server_job = _process_in(str(workspace))
                continue
            # Parsed only when it changed: at 300 sites, parsing it 20 times a second made this
            # process a tenth of the machine's CPU, taken from the system it measures.
            try:
                user, system = server_job.cpu_times()[:2]
                hosts = sum(sum(host.cpu_times()[:2]) for host in self._hosts)
                stat = (workspace / "metrics.json").stat()
                if (stat.st_mtime_ns, stat.st_size) == seen:
                    continue
                reported = len(json.loads((workspace / "metrics.json").read_text())["rounds"])
                seen = (stat.st_mtime_ns, stat.st_size)
            except (psutil.Error, OSError, ValueError, KeyError):
                continue  # not written yet, being rewritten, or the job is over
            self.cpu_at_round.setdefault(reported, (user, system, hosts))


def rss(processes: list[psutil.Process]) -> int:
    return sum(process.memory_info().rss for process in processes)


def start_hosts(site_dirs: list[Path], root: Path, stack: ExitStack,
                per_host: int = HOST_SITES) -> list[psutil.Process]:
    """Light-site hosts of at most `per_host` of `site_dirs` each (logs `root`/host-<n>.log),
    stopped by `stack`."""
    hosts = []
    for n, start in enumerate(range(0, len(site_dirs), per_host)):
        host = start_host(site_dirs[start:start + per_host], root / f"host-{n}.log")
        stack.callback(stop_process, host)
        hosts.append(psutil.Process(host.pid))
    return hosts


def _process_in(cwd: str) -> psutil.Process | None:
    for proc in psutil.process_iter(["cwd"]):
        if proc.info["cwd"] == cwd:
            return proc
    return None


def run_sites(count: int, rounds: int, keep_logs: Path | None = None) -> dict[str, Any]:
    namespace = f"bench-scale-{secrets.token_hex(3)}"
    sites = [f"s{n}" for n in range(1, count + 1)]
    with bench_settings(namespace) as (settings, s3), tempfile.TemporaryDirectory() as tmp, \
            ExitStack() as stack:
        root = Path(tmp)
        broker = stack.enter_context(PrivateBroker(root / "broker"))
        settings = dataclasses.replace(settings, amqp_url=broker.amqp_url)
        # All N client jobs start in one process on 2 shared cores: their start replies take
        # longer than a site of its own takes (the default sync timeout is 10 s).
        services = start_services(settings, root, stack, "--site-ttl", str(TTL_S),
                                  "--job-ttl", str(TTL_S),
                                  "--sync-timeout", str(SYNC_TIMEOUT_S))
        bus, state, blobs, runner = services.bus, services.state, services.blobs, services.runner
        hosts = start_hosts(write_sites(settings, root, sites, bus.user, stack, broker.ctl),
                            root, stack)
        wait_for(lambda: len(state.online_sites()) == count, timeout=60 + count / 5,
                 what=f"{count} sites online")
        idle_rss = rss(hosts)
        stack.callback(stop_process, start_scheduler(settings, root / "scheduler.log", 1))
        watch = Watch(hosts, runner)
        stack.callback(watch.close)
        watch.job_id = submit(bus, Names(namespace), stage(blobs, Names(namespace),
                                                           job_archive(sites, rounds)))
        (record,) = wait_final(state, [watch.job_id], 120 + count)
        if record.status != JobStatus.FINISHED_COMPLETED and keep_logs is not None:
            copy_logs(root, keep_logs / f"{count}-sites")
        assert record.status == JobStatus.FINISHED_COMPLETED, record.status_reason
        with zipfile.ZipFile(io.BytesIO(blobs.get(record.result_key))) as result:
            reports = json.loads(result.read("metrics.json"))["rounds"]
        times = [r["time"] for r in reports]
        cpu = watch.cpu_at_round
        measured = {"round_s": round((times[-1] - times[0]) / (rounds - 1), 3),
                    "host_rss_mib": round(watch.peak_rss / MiB, 1),
                    "host_idle_rss_mib": round(idle_rss / MiB, 1), "s3": s3}
        if 1 in cpu and rounds in cpu:
            results = count * (rounds - 1)
            (user, system, hosts), (user_1, system_1, hosts_1) = cpu[rounds], cpu[1]
            measured["sj_cpu_ms_per_result"] = round(
                (user + system - user_1 - system_1) * 1000 / results, 3)
            measured["sj_system_ms_per_result"] = round((system - system_1) * 1000 / results, 3)
            measured["host_cpu_ms_per_result"] = round((hosts - hosts_1) * 1000 / results, 3)
        return measured


@dataclass
class Services:
    bus: RabbitBus  # a client of the services, as their own broker user
    state: RedisStateStore
    blobs: S3BlobStore
    runner: RunnerProcess


def start_services(settings: Settings, root: Path, stack: ExitStack,
                   *runner_args: str) -> Services:
    """The job-store and the job-runner (`runner_args` added to its options), with a bus, the
    state store and the blob store; `stack` stops and closes them and cleans the namespace."""
    stack.callback(clean_namespace, settings)
    bus = RabbitBus(settings, name="bench-scale")
    stack.callback(bus.close)
    state = RedisStateStore.from_settings(settings)
    stack.callback(state.close)
    blobs = S3BlobStore.from_settings(settings)
    stack.callback(blobs.close)
    job_store = JobStoreProcess(settings, root / "job-store.log")
    stack.callback(job_store.stop)
    job_store.start()
    job_store.wait_ready(bus)
    runner = RunnerProcess(settings, root, *runner_args).start()
    stack.callback(runner.stop)
    return Services(bus, state, blobs, runner)


def write_sites(settings: Settings, root: Path, sites: list[str], services_user: str,
                stack: ExitStack, ctl: tuple[str, ...] = CTL) -> list[Path]:
    """The sites' folders, each with a broker user of its own (made in one `ctl` call)."""
    users = SiteUsers(settings, ctl)
    stack.callback(users.close)
    urls = users.url(*sites)
    where = storage_url(settings)
    return [write_site(root / site, site=site, broker_url=urls[site],
                       namespace=settings.namespace, storage_url=where,
                       services_user=services_user, heartbeat_interval_s=HEARTBEAT_S)
            for site in sites]


def copy_logs(root: Path, dest: Path) -> None:
    """The run's log files (services, hosts, each site's client job), paths kept."""
    for log in root.rglob("*.log"):
        target = dest / log.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, target)
    print(f"logs of the failed run: {dest}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sites", type=int, nargs="+", default=[8, 32, 100, 300])
    parser.add_argument("--output", type=Path, default=ROOT / "bench/results/scale.json")
    parser.add_argument("--keep-logs", type=Path, metavar="DIR",
                        help="copy the logs of a run whose job fails to DIR/<N>-sites")
    args = parser.parse_args()
    configure("bench-scale", level="WARNING")  # logs to stderr: stdout is the JSON result
    load_before = load_average()
    results: dict[str, Any] = {}
    for count in args.sites:
        measured = run_sites(count, args.rounds, args.keep_logs)
        results[f"round_s_{count}_sites"] = measured["round_s"]
        if "sj_cpu_ms_per_result" in measured:
            results[f"sj_cpu_ms_per_result_{count}_sites"] = measured["sj_cpu_ms_per_result"]
        results[f"details_{count}_sites"] = measured
    low, high = min(args.sites), max(args.sites)
    if high > low:
        rss = {n: results[f"details_{n}_sites"]["host_rss_mib"] for n in (low, high)}
        results["mib_per_extra_site"] = round((rss[high] - rss[low]) / (high - low), 2)
    if f"sj_cpu_ms_per_result_{high}_sites" in results:
        results["sj_cpu_ms_per_result"] = results[f"sj_cpu_ms_per_result_{high}_sites"]
    results.update(goals={"round_s_100_sites": 0.5, "round_s_300_sites": 1.5,
                          "sj_cpu_ms_per_result": 1.0, "mib_per_extra_site": 20},
                   rounds=args.rounds, model_mib=1, python=platform.python_version(),
                   cpus=os.cpu_count(), loadavg_1_5_15_at_start=load_before,
                   loadavg_1_5_15_at_end=load_average(),
                   command=" ".join(["bench/scale.py", *sys.argv[1:]]))
    write_results(results, args.output)


if __name__ == "__main__":
    main()
