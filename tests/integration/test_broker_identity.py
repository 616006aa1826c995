"""Per-site broker users (deploy/broker_users.py) on the real broker: what a site may and may not
do, and that the services user can run the bus."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from google.protobuf.message import Message

from fedhive.bus import Delivery, RabbitBus
from fedhive.bus.publisher import properties
from fedhive.config import Settings
from fedhive.errors import Unavailable
from fedhive.names import Names
from fedhive.proto.v1 import site_pb2
from tests.fixtures.bus import Broker
from tests.fixtures.infra import RUN_ID, wait_for
from tests.fixtures.sites import CTL, SCRIPT, collect, load_broker_users, with_user


def reply_jobs(message: Message, delivery: Delivery) -> Message:
    return site_pb2.ListSiteJobsReply(jobs=[site_pb2.SiteJob(job_id=delivery.user_id or "")])


@pytest.fixture(scope="module")
def namespace() -> str:
    """One namespace (and one set of users) for the module: creating users takes seconds."""
    return f"t{RUN_ID}-ident"


@pytest.fixture(scope="module")
def sites(amqp_url: str, namespace: str) -> Iterator[dict[str, Settings]]:
    broker_users = load_broker_users()
    users = broker_users.plan(namespace, [f"{namespace}-a", f"{namespace}-b"],
                              f"{namespace}-svc")
    broker_users.create_users(users, pika.URLParameters(amqp_url).virtual_host, CTL)
    yield {
        u.name: Settings(amqp_url=with_user(amqp_url, u.name, u.password), namespace=namespace)
        for u in users
    }
    broker_users.delete_users([u.name for u in users], CTL)
    Broker(amqp_url, namespace).delete_all()


def open_channel(settings: Settings) -> Any:
    return pika.BlockingConnection(pika.URLParameters(settings.amqp_url)).channel()


def test_a_site_runs_its_own_queue_and_publishes_its_own_events(
    sites: dict[str, Settings], namespace: str
) -> None:
    a, svc = f"{namespace}-a", f"{namespace}-svc"
    names = Names(namespace)
    services = RabbitBus(sites[svc], name="services", sign=True)
    site = RabbitBus(sites[a], name="site-a", sign=True)
    seen: list[tuple[str, Any]] = []
    try:
        services.subscribe("watch", ["site.*.*"], collect(seen), [site_pb2.SiteHeartbeat])
        site.serve(names.site_queue(a), reply_jobs, [site_pb2.ListSiteJobsRequest])
        # a service calls the site; the site's reply goes back through direct reply-to
        reply = services.call(names.site_queue(a), site_pb2.ListSiteJobsRequest(),
                              site_pb2.ListSiteJobsReply, timeout=10)
        assert [job.job_id for job in reply.jobs] == [svc]  # the services user signed it
        # the site calls a job's server queue (task traffic) and gets an answer
        services.serve(names.job_server_queue("job-1"), reply_jobs,
                       [site_pb2.ListSiteJobsRequest])
        reply = site.call(names.job_server_queue("job-1"), site_pb2.ListSiteJobsRequest(),
                          site_pb2.ListSiteJobsReply, timeout=10)
        assert [job.job_id for job in reply.jobs] == [a]
        site.publish_event(Names.site_event(a, "heartbeat"), site_pb2.SiteHeartbeat(site=a))
        wait_for(lambda: seen, timeout=10, what="the site's heartbeat")
        assert seen[0][0] == f"site.{a}.heartbeat"
    finally:
        site.close()
        services.close()


def test_a_site_cannot_consume_another_sites_queue(
    sites: dict[str, Settings], namespace: str
) -> None:
    a, b = f"{namespace}-a", f"{namespace}-b"
    site_b = RabbitBus(sites[b], name="site-b")
    site_b.serve(Names(namespace).site_queue(b), reply_jobs, [site_pb2.ListSiteJobsRequest])
    channel = open_channel(sites[a])
    try:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
            channel.basic_consume(Names(namespace).site_queue(b), lambda *_: None)
        assert err.value.reply_code == 403  # ACCESS_REFUSED
        channel = channel.connection.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:  # nor bind B's key
            channel.queue_bind(Names(namespace).site_queue(a), Names(namespace).cmd_exchange,
                               routing_key=Names(namespace).site_queue(b))
        assert err.value.reply_code == 403
    finally:
        channel.connection.close()
        site_b.close()


@pytest.mark.parametrize("routing_key", ["site.{b}.heartbeat", "site.online", "site.offline",
                                         "job.status.RUNNING"])
def test_a_site_cannot_publish_events_for_others(
    sites: dict[str, Settings], namespace: str, routing_key: str
) -> None:
    a, b = f"{namespace}-a", f"{namespace}-b"
    site = RabbitBus(sites[a], name="site-a", sign=True)
    try:
        with pytest.raises(Unavailable, match="ACCESS_REFUSED"):
            site.publish_event(routing_key.format(b=b), site_pb2.SiteHeartbeat(site=b))
    finally:
        site.close()


def test_a_site_cannot_send_commands_to_services(
    sites: dict[str, Settings], namespace: str
) -> None:
    a = f"{namespace}-a"
    site = RabbitBus(sites[a], name="site-a", sign=True)
    try:
        with pytest.raises(Unavailable, match="ACCESS_REFUSED"):
            site.send(Names(namespace).service_queue("job-store"), site_pb2.SiteHeartbeat())
    finally:
        site.close()


def test_the_broker_refuses_a_user_id_that_is_not_the_connections_user(
    sites: dict[str, Settings], namespace: str
) -> None:
    a, b = f"{namespace}-a", f"{namespace}-b"
    channel = open_channel(sites[a])
    try:
        channel.confirm_delivery()
        channel.exchange_declare(Names(namespace).events_exchange, "topic", durable=True)
        message = site_pb2.SiteHeartbeat(site=a)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
            channel.basic_publish(Names(namespace).events_exchange, f"site.{a}.heartbeat",
                                  message.SerializeToString(), properties(message, user_id=b))
        assert err.value.reply_code == 406  # PRECONDITION_FAILED: user_id != connection user
    finally:
        channel.connection.close()


def test_script_writes_credentials_0600_and_deletes_users(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    credentials = tmp_path / "secrets" / "broker.json"
    site = f"{namespace}-cli"
    run = [sys.executable, str(SCRIPT), "--namespace", namespace]
    done = subprocess.run([*run, "create", site, "--service-user", "", "--credentials",
                           str(credentials)], capture_output=True, text=True, check=False)
    try:
        assert done.returncode == 0, done.stderr
        assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
        passwords = json.loads(credentials.read_text())
        assert list(passwords) == [site] and len(passwords[site]) >= 24
        assert passwords[site] not in done.stdout
        url = with_user(amqp_url, site, passwords[site])
        pika.BlockingConnection(pika.URLParameters(url)).close()  # the user exists
    finally:
        subprocess.run([*run, "delete", site], capture_output=True, check=True)
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        pika.BlockingConnection(pika.URLParameters(url))


def test_script_refuses_a_bad_site_name(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "create", "bad.site", "--credentials",
                           str(tmp_path / "c.json")], capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "broker_users.py: user/site name 'bad.site' must be 1-64 chars of A-Z, a-z, 0-9, '_' "
        "or '-'"
    ]
    assert not (tmp_path / "c.json").exists()
