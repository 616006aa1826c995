"""deploy/compose/broker_setup.py against a real RabbitMQ management API: a private broker node of
this module runs the `rabbitmq_management` plugin, the script runs as docker-compose.yml's
`broker-users` service runs it (its arguments and environment), and raw clients and the bus
prove what its one `/api/definitions` import made: the services' user works, a site's user
configures nothing while its control queue and binding exist and its site bus consumes them,
a re-run rotates only the password it was asked to and keeps the queue and what waits in it,
and a refused administrator is one line and a non-zero exit."""

from __future__ import annotations

import base64
import json
import os
import pwd
import secrets
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pika
import pika.exceptions
import pytest
from google.protobuf.message import Message

from fedhive.brokerusers import with_user
from fedhive.bus import Delivery, RabbitBus, Senders
from fedhive.config import Settings
from fedhive.names import Names
from fedhive.proto.v1 import site_pb2
from fedhive_services.site_agent.config import load_site
from tests.fixtures.private_infra import PrivateBroker

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "compose" / "broker_setup.py"
NAMESPACE = "fh"  # the node is this module's own: no other test shares its names
SERVICES = "fedhive-services"  # the script's default --service-user
SITES = ("site-1", "site-2")
names = Names(NAMESPACE)


@dataclass(frozen=True)
class Deployment:
    broker: PrivateBroker
    sites_root: Path
    services_password: str

    @property
    def services_url(self) -> str:
        return with_user(self.broker.amqp_url, SERVICES, self.services_password)

    def site_url(self, site: str) -> str:
        """The broker URL broker_setup wrote into the site's folder (its user and password)."""
        return str(load_site(self.sites_root / site).broker_url)

    def api(self, path: str) -> Any:
        """GET a management API resource as the node's administrator (guest)."""
        request = urllib.request.Request(
            f"{self.broker.management_url}/api/{path}",
            headers={"authorization": "Basic " + base64.b64encode(b"guest:guest").decode()})
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.load(answer)


