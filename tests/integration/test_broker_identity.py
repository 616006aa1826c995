"""Per-site broker users (deploy/broker_users.py) on the real broker: what a site may and may not
do, and that the services user can run the bus."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from google.protobuf.message import Message

from fedhive.brokerusers import create_users, delete_users, site_user, vhost_of
from fedhive.bus import Delivery, RabbitBus, Senders
from fedhive.bus.publisher import properties
from fedhive.config import Settings
from fedhive.names import Names
from fedhive.proto.v1 import site_pb2
from tests.fixtures.bus import Broker
from tests.fixtures.infra import RUN_ID, wait_for
from tests.fixtures.site_probes import run_probes
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
    users = broker_users.plan(namespace, ["a", "b"], f"{namespace}-svc")
    broker_users.create_users(users, pika.URLParameters(amqp_url).virtual_host, CTL,
                              namespace=namespace)
    yield {
        key: Settings(amqp_url=with_user(amqp_url, u.name, u.password), namespace=namespace)
        for key, u in zip(["a", "b", f"{namespace}-svc"], users, strict=True)
    }
    broker_users.delete_users([u.name for u in users], CTL)
    Broker(amqp_url, namespace).delete_all()


def open_channel(settings: Settings) -> Any:
    return pika.BlockingConnection(pika.URLParameters(settings.amqp_url)).channel()


def test_a_site_runs_its_own_queue_and_publishes_its_own_events(
    sites: dict[str, Settings], namespace: str
) -> None:
    a, svc = "a", f"{namespace}-svc"
    names = Names(namespace)
    services = RabbitBus(sites[svc], name="services")
    site = RabbitBus(sites[a], name="site-a", site=True)
    seen: list[tuple[str, Any]] = []
    try:
        services.subscribe("watch", ["site.*.*"], collect(seen), [site_pb2.SiteHeartbeat],
                           senders=Senders.any_site(names))
        site.serve(names.site_queue(a), reply_jobs, [site_pb2.ListSiteJobsRequest],
                   senders=Senders.only(svc))
        # a service calls the site; the site answers through the replies exchange
        reply = services.call(names.site_queue(a), site_pb2.ListSiteJobsRequest(),
                              site_pb2.ListSiteJobsReply, timeout=10)
        assert [job.job_id for job in reply.jobs] == [svc]  # the services user signed it
        # the site calls a job's server queue on its own key and gets an answer
        services.serve(names.job_server_queue("job-1"), reply_jobs,
                       [site_pb2.ListSiteJobsRequest], senders=Senders.only(names.site_user(a)),
                       binding_keys=[names.job_site_route("job-1", a)])
        reply = site.call(names.job_site_route("job-1", a), site_pb2.ListSiteJobsRequest(),
                          site_pb2.ListSiteJobsReply, timeout=10)
        assert [job.job_id for job in reply.jobs] == [names.site_user(a)]
        site.publish_event(Names.site_event(a, "heartbeat"), site_pb2.SiteHeartbeat(site=a))
        wait_for(lambda: seen, timeout=10, what="the site's heartbeat")
        assert seen[0][0] == f"site.{a}.heartbeat"
    finally:
        site.close()
        services.close()


def exported(vhost: str) -> dict[str, Any]:
    """The broker's definitions (what `rabbitmqctl export_definitions` reads back), of `vhost`."""
    done = subprocess.run([*CTL, "-q", "export_definitions", "-"], capture_output=True,
                          text=True, timeout=60, check=True)
    document = json.loads(done.stdout)
    return {kind: [item for item in document.get(kind, []) if item.get("vhost") == vhost]
            for kind in ("permissions", "queues", "bindings")}


def test_a_sites_user_may_configure_nothing_and_its_queue_is_provisioned(
    sites: dict[str, Settings], namespace: str, amqp_url: str
) -> None:
    """Read back from the broker, so that no change can quietly give a site configure again:
    the provisioning declared the site's queue (as `Topology(site=True)` describes it) and its
    one binding, by its own name on the command exchange."""
    names, vhost = Names(namespace), vhost_of(amqp_url)
    found = exported(vhost)
    for site in ("a", "b"):
        queue = names.site_queue(site)
        [grant] = [p for p in found["permissions"] if p["user"] == names.site_user(site)]
        assert grant["configure"] == "^$"
        [declared] = [q for q in found["queues"] if q["name"] == queue]
        assert (declared["durable"], declared["arguments"]) == (
            True, {"x-queue-type": "quorum", "x-delivery-limit": 5})
        bound = [(b["source"], b["routing_key"]) for b in found["bindings"]
                 if b["destination"] == queue]
        assert bound == [(names.cmd_exchange, queue)]


