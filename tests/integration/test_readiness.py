"""Readiness against real servers: a job-store process whose Redis is killed and started again
(read through the compose probe, `deploy/compose/healthcheck.py ready`), a site agent process
whose heartbeats the broker refuses for a while, a consumer whose consumer the broker cancelled
or whose connection was cut, a hung Redis, and the gateway's gRPC health following its
readiness. Faults hit only what the test owns: a private Redis
(`tests/fixtures/private_infra.py`), a TCP proxy in front of the shared broker, or the test
site's own broker permissions."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import structlog

from fedhive.blobs import S3BlobStore
from fedhive.bus import RabbitBus
from fedhive.config import Settings
from fedhive.names import Names
from fedhive.poc.probes import gateway_serving
from fedhive.proto.v1 import site_pb2
from fedhive.readiness import Readiness, ReadyConfig, Report, read_report
from fedhive.readiness_checks import NotReady, broker_link, consuming, redis_answers
from fedhive.service import FollowsReadiness
from fedhive_services.gateway.server import GatewayOptions, build
from fedhive_services.job_runner import heartbeats
from fedhive_services.job_runner import logs as runner_logs
from tests.fixtures.bus import Broker
from tests.fixtures.gateway import write_admins
from tests.fixtures.infra import stop_process, wait_for
from tests.fixtures.job_runner import RunnerProcess
from tests.fixtures.job_store import service_env
from tests.fixtures.private_infra import PrivateRedis
from tests.fixtures.site_agent import SiteAgents
from tests.fixtures.tcp_proxy import TcpProxy
from tests.unit.deploy_scripts import SCRIPTS, healthcheck

INTERVAL = "1.0"  # seconds between rounds in the tests' processes (5 by default)
log = structlog.get_logger()


def probe(ready_file: Path) -> tuple[int, str]:
    """The compose health check, run as Docker runs it: a process of its own."""
    env = {"PATH": os.environ["PATH"], "FEDHIVE_READY_FILE": str(ready_file)}
    done = subprocess.run([sys.executable, str(SCRIPTS / "healthcheck.py"), "ready", "job-store"],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    return done.returncode, (done.stdout + done.stderr).strip()


def says(ready_file: Path, healthy: bool) -> Callable[[], bool]:
    return lambda: healthcheck.check(["ready", "--file", str(ready_file)])[0] == healthy


@pytest.fixture
def bucket(settings: Settings) -> Iterator[str]:
    store = S3BlobStore.from_settings(settings)
    store.ensure_bucket()
    yield settings.s3_bucket
    store.delete_prefix(f"{settings.namespace}/")
    store.close()


@pytest.fixture
def broker_proxy(amqp_url: str) -> Iterator[TcpProxy]:
    parts = urlsplit(amqp_url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5672)
    yield proxy
    proxy.close()


def test_a_job_store_is_not_ready_while_its_redis_is_down_and_ready_again_after(
        settings: Settings, bucket: str, broker: Broker, tmp_path: Path) -> None:
    ready_file = tmp_path / "job-store.ready"
    with PrivateRedis(tmp_path / "redis") as redis:
        env = {**service_env(replace(settings, redis_url=redis.url)),
               "FEDHIVE_READY_FILE": str(ready_file), "FEDHIVE_READY_INTERVAL": INTERVAL}
        with (tmp_path / "job-store.log").open("ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "fedhive_services.job_store.main"],
                                    env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            wait_for(says(ready_file, True), timeout=60, interval=0.2, what="the job-store ready")
            assert probe(ready_file) == (0, "healthy: job-store ready: broker, redis, s3")

            redis.kill()
            wait_for(says(ready_file, False), timeout=30, interval=0.2, what="not ready")
            code, line = probe(ready_file)
            assert code == 1 and line.startswith("unhealthy: job-store not ready: ")
            assert f"redis: redis at 127.0.0.1:{redis.port}: " in line
            report = read_report(ready_file)
            assert not report.checks["redis"].ok and report.checks["broker"].ok

            redis.start()
            wait_for(says(ready_file, True), timeout=30, interval=0.2, what="ready again")
            assert probe(ready_file)[0] == 0
        finally:
            stop_process(proc)
    assert proc.returncode == 0
    assert probe(ready_file) == (1, f"unhealthy: no readiness file {ready_file} (the service "
                                    "has not started, or has stopped)")


def test_a_job_runner_is_ready_once_all_three_of_its_consumers_consume(
        settings: Settings, bucket: str, broker: Broker, tmp_path: Path) -> None:
    """Its service queue, the heartbeat intake's and the log intake's queues: each is a
    consumer it needs, so each is part of its readiness."""
    ready_file = tmp_path / "job-runner.ready"
    runner = RunnerProcess(replace(settings, ready_file=str(ready_file),
                                   ready_interval_s=float(INTERVAL)), tmp_path).start()
    try:
        wait_for(says(ready_file, True), timeout=60, interval=0.2, what="the job-runner ready")
        names = Names(settings.namespace)
        queues = [names.service_queue("job-runner"), names.events_queue(heartbeats.CONSUMER),
                  names.events_queue(runner_logs.CONSUMER)]
        assert read_report(ready_file).checks["broker"].detail == (
            "consuming from " + ", ".join(queues))
    finally:
        runner.stop()


def test_a_site_agent_is_ready_while_its_heartbeats_reach_the_broker(
        site_agents: SiteAgents, settings: Settings, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    ready_file = tmp_path / "site-agent.ready"
    monkeypatch.setenv("FEDHIVE_READY_FILE", str(ready_file))  # the agent inherits it
    monkeypatch.setenv("FEDHIVE_READY_INTERVAL", INTERVAL)
    site_agents.start("site-1", heartbeat_interval_s=1)
    wait_for(says(ready_file, True), timeout=30, interval=0.2, what="the site agent ready")
    assert list(read_report(ready_file).checks) == ["broker", "heartbeats"]

    site_agents.refuse_events("site-1", "heartbeat", True)
    # Its channel had the key granted a second ago: the broker's cached grant would outlive the
    # narrowing for as long as the channel stays busy (a CI run saw 30 s of ready). A new
    # connection is checked anew.
    # Closing them also makes it not ready for a moment (its consumer reconnecting): what must
    # come is the report of heartbeats missed while its control queue is consumed again.
    site_agents.close_connections("site-1")
    wait_for(says(ready_file, False), timeout=30, interval=0.2, what="not ready")
    reports: list[Report] = []

    def heartbeats_missed() -> bool:
        reports.append(read_report(ready_file))
        return not reports[-1].checks["heartbeats"].ok and reports[-1].checks["broker"].ok

    wait_for(heartbeats_missed, timeout=30, interval=0.2,
             what="heartbeats missed, its control queue consumed again")
    assert not reports[-1].ready
    assert reports[-1].failing().startswith("heartbeats: no heartbeat published for ")

    site_agents.refuse_events("site-1", "heartbeat", False)
    wait_for(says(ready_file, True), timeout=30, interval=0.2, what="heartbeats again")


def test_a_consumer_the_broker_cancelled_consumes_again(
        make_bus: Callable[..., RabbitBus], namespace: str, tmp_path: Path) -> None:
    """Deleting its queue makes the broker cancel the consumer (the channel stays open): it
    reconnects, re-declares the queue and takes deliveries again, and readiness follows."""
    bus = make_bus(name="readiness")
    queue = Names(namespace).site_queue("ready")
    taken: list[object] = []
    consumer = bus.serve(queue, lambda message, delivery: taken.append(message),
                         [site_pb2.AbortRequest])
    readiness = Readiness("site-agent", [consuming(consumer)], ReadyConfig(tmp_path / "r", 1.0),
                          log)
    try:
        assert readiness.evaluate().checks["broker"].detail == f"consuming from {queue}"
        first = consumer.consuming_since
        assert first is not None
        bus.delete_queue(queue)
        wait_for(lambda: consumer.consuming and (consumer.consuming_since or 0) > first,
                 timeout=30, what="the consumer consuming again")
        bus.send(queue, site_pb2.AbortRequest(job_id="j"))
        wait_for(lambda: bool(taken), timeout=10, what="a delivery after the re-declare")
        assert readiness.evaluate().ready
    finally:
        readiness.close()


def test_a_link_cut_from_the_broker_is_not_ready_until_it_is_back(
        bus_settings: Settings, broker: Broker, broker_proxy: TcpProxy) -> None:
    settings = replace(bus_settings, amqp_url=broker_proxy.for_url(bus_settings.amqp_url))
    bus = RabbitBus(settings, name="cut")
    link = broker_link(settings, f"{settings.namespace}.readiness")
    try:
        consumer = bus.serve(Names(settings.namespace).site_queue("cut"),
                             lambda message, delivery: None, [site_pb2.AbortRequest])
        served = consuming(consumer)
        assert served.probe() and link.probe().startswith("connected to RabbitMQ at ")
        broker_proxy.cut()
        wait_for(lambda: not consumer.consuming, timeout=10, what="the consumer cut off")
        with pytest.raises(NotReady, match=r"^not consuming from "):
            served.probe()
        with pytest.raises(NotReady, match=rf"^RabbitMQ at 127\.0\.0\.1:{broker_proxy.port}: "):
            link.probe()
        broker_proxy.heal()
        wait_for(lambda: consumer.consuming, timeout=30, what="the consumer consuming again")
        assert served.probe() and link.probe()
    finally:
        link.close()
        bus.close()


def test_a_hung_redis_fails_its_check_within_the_bound(settings: Settings,
                                                       tmp_path: Path) -> None:
    with PrivateRedis(tmp_path / "redis") as redis:
        readiness = Readiness("scheduler", [redis_answers(replace(settings, redis_url=redis.url))],
                              ReadyConfig(tmp_path / "r", 1.0), log)
        try:
            assert readiness.evaluate().ready
            pid = redis.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)  # accepts connections (the kernel does), answers none
            try:
                outcome = readiness.evaluate().checks["redis"]
                assert not outcome.ok and outcome.detail.startswith("no answer for ")
            finally:
                os.kill(pid, signal.SIGCONT)
            wait_for(lambda: readiness.evaluate().ready, timeout=20, what="Redis answering")
        finally:
            readiness.close()


def test_the_gateways_grpc_health_follows_its_readiness(
        settings: Settings, bucket: str, broker: Broker, broker_proxy: TcpProxy,
        tmp_path: Path) -> None:
    settings = replace(settings, amqp_url=broker_proxy.for_url(settings.amqp_url))
    options = GatewayOptions(listen="127.0.0.1:0", admins=write_admins(tmp_path / "a.json").path)
    server = build(settings, options, log)
    follows: object = server
    assert isinstance(follows, FollowsReadiness)  # how `fedhive.service.run` wires it
    address = f"127.0.0.1:{server.port}"
    readiness = Readiness("gateway", server.ready_checks(), ReadyConfig(tmp_path / "r", 1.0),
                          log, on_change=server.readiness_changed)
    try:
        assert not gateway_serving(address)  # listening, not yet checked
        readiness.start()  # its first S3 request may outlast the 1 s bound on a busy machine:
        wait_for(lambda: gateway_serving(address), timeout=30, what="SERVING")  # rounds go on
        broker_proxy.cut()
        wait_for(lambda: not gateway_serving(address), timeout=30, what="NOT_SERVING")
        assert read_report(tmp_path / "r").failing().startswith("broker: RabbitMQ at ")
        broker_proxy.heal()
        wait_for(lambda: gateway_serving(address), timeout=30, what="SERVING again")
    finally:
        readiness.close()
        server.close()