def broker_setup(broker: PrivateBroker, sites_root: Path, services_password: str, *,
                 admin: tuple[str, str] = ("guest", "guest"),
                 ) -> subprocess.CompletedProcess[str]:
    """The script as a process, with the arguments and environment of compose's `broker-users`
    (its own URLs for the compose host names; this user owns the site folders)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FEDHIVE_", "AWS_", "RABBITMQ_"))}
    env.update(FEDHIVE_AMQP_URL=f"amqp://127.0.0.1:{broker.port}/%2F",  # no user: the sites'
               FEDHIVE_NAMESPACE=NAMESPACE, RABBITMQ_USER=admin[0], RABBITMQ_PASSWORD=admin[1],
               RABBITMQ_SERVICES_PASSWORD=services_password)
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--management-url", broker.management_url,
         "--sites-root", str(sites_root), "--storage-url", "http://127.0.0.1:1/fedhive",
         "--owner", pwd.getpwuid(os.getuid()).pw_name, "--wait", "30", *SITES],
        env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("broker-setup-http")
    with PrivateBroker(tmp / "rabbitmq", management=True) as broker:
        done = Deployment(broker, tmp / "sites", secrets.token_urlsafe(16))
        for site in SITES:
            (done.sites_root / site).mkdir(parents=True)  # compose's named volumes
        ran = broker_setup(broker, done.sites_root, done.services_password)
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.splitlines() == [f"user {user} on vhost /" for user in
                                           (SERVICES, *(names.site_user(s) for s in SITES))]
        yield done


def connect(url: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.URLParameters(url))


def test_the_services_user_declares_and_consumes(deployment: Deployment) -> None:
    connection = connect(deployment.services_url)
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        queue = channel.queue_declare(f"{NAMESPACE}.probe", exclusive=True).method.queue
        channel.queue_bind(queue, names.events_exchange, "probe.#")
        channel.basic_publish(names.events_exchange, "probe.one", b"hello", mandatory=True)
        method, _, body = next(channel.consume(queue, inactivity_timeout=10))
        assert method is not None and body == b"hello"
        channel.basic_ack(method.delivery_tag)
    finally:
        connection.close()


def test_a_sites_user_configures_nothing_and_its_bus_consumes_its_queue(
    deployment: Deployment,
) -> None:
    site = "site-1"
    user, queue, vhost = names.site_user(site), names.site_queue(site), quote("/", safe="")
    grant = deployment.api(f"permissions/{vhost}/{quote(user, safe='')}")
    assert grant["configure"] == "^$"
    declared = deployment.api(f"queues/{vhost}/{queue}")
    assert (declared["durable"], declared["arguments"]) == (
        True, {"x-queue-type": "quorum", "x-delivery-limit": 5})
    bound = [(b["source"], b["routing_key"])
             for b in deployment.api(f"queues/{vhost}/{queue}/bindings") if b["source"]]
    assert bound == [(names.cmd_exchange, queue)]  # besides the default exchange's

    connection = connect(deployment.site_url(site))
    try:
        channel = connection.channel()
        channel.queue_declare(queue, passive=True)  # what the import made, checked only
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            channel.queue_declare(f"{NAMESPACE}.site.{site}.mine")
        assert refused.value.reply_code == 403
    finally:
        connection.close()

    def answer(message: Message, delivery: Delivery) -> Message:
        return site_pb2.ListSiteJobsReply(jobs=[site_pb2.SiteJob(job_id=delivery.user_id or "")])

    services = RabbitBus(Settings(amqp_url=deployment.services_url, namespace=NAMESPACE),
                         name="services")
    agent = RabbitBus(Settings(amqp_url=deployment.site_url(site), namespace=NAMESPACE),
                      name=site, site=True)
    try:
        agent.serve(queue, answer, [site_pb2.ListSiteJobsRequest], senders=Senders.only(SERVICES))
        reply = services.call(queue, site_pb2.ListSiteJobsRequest(), site_pb2.ListSiteJobsReply,
                              timeout=10)
        assert [job.job_id for job in reply.jobs] == [SERVICES]  # signed by the services' user
    finally:
        agent.close()
        services.close()


def test_a_rerun_rotates_a_cleared_password_and_keeps_the_queue(deployment: Deployment) -> None:
    """The operator clears site-1's broker URL to rotate its password: the re-run gives site-1
    a new one (the old one is refused), keeps site-2's, an operator's field and site-1's queue
    with the message waiting in it."""
    rotated, kept = SITES
    queue = names.site_queue(rotated)
    old_url, kept_url = deployment.site_url(rotated), deployment.site_url(kept)
    connection = connect(deployment.services_url)
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(names.cmd_exchange, queue, b"waiting", mandatory=True,
                              properties=pika.BasicProperties(message_id="waiting"))
    finally:
        connection.close()
    site_file = deployment.sites_root / rotated / "local" / "site.json"
    config = json.loads(site_file.read_text())
    del config["broker_url"]
    site_file.write_text(json.dumps({**config, "heartbeat_interval_s": 2.5}))

    ran = broker_setup(deployment.broker, deployment.sites_root, deployment.services_password)
    assert ran.returncode == 0, ran.stderr

    new_url = deployment.site_url(rotated)
    assert new_url != old_url and deployment.site_url(kept) == kept_url
    assert load_site(deployment.sites_root / rotated).heartbeat_interval_s == 2.5
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        connect(old_url)
    connect(kept_url).close()
    connection = connect(new_url)
    try:
        method, properties, body = connection.channel().basic_get(queue, auto_ack=True)
        assert method is not None and (properties.message_id, body) == ("waiting", b"waiting")
    finally:
        connection.close()


@pytest.mark.parametrize("who", ["wrong password", "not an administrator"])
def test_a_refused_administrator_is_one_line_and_a_failure(
    deployment: Deployment, tmp_path: Path, who: str
) -> None:
    admin = (("guest", "not-the-password") if who == "wrong password"
             else (SERVICES, deployment.services_password))  # a user without the tag
    ran = broker_setup(deployment.broker, tmp_path, deployment.services_password, admin=admin)
    assert ran.returncode == 2
    assert ran.stderr.splitlines() == [
        f"broker_setup.py: the management API refused RABBITMQ_USER {admin[0]!r} (HTTP 401): "
        "it must be an administrator with this password"]
    assert list(tmp_path.iterdir()) == []  # no site folder written for a failed import