def test_reprovisioning_keeps_the_queue_and_deleting_the_user_deletes_it(
    sites: dict[str, Settings], namespace: str, amqp_url: str
) -> None:
    """Creating a site's user again (a new password) leaves its queue, and what waits in it, as
    it is, and closes the connections opened with the old password (RabbitMQ checks it only at
    connect: a leaked one's session would go on); deleting the user deletes the queue (nothing
    would consume it again)."""
    names, vhost = Names(namespace), vhost_of(amqp_url)
    queue = names.site_queue("c")
    first = [site_user(namespace, "c")]
    create_users(first, vhost, CTL, namespace=namespace)
    old_url = with_user(amqp_url, first[0].name, first[0].password)
    services = RabbitBus(sites[f"{namespace}-svc"], name="services")
    leaked = open_channel(Settings(amqp_url=old_url))
    bystander = open_channel(sites["a"])  # another site's connection stays open
    try:
        services.send(queue, site_pb2.ListSiteJobsRequest(), message_id="waiting")
        second = [site_user(namespace, "c")]
        create_users(second, vhost, CTL, namespace=namespace)
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker, match="password was chan"):
            for _ in range(50):  # the broker's close arrives with the next frames read
                leaked.connection.process_data_events(time_limit=0.1)
        bystander.connection.process_data_events(time_limit=0.1)
        assert bystander.is_open
        with pytest.raises(pika.exceptions.ProbableAuthenticationError):
            open_channel(Settings(amqp_url=old_url))
        channel = open_channel(Settings(amqp_url=with_user(amqp_url, second[0].name,
                                                           second[0].password)))
        try:
            method, props, _ = channel.basic_get(queue, auto_ack=True)
            assert method is not None and props.message_id == "waiting"
        finally:
            channel.connection.close()
    finally:
        services.close()
        bystander.connection.close()
    delete_users([second[0].name], CTL)
    assert queue not in [q["name"] for q in exported(vhost)["queues"]]


def test_a_site_consumer_rechecks_its_queue_after_a_reconnect(
    sites: dict[str, Settings], namespace: str, amqp_url: str
) -> None:
    """Its queue deleted (the broker cancels the consumer): the consumer reconnects and keeps
    rechecking the queue (a site cannot declare it), and resumes once the site is provisioned
    again."""
    names, vhost = Names(namespace), vhost_of(amqp_url)
    queue = names.site_queue("d")
    user = site_user(namespace, "d")
    create_users([user], vhost, CTL, namespace=namespace)
    site = RabbitBus(Settings(amqp_url=with_user(amqp_url, user.name, user.password),
                              namespace=namespace), name="site-d", site=True)
    services = RabbitBus(sites[f"{namespace}-svc"], name="services")
    seen: list[str] = []
    try:
        consumer = site.serve(queue, lambda m, d: seen.append(d.message_id or ""),
                              [site_pb2.ListSiteJobsRequest],
                              senders=Senders.only(services.user))
        channel = open_channel(Settings(amqp_url=amqp_url))  # the broker's administrator
        channel.queue_delete(queue)
        channel.connection.close()
        wait_for(lambda: not consumer.consuming, what="the consumer to lose its queue")
        create_users([user], vhost, CTL, namespace=namespace)  # provisioned again
        wait_for(lambda: consumer.consuming, timeout=30, what="the consumer to resume")
        services.send(queue, site_pb2.ListSiteJobsRequest(), message_id="after")
        wait_for(lambda: seen == ["after"], what="the command after the reconnect")
    finally:
        site.close()
        services.close()
        delete_users([user.name], CTL)


