"""RabbitMQ over TLS, for real: a private broker node of this module with an AMQPS listener whose
certificate a CA made here signs (tests/fixtures/certs.py), names `localhost` only, and is
checked: the bus, a site agent and its client job, and a service process all connect with
`amqps://` and the CA file; a CA that did not sign it and a host name it does not carry are
refused at once, in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from google.protobuf.message import Message

from fedhive.blobs import S3BlobStore
from fedhive.bus import Delivery, RabbitBus
from fedhive.config import Settings
from fedhive.errors import ConfigError
from fedhive.names import Names
from fedhive.proto.v1 import admin_pb2, site_pb2
from fedhive_services.site_agent.config import load_site
from tests.fixtures.certs import CertAuthority
from tests.fixtures.infra import (
    S3Server,
    delete_redis_namespace,
    settings_for,
    stop_process,
    wait_for,
)
from tests.fixtures.job_store import JobStoreProcess, service_env
from tests.fixtures.private_infra import BrokerTls, PrivateBroker
from tests.fixtures.site_agent import (
    Events,
    SiteAgents,
    allocate,
    deploy,
    end_runs,
    run_cli,
    start,
    write_site,
)


@dataclass(frozen=True)
class Tls:
    broker: PrivateBroker
    ca: CertAuthority
    wrong_ca: CertAuthority  # signed nothing this broker serves


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tls]:
    tmp = tmp_path_factory.mktemp("tls")
    ca = CertAuthority.create(tmp / "ca")
    wrong_ca = CertAuthority.create(tmp / "wrong-ca", name="another test CA")
    server = ca.issue("broker", dns=("localhost",))  # not 127.0.0.1: that is the wrong name
    with PrivateBroker(tmp / "rabbitmq", tls=BrokerTls(server.cert, server.key, ca.pem)) as node:
        yield Tls(node, ca, wrong_ca)


@pytest.fixture
def tls_settings(tls: Tls, redis_url: str, s3_server: S3Server, test_bucket: str,
                 namespace: str) -> Iterator[Settings]:
    """The test's settings with the TLS broker (as its guest: the services' user) and its CA."""
    settings = settings_for(tls.broker.amqps_url, redis_url, s3_server, test_bucket, namespace)
    yield replace(settings, amqp_ca_file=str(tls.ca.pem))
    delete_redis_namespace(redis_url, namespace)


@pytest.fixture
def buses(tls_settings: Settings) -> Iterator[list[RabbitBus]]:
    """Buses a test opens on the TLS broker, closed at teardown."""
    opened: list[RabbitBus] = []
    yield opened
    for bus in opened:
        bus.close()


def _bus(buses: list[RabbitBus], settings: Settings, name: str) -> RabbitBus:
    bus = RabbitBus(settings, name=name)
    buses.append(bus)
    return bus


def _connections(tls: Tls) -> set[tuple[str, str]]:
    """(server port, whether TLS) of every client connection the node has."""
    out = tls.broker.rabbitmqctl("list_connections", "port", "ssl", "--quiet",
                                 "--no-table-headers")
    return {(port, ssl) for port, ssl in (line.split() for line in out.splitlines() if line)}


def test_publish_consume_and_rpc_over_tls(
    tls: Tls, tls_settings: Settings, buses: list[RabbitBus]
) -> None:
    bus = _bus(buses, tls_settings, "tls")
    queue = bus.names.service_queue("tls-echo")

    def answer(message: Message, delivery: Delivery) -> Message:
        assert isinstance(message, site_pb2.ListSiteJobsRequest)
        return site_pb2.ListSiteJobsReply(jobs=[site_pb2.SiteJob(job_id="over-tls")])

    bus.serve(queue, answer, [site_pb2.ListSiteJobsRequest])
    seen: list[Message] = []
    bus.subscribe("tls-watch", ["site.#"], lambda m, d: seen.append(m), [site_pb2.SiteHeartbeat])

    reply = bus.call(queue, site_pb2.ListSiteJobsRequest(), site_pb2.ListSiteJobsReply,
                     timeout=10)
    assert [job.job_id for job in reply.jobs] == ["over-tls"]
    bus.publish_event("site.s.heartbeat", site_pb2.SiteHeartbeat(site="s"))
    assert wait_for(lambda: seen, what="the event") == [site_pb2.SiteHeartbeat(site="s")]
    # Every connection of the bus (publisher, RPC, consumers) is on the TLS listener.
    assert _connections(tls) == {(str(tls.broker.tls_port), "true")}


@pytest.mark.parametrize(("trusted", "host", "refusal"), [
    ("wrong_ca", "localhost", "self-signed certificate in certificate chain"),
    ("ca", "127.0.0.1", "IP address mismatch, certificate is not valid for '127.0.0.1'"),
])
def test_a_certificate_that_does_not_verify_is_refused_at_once(
    tls: Tls, tls_settings: Settings, buses: list[RabbitBus], trusted: str, host: str,
    refusal: str,
) -> None:
    """A CA that did not sign the broker's certificate, a host name that is not on it. The bus
    retries connecting for ever (`RECONNECT`): that these calls return at all shows the refusal
    is not retried."""
    ca: CertAuthority = getattr(tls, trusted)
    settings = replace(tls_settings, amqp_ca_file=str(ca.pem),
                       amqp_url=tls.broker.amqps_url.replace("@localhost:", f"@{host}:"))
    bus = _bus(buses, settings, "refused")
    for attempt in (
        lambda: bus.publish_event("site.s.heartbeat", site_pb2.SiteHeartbeat(site="s")),
        lambda: bus.call(bus.names.service_queue("nobody"), site_pb2.ListSiteJobsRequest(),
                         site_pb2.ListSiteJobsReply, timeout=10),
    ):
        with pytest.raises(ConfigError) as caught:
            attempt()
        message = str(caught.value)
        assert message.startswith(f"RabbitMQ at {host}:{tls.broker.tls_port}: its TLS "
                                  f"certificate is refused ({refusal}")
        assert "FEDHIVE_AMQP_CA_FILE" in message and "\n" not in message
        assert caught.value.field == "amqp_url"


def test_amqps_to_a_port_without_tls_is_refused_at_once(
    tls: Tls, tls_settings: Settings, buses: list[RabbitBus]
) -> None:
    url = tls.broker.amqps_url.replace(f":{tls.broker.tls_port}/", f":{tls.broker.port}/")
    bus = _bus(buses, replace(tls_settings, amqp_url=url), "plain-port")
    with pytest.raises(ConfigError, match=f"RabbitMQ at localhost:{tls.broker.port}: it does "
                                          "not speak TLS on this port"):
        bus.publish_event("site.s.heartbeat", site_pb2.SiteHeartbeat(site="s"))


def test_a_site_and_its_client_job_work_over_tls_with_broker_ca_file(
    tls: Tls, tls_settings: Settings, buses: list[RabbitBus], tmp_path: Path
) -> None:
    """The agent comes online (its heartbeat reaches a services consumer), serves a command,
    and its client job, which reads the same site.json, reaches the broker too."""
    events = Events(lambda name: _bus(buses, tls_settings, name))
    agents = SiteAgents(tmp_path, tls_settings, ctl=tls.broker.ctl)
    blobs = S3BlobStore.from_settings(tls_settings)
    blobs.ensure_bucket()
    try:
        agent = agents.write("site-1", broker_ca_file="local/broker-ca.pem")  # site-relative
        shutil.copy(tls.ca.pem, agent.site_dir / "local" / "broker-ca.pem")
        agent.launch()
        site_user = Names(tls_settings.namespace).site_user("site-1")
        beats = wait_for(lambda: events.of("site.site-1.heartbeat"), what="a site heartbeat")
        assert beats[0][1] == site_user

        allocate(agent, "job-1", {})
        deploy(agent, blobs, "job-1")
        end_runs(agents.bus, agent.namespace, "job-1", "site-1")
        start(agent, "job-1")
        [ended] = wait_for(lambda: events.ended("site-1", "job-1"), timeout=30,
                           what="the client job's ended notice")
        assert (ended.exit_code, ended.reason) == (0, "the server job ended the run")
        assert (agent.report("job-1") or {})["broker_user"] == site_user
        assert _connections(tls) == {(str(tls.broker.tls_port), "true")}
    finally:
        agents.close()
        blobs.delete_prefix(f"{tls_settings.namespace}/")
        blobs.close()


def test_a_site_agent_given_the_wrong_ca_stops_at_start_in_one_line(
    tls: Tls, tmp_path: Path
) -> None:
    """Its first connection is refused: exit 2 and one line, not a retry loop. (The handshake
    fails before the broker checks the user: the user need not exist.)"""
    url = tls.broker.amqps_url.replace("guest:guest", "fedhive.site-1:unused")
    site_dir = _site(tmp_path, url, str(tls.wrong_ca.pem))
    done = run_cli("run", "--site-dir", str(site_dir), timeout=60)
    assert done.returncode == 2, done.stderr
    *logged, error = done.stderr.splitlines()
    assert error.startswith(
        f"site-agent: RabbitMQ at localhost:{tls.broker.tls_port}: its TLS certificate is "
        "refused (self-signed certificate in certificate chain)")
    assert all(json.loads(line)["level"] for line in logged)  # log records (pika's), no traceback


def test_a_service_starts_with_fedhive_amqp_ca_file(
    tls: Tls, tls_settings: Settings, buses: list[RabbitBus], tmp_path: Path
) -> None:
    """The job-store's composition root takes the CA file from the environment: without it
    (the system's CAs) the broker is refused and the service stops in one line."""
    argv = [sys.executable, "-m", "fedhive_services.job_store.main"]
    refused = subprocess.run(argv, env=service_env(replace(tls_settings, amqp_ca_file=None)),
                             capture_output=True, text=True, timeout=120, check=False)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.splitlines()[-1].startswith(
        f"fedhive-job-store: RabbitMQ at localhost:{tls.broker.tls_port}: its TLS certificate "
        "is refused")

    service = JobStoreProcess(tls_settings, tmp_path / "job-store.log")
    env = service_env(tls_settings)
    with service.log_path.open("ab") as log:
        service.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
    try:
        service.wait_ready(_bus(buses, tls_settings, "job-store-client"))
        reply = _bus(buses, tls_settings, "admin").call(
            service.queue, admin_pb2.ListSitesRequest(), admin_pb2.ListSitesReply, timeout=10)
        assert list(reply.sites) == []
    finally:
        stop_process(service.proc)


# site.json's broker_ca_file, checked when the site folder is read (no broker needed) ---------
def _site(tmp_path: Path, broker_url: str, ca_file: object) -> Path:
    return write_site(tmp_path / "site", site="site-1", namespace="fedhive",
                      broker_url=broker_url, storage_url="http://127.0.0.1:1/bucket",
                      broker_ca_file=ca_file)


TLS_URL = "amqps://fedhive.site-1:pw@broker.example.org:5671/%2F"


def test_broker_ca_file_relative_or_absolute(tmp_path: Path) -> None:
    ca = CertAuthority.create(tmp_path / "ca")
    site_dir = _site(tmp_path, TLS_URL, "../ca/ca.pem")
    assert load_site(site_dir).broker_ca_file == ca.pem
    _site(tmp_path, TLS_URL, str(ca.pem))
    assert load_site(site_dir).broker_ca_file == ca.pem


@pytest.mark.parametrize(("url", "ca_file", "problem"), [
    (TLS_URL, "local/missing.pem", r"field 'broker_ca_file': '.*/local/missing\.pem' is not a "
                                   "file"),
    (TLS_URL, "local/site.json", "field 'broker_ca_file': broker CA file .* not a PEM CA "
                                 "certificate"),
    (TLS_URL, "", "field 'broker_ca_file' must be a non-empty string"),
    (TLS_URL.replace("amqps://", "amqp://"), "local/site.json",
     "field 'broker_ca_file' needs an amqps:// broker_url"),
    (TLS_URL + "?ssl_options=%7B%7D", "local/site.json",
     r"field 'broker_url': the broker URL may not carry \?ssl_options="),
])
def test_a_bad_broker_ca_file_is_one_line_naming_file_and_field(
    tmp_path: Path, url: str, ca_file: str, problem: str
) -> None:
    site_dir = _site(tmp_path, url, ca_file)
    with pytest.raises(ConfigError, match=problem) as caught:
        load_site(site_dir)
    assert str(caught.value).startswith(f"{site_dir / 'local' / 'site.json'}: ")
    assert "\n" not in str(caught.value)


def test_the_agent_stops_at_start_on_a_missing_broker_ca_file(tmp_path: Path) -> None:
    site_dir = _site(tmp_path, TLS_URL, "local/missing.pem")
    done = run_cli("run", "--site-dir", str(site_dir), timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"site-agent: {site_dir / 'local' / 'site.json'}: field "
                                   f"'broker_ca_file': '{site_dir / 'local' / 'missing.pem'}' "
                                   "is not a file")
