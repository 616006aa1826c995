"""Benchmark: heartbeat intake cost and throughput (one `fedhive-job-runner` process).

Simulates N sites (default 1,000) each publishing a SiteHeartbeat every 5 s, spread evenly, so
200 messages/s reach the intake; after a warm-up, measures the intake process's CPU seconds per
wall second with psutil (`intake_core_fraction_1000_sites`; goal < 0.10). Then measures the
most heartbeats/s one intake stores: the intake is stopped, a burst is queued, a fresh intake
is started and timed while it drains the queue into Redis (`max_heartbeats_per_s`).

Sender identity stays fully checked: creating 1,000 broker users and connections would measure
the broker, not the intake, so the bench publishes over one connection as a user tagged
`impersonator` (RabbitMQ then accepts any `user_id`), stamping each message with its site's
broker user (`<namespace>.<site>`) as `user_id`, exactly what 1,000 real site users would
send. The intake runs unchanged.
Messages (protobuf body and AMQP properties) are pre-generated before timing.

    .venv/bin/python bench/heartbeats.py [--sites 1000] [--interval 5] [--measure 40]

Needs the local RabbitMQ (rabbitmqctl, as root) and Redis; broker and Redis URLs come from
FEDHIVE_AMQP_URL / FEDHIVE_REDIS_URL (`Settings.from_env()`). Prints JSON and writes
bench/results/heartbeats.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.fixtures.sites (loads deploy/broker_users.py)

import pika  # noqa: E402
import pika.exceptions  # noqa: E402
import psutil  # noqa: E402
from support import (  # noqa: E402  (bench/support.py, beside this script)
    bench_settings,
    load_average,
    write_results,
)

from fedhive.bus.publisher import properties  # noqa: E402
from fedhive.config import Settings  # noqa: E402
from fedhive.names import Names  # noqa: E402
from fedhive.proto.v1 import site_pb2  # noqa: E402
from fedhive.state.connect import redis_client  # noqa: E402
from fedhive.structs import dict_to_struct  # noqa: E402
from tests.fixtures.job_store import service_env  # noqa: E402
from tests.fixtures.sites import CTL, load_broker_users, with_user  # noqa: E402

Message = tuple[str, bytes, Any]  # routing key, body, properties


def heartbeats(names: Names, sites: int, rounds: int, start_ms: int, interval_ms: int,
               ) -> list[Message]:
    """`rounds` rounds of one heartbeat per site, in publishing order, signed as each site."""
    out: list[Message] = []
    for r in range(rounds):
        for i in range(sites):
            site = f"site-{i:05d}"
            beat = site_pb2.SiteHeartbeat(
                site=site, org=f"org-{i % 50}", running_job_ids=[f"job-{i % 7}", f"job-{i % 11}"],
                agent_version="0.1.0", sent_at_ms=start_ms + r * interval_ms + i,
            )
            beat.resources.CopyFrom(dict_to_struct(
                {"num_gpus": 4, "mem_per_gpu_in_GiB": 80, "free": {"num_gpus": i % 5}}))
            out.append((Names.site_event(site, "heartbeat"), beat.SerializeToString(),
                        properties(beat, user_id=names.site_user(site))))
    return out


class Bench:
    def __init__(self, settings: Settings, publisher_url: str) -> None:
        self.settings = settings
        self.names = Names(settings.namespace)
        self.queue = self.names.events_queue("heartbeats")
        self._publisher_url = publisher_url
        self.redis = redis_client(settings)
        self.admin = pika.BlockingConnection(pika.URLParameters(settings.amqp_url)).channel()

    def start_intake(self) -> subprocess.Popen[bytes]:
        env = {**service_env(self.settings), "FEDHIVE_LOG_LEVEL": "WARNING"}
        proc = subprocess.Popen(
            [sys.executable, "-c", "from fedhive_services.job_runner.main import main; main()",
             "--site-ttl", "15"], env=env, stdout=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while self.depth() is None or self.consumers() == 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"intake did not start (exit {proc.poll()})")
            time.sleep(0.1)
        return proc

    def _declare(self) -> Any:
        try:
            return self.admin.queue_declare(self.queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker:
            self.admin = self.admin.connection.channel()
            return None

    def depth(self) -> int | None:
        ok = self._declare()
        return None if ok is None else int(ok.method.message_count)

    def consumers(self) -> int:
        ok = self._declare()
        return 0 if ok is None else int(ok.method.consumer_count)

    def stored(self, sites: int, sent_at: list[int]) -> int:
        """How many sites have their expected last heartbeat recorded."""
        scores = self.redis.zrange(self.names.sites_key, 0, -1, withscores=True)
        latest = dict(scores)
        return sum(1 for i in range(sites) if latest.get(f"site-{i:05d}") == sent_at[i])

    def publish(self, messages: list[Message], rate: float | None) -> float:
        """Publish with confirms, paced at `rate`/s (None: as fast as possible); seconds taken."""
        connection = pika.BlockingConnection(pika.URLParameters(self._publisher_url))
        channel = connection.channel()
        channel.confirm_delivery()
        exchange = self.names.events_exchange
        start = time.monotonic()
        for k, (key, body, props) in enumerate(messages):
            if rate is not None and (wait := start + k / rate - time.monotonic()) > 0:
                time.sleep(wait)
            channel.basic_publish(exchange, key, body, props)
        taken = time.monotonic() - start
        connection.close()
        return taken

    def cleanup(self) -> None:
        for queue in (self.queue, Names.dead_letter_queue(self.queue)):
            self.admin.queue_delete(queue)
        for exchange in (self.names.cmd_exchange, self.names.events_exchange,
                         self.names.dead_letter_exchange):
            self.admin.exchange_delete(exchange)
        for pattern in self.names.redis_patterns():
            for key in list(self.redis.scan_iter(match=pattern, count=1000)):
                self.redis.delete(key)
        self.admin.connection.close()
        self.redis.close()


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(30)


def run(args: argparse.Namespace, bench: Bench) -> dict[str, Any]:
    interval_ms = int(args.interval * 1000)
    rate = args.sites / args.interval
    warm_rounds = max(1, round(args.warmup / args.interval))
    rounds = warm_rounds + max(1, round(args.measure / args.interval))
    start_ms = int(time.time() * 1000)
    steady = heartbeats(bench.names, args.sites, rounds, start_ms, interval_ms)
    burst_rounds = max(1, args.burst // args.sites)
    burst = heartbeats(bench.names, args.sites, burst_rounds, start_ms + rounds * interval_ms,
                       interval_ms)

    intake = bench.start_intake()
    process = psutil.Process(intake.pid)
    warm = warm_rounds * args.sites
    bench.publish(steady[:warm], rate)
    cpu0, wall0 = sum(process.cpu_times()[:2]), time.monotonic()
    load_before = load_average()
    bench.publish(steady[warm:], rate)
    cpu1, wall1 = sum(process.cpu_times()[:2]), time.monotonic()
    load_after = load_average()
    last = [start_ms + (rounds - 1) * interval_ms + i for i in range(args.sites)]
    deadline = time.monotonic() + 30
    while (stored := bench.stored(args.sites, last)) < args.sites and time.monotonic() < deadline:
        time.sleep(0.1)
    stop(intake)

    # throughput: queue a burst while no intake runs, then time a fresh one draining it
    bench.publish(burst, None)
    total = len(burst)
    intake = bench.start_intake()
    last_burst = [start_ms + (rounds + burst_rounds - 1) * interval_ms + i
                  for i in range(args.sites)]
    began = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        depth = bench.depth() or 0
        now = time.monotonic()
        if began is None and depth < total:
            began = now
        if depth == 0 and bench.stored(args.sites, last_burst) == args.sites:
            break
        time.sleep(0.02)
    drained = time.monotonic() - (began or time.monotonic())
    stop(intake)

    wall = wall1 - wall0
    return {
        "benchmark": "heartbeat_intake",
        "sites": args.sites,
        "interval_s": args.interval,
        "intake_core_fraction_1000_sites": round((cpu1 - cpu0) / wall, 4),
        "goal_core_fraction": 0.10,
        "measured_wall_s": round(wall, 2),
        "intake_cpu_s": round(cpu1 - cpu0, 3),
        "message_rate_per_s": round((len(steady) - warm) / wall, 1),
        "sites_with_last_heartbeat_stored": stored,
        "max_heartbeats_per_s": round(total / drained, 1) if drained > 0 else None,
        "burst_messages": total,
        "burst_drain_s": round(drained, 3),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "cpu_count": os.cpu_count(),
        "publisher": "one connection, user tagged impersonator, user_id = the site's user "
                     "(checked by the intake as in production), confirms on",
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, default=1000)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between beats")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring")
    parser.add_argument("--measure", type=float, default=40.0, help="seconds measured")
    parser.add_argument("--burst", type=int, default=20000, help="messages in the drain test")
    args = parser.parse_args()
    with bench_settings(f"bench-hb-{secrets.token_hex(3)}") as (settings, _):
        measure(args, settings)


def measure(args: argparse.Namespace, settings: Settings) -> None:
    """The benchmark on `settings`, which name an S3 server: the job-runner that hosts the
    intake needs one, as in any deployment."""
    broker_users = load_broker_users()
    name = f"{settings.namespace}-publisher"
    everything = rf"^({settings.namespace}\.|amq\.)"
    user = broker_users.BrokerUser(name, broker_users.new_password(),
                                   broker_users.Permissions(everything, everything, everything),
                                   tags=("impersonator",))
    vhost = pika.URLParameters(settings.amqp_url).virtual_host
    broker_users.create_users([user], vhost, CTL, namespace=settings.namespace)
    bench = Bench(settings, with_user(settings.amqp_url, name, user.password))
    try:
        result = run(args, bench)
    finally:
        bench.cleanup()
        broker_users.delete_users([name], CTL)
    write_results(result, ROOT / "bench" / "results" / "heartbeats.json")


if __name__ == "__main__":
    main()