def test_every_probe_with_a_sites_credentials_is_refused(
    sites: dict[str, Settings], namespace: str
) -> None:
    """The attacks of a job's code holding its site's broker credentials (issue #16): each is
    refused by the broker, whatever the services would have done with it."""
    names = Names(namespace)
    services = RabbitBus(sites[f"{namespace}-svc"], name="services")
    try:  # what the probes aim at exists, so a refusal is the permissions', not a 404
        for queue in (names.service_queue("job-store"), names.service_queue("job-runner")):
            services.declare_queue(queue)  # the sites' queues: the provisioning's
        results = run_probes(sites["a"].amqp_url, namespace, "a", "b")
    finally:
        services.close()
    assert len(results) >= 30
    allowed = [r.name for r in results if r.allowed]
    assert allowed == []
    outcomes = {r.name: r.outcome for r in results}
    assert outcomes["task traffic to a job it does not run (command exchange)"] == "unroutable"
    assert outcomes["publish with another user's user_id"].startswith("406")
    others = {name: outcome for name, outcome in outcomes.items()
              if name not in ("task traffic to a job it does not run (command exchange)",
                              "publish with another user's user_id")}
    assert {o.split()[0] for o in others.values()} == {"403"}, others


def test_a_site_of_one_namespace_reaches_nothing_of_another(
    sites: dict[str, Settings], namespace: str, amqp_url: str
) -> None:
    """Two deployments on one broker with the same site names: each site has its own user
    (`<namespace>.<site>`), with rights in its own namespace only."""
    broker_users = load_broker_users()
    other_ns = f"{namespace}-two"
    users = broker_users.plan(other_ns, ["a"], None)
    broker_users.create_users(users, pika.URLParameters(amqp_url).virtual_host, CTL,
                              namespace=other_ns)
    try:
        assert users[0].name == f"{other_ns}.a" != Names(namespace).site_user("a")
        other_a = Settings(amqp_url=with_user(amqp_url, users[0].name, users[0].password),
                           namespace=other_ns)
        mine, theirs = (RabbitBus(s, name="site-a", site=True) for s in (sites["a"], other_a))
        try:  # both serve "their" site-a queue side by side
            served = [bus.serve(Names(s.namespace).site_queue("a"), reply_jobs,
                                [site_pb2.ListSiteJobsRequest])
                      for bus, s in ((mine, sites["a"]), (theirs, other_a))]
            assert all(consumer.consuming for consumer in served)
        finally:
            mine.close()
            theirs.close()
        results = run_probes(other_a.amqp_url, namespace, "a", "b")  # at the first namespace
        assert [r.name for r in results if r.allowed] == []
    finally:
        broker_users.delete_users([u.name for u in users], CTL)
        Broker(amqp_url, other_ns).delete_all()


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
        user = Names(namespace).site_user(site)
        assert list(passwords) == [user] and len(passwords[user]) >= 24
        assert passwords[user] not in done.stdout
        url = with_user(amqp_url, user, passwords[user])
        pika.BlockingConnection(pika.URLParameters(url)).close()  # the user exists
    finally:
        subprocess.run([*run, "delete", user], capture_output=True, check=True)
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


def test_a_services_call_takes_its_reply_only_from_the_site_it_asked(
    sites: dict[str, Settings], namespace: str
) -> None:
    """Site a learns a pending call to site b (reply address and correlation id) and answers
    it first: the caller ignores the forged reply and takes b's."""
    names = Names(namespace)
    services = RabbitBus(sites[f"{namespace}-svc"], name="services")
    result: list[Any] = []
    caller = threading.Thread(target=lambda: result.append(services.call(
        names.site_queue("b"), site_pb2.ListSiteJobsRequest(), site_pb2.ListSiteJobsReply,
        timeout=20)))
    caller.start()
    try:
        request = wait_for(lambda: _take(sites[f"{namespace}-svc"], names.site_queue("b")),
                           what="the request to b")
        for site, job in (("a", "forged"), ("b", "real")):
            reply = site_pb2.ListSiteJobsReply(jobs=[site_pb2.SiteJob(job_id=job)])
            channel = open_channel(sites[site])
            channel.confirm_delivery()
            channel.basic_publish(names.replies_exchange, request.reply_to,
                                  reply.SerializeToString(), properties(
                                      reply, user_id=names.site_user(site),
                                      correlation_id=request.correlation_id))
            channel.connection.close()
        caller.join(20)
        assert [job.job_id for job in result[0].jobs] == ["real"]
    finally:
        caller.join(20)
        services.close()


def _take(settings: Settings, queue: str) -> Any:
    """The properties of the next message in `queue`, taken off it (None when it is empty)."""
    channel = open_channel(settings)
    try:
        method, props, _ = channel.basic_get(queue, auto_ack=True)
        return props if method is not None else None
    finally:
        channel.connection.close()
