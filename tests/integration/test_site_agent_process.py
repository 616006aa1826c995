"""The site agent's process life: bad site folders stop it at start, heartbeats and
online/offline announcements, SIGKILL and restart (live client jobs re-adopted, dead ones
reported, no phantom jobs), the status command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from fedhive.blobs import BlobStore
from fedhive.brokerusers import vhost_of, with_user
from fedhive.bus import RabbitBus
from fedhive.config import Settings
from fedhive.names import Names
from fedhive.proto.v1 import site_pb2
from fedhive.structs import dict_to_struct, struct_to_dict
from fedhive_services.site_agent import process
from fedhive_services.site_agent.heartbeat import UNKNOWN_EXIT_CODE
from tests.fixtures.bus import Broker
from tests.fixtures.infra import wait_for
from tests.fixtures.site_agent import (
    HOLDING_CJ,
    Events,
    SiteAgents,
    allocate,
    deploy,
    run_cli,
    start,
    write_site,
)

GOOD_RESOURCES = {
    "components": [
        {"id": "resource_manager", "path": "fedhive.resources.listed.ListResourceManager",
         "args": {"resources": {"gpu": [0]}}},
        {"id": "resource_consumer", "path": "fedhive.resources.gpu.GPUResourceConsumer"},
    ]
}


@pytest.mark.parametrize(
    ("site_json", "resources", "expected"),
    [
        ('{"site": "s1", ', GOOD_RESOURCES, "local/site.json: invalid JSON at line 1"),
        ({"org": "x"}, GOOD_RESOURCES, "local/site.json: field 'site' is required"),
        ({"site": "a.b"}, GOOD_RESOURCES, "local/site.json: field 'site': invalid site name 'a.b'"),
        ({"site": "s1", "broker_url": "http://h/"}, GOOD_RESOURCES,
         "local/site.json: broker_url must use scheme amqp:// or amqps://"),
        ({"site": "s1", "heartbeat_interval_s": "5"}, GOOD_RESOURCES,
         "local/site.json: field 'heartbeat_interval_s' must be a positive number, got '5'"),
        ({"site": "s1", "colour": "red"}, GOOD_RESOURCES,
         "local/site.json: unknown field 'colour'"),
        ({"site": "s1"}, {"components": [{"id": "resource_manager", "path": "no.such.Manager"},
                                         GOOD_RESOURCES["components"][1]]},
         "resources.json: component 'resource_manager' (components[0].path)"),
        ({"site": "s1"}, {"components": [
            {"id": "resource_manager", "path": "fedhive.resources.listed.ListResourceManager",
             "args": {"resources": {"gpu": [0]}, "colour": 1}}, GOOD_RESOURCES["components"][1]]},
         "resources.json: component 'resource_manager'"),
    ],
    ids=["bad-json", "no-site", "bad-site-name", "bad-broker-url", "bad-interval",
         "unknown-field", "unknown-component-path", "bad-argument"],
)
def test_bad_site_folder_stops_the_agent_with_one_line(
    tmp_path: Path, amqp_url: str, site_json: object, resources: object, expected: str
) -> None:
    local = tmp_path / "local"
    local.mkdir()
    if isinstance(site_json, dict):
        site_json = json.dumps({"broker_url": with_user(amqp_url, "fedhive.s1", "secret"),
                                "storage_url": "http://127.0.0.1:9000/bucket", **site_json})
    assert isinstance(site_json, str)
    (local / "site.json").write_text(site_json)
    (local / "resources.json").write_text(json.dumps(resources))
    done = run_cli("run", "--site-dir", str(tmp_path))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("site-agent: "), done.stderr
    assert expected in lines[0]


def test_heartbeats_online_offline(
    site_agents: SiteAgents, make_bus: Callable[..., RabbitBus]
) -> None:
    events = Events(make_bus)
    agent = site_agents.start(org="Org A", heartbeat_interval_s=0.2)
    wait_for(lambda: events.of("site.site-1.online"), what="site.site-1.online")
    beats = wait_for(lambda: len(b := events.of("site.site-1.heartbeat")) >= 3 and b,
                     what="three heartbeats")
    beat, user = beats[-1]
    assert isinstance(beat, site_pb2.SiteHeartbeat)
    assert (beat.site, beat.org, user, list(beat.running_job_ids)) == (
        "site-1", "Org A", Names(agent.namespace).site_user("site-1"), [])
    assert beat.agent_version and beat.sent_at_ms > 0
    assert struct_to_dict(beat.resources)["free"] == {"gpu": 2}
    assert agent.stop() == 0  # SIGTERM: a clean shutdown
    offline = wait_for(lambda: events.of("site.site-1.offline"), what="site.site-1.offline")
    assert offline[0][0].site == "site-1"


def test_an_agent_configuring_nothing_serves_its_queue_and_a_missing_one_stops_it(
    site_agents: SiteAgents, make_bus: Callable[..., RabbitBus], broker: Broker
) -> None:
    """Its broker user may configure nothing (read back from the broker): the agent comes
    online, answers a command on the queue its provisioning declared, and heartbeats. With that
    queue gone (the site not provisioned) it stops at start with one line naming the queue
    (besides its JSON log lines)."""
    events = Events(make_bus)
    agent = site_agents.start(heartbeat_interval_s=0.2)
    user = Names(agent.namespace).site_user("site-1")
    grants = subprocess.run(
        ["rabbitmqctl", "-q", "--no-table-headers", "list_user_permissions", "-p",
         vhost_of(broker.amqp_url), user], capture_output=True, text=True, timeout=60, check=True)
    assert grants.stdout.split("\t")[1] == "^$"  # vhost, configure, write, read
    wait_for(lambda: events.of("site.site-1.online"), what="site.site-1.online")
    assert agent.job("no-such-job") is None  # a ListSiteJobs request answered
    wait_for(lambda: events.of("site.site-1.heartbeat"), what="a heartbeat")
    assert agent.stop() == 0

    unprovisioned = site_agents.write("site-2")  # its user created, its queue then deleted
    channel = broker.channel()
    channel.queue_delete(unprovisioned.queue)
    channel.connection.close()
    done = run_cli("run", "--site-dir", str(unprovisioned.site_dir))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert [line for line in done.stderr.splitlines() if not line.startswith("{")] == [
        f"site-agent: queue '{unprovisioned.queue}' does not exist on the broker (a site "
        "declares none): provision site 'site-2' first, e.g. `python deploy/broker_users.py "
        f"--namespace {agent.namespace} create site-2 --credentials FILE` creates its broker "
        "user and its queue"]


def test_sigkill_and_restart_readopt_live_client_jobs_and_report_dead_ones(
    site_agents: SiteAgents, blob_store: BlobStore, make_bus: Callable[..., RabbitBus]
) -> None:
    events = Events(make_bus)
    agent = site_agents.start(client_job_module=HOLDING_CJ)
    jobs = {"job-a": {"gpu": 1}, "job-b": {"gpu": 1}, "job-dead": {}}
    gpus = {}
    for job_id, requirement in jobs.items():
        gpus[job_id] = allocate(agent, job_id, requirement).get("gpu")
        deploy(agent, blob_store, job_id)
        start(agent, job_id)
    pids = {j: wait_for(lambda j=j: agent.report(j), what=j)["pid"] for j in jobs}

    agent.kill()  # SIGKILL: the client jobs, in their own process groups, live on
    os.killpg(pids["job-dead"], signal.SIGKILL)  # and one dies while its agent is down
    wait_for(lambda: not process.alive(pids["job-dead"], None), what="job-dead's process to go")
    status = agent.status()
    assert not status["agent"]["running"]
    by_id = {job["job_id"]: job for job in status["jobs"]}
    assert (by_id["job-a"]["state"], by_id["job-a"]["process_alive"]) == ("RUNNING", True)
    assert (by_id["job-dead"]["state"], by_id["job-dead"]["process_alive"]) == ("LOST", False)

    events.seen.clear()
    agent.launch()  # the restarted agent re-adopts the live client jobs, resources included
    assert all(process.alive(pids[j], None) for j in ("job-a", "job-b"))
    status = agent.status()
    assert status["agent"]["running"]
    assert {(j["job_id"], j["state"], json.dumps(j["allocation"])) for j in status["jobs"]} == {
        ("job-a", "RUNNING", json.dumps({"gpu": gpus["job-a"]})),
        ("job-b", "RUNNING", json.dumps({"gpu": gpus["job-b"]})),
        ("job-dead", "LOST", "null")}
    [dead] = wait_for(lambda: events.ended("site-1", "job-dead"), what="job-dead's notice")
    assert dead.exit_code == UNKNOWN_EXIT_CODE  # killed while not the agent's child: no word
    assert dead.reason.startswith("client job was gone when the site agent restarted: ")
    beat = wait_for(lambda: events.of("site.site-1.heartbeat"), what="a heartbeat")[-1][0]
    assert sorted(beat.running_job_ids) == ["job-a", "job-b"]
    assert struct_to_dict(beat.resources)["free"] == {"gpu": 0}
    assert events.of("site.site-1.online")
    refused = agent.call(site_pb2.CheckResourcesRequest(job_id="job-c",
                                                        requirement=dict_to_struct({"gpu": 1})),
                         site_pb2.CheckResourcesReply)
    assert not refused.ok and refused.reason == "gpu 1 > 0 free"  # both GPUs are still held
    assert start(agent, "job-a").pid == pids["job-a"]  # a redelivered start: no second run

    os.killpg(pids["job-b"], signal.SIGTERM)  # a re-adopted client job ends on its own
    [ended] = wait_for(lambda: events.ended("site-1", "job-b"), what="job-b's notice")
    assert ended.exit_code == UNKNOWN_EXIT_CODE and "exit code unknown" in ended.reason
    assert agent.job("job-b").state == "FINISHED"
    assert allocate(agent, "job-c", {"gpu": 1}) == {"gpu": gpus["job-b"]}  # its GPU came back

    aborted = agent.call(site_pb2.AbortRequest(job_id="job-a", reason="admin"),
                         site_pb2.SiteJob)  # abort of a re-adopted job: its process group
    assert (aborted.state, aborted.HasField("allocation")) == ("ABORTED", False)
    assert not process.alive(pids["job-a"], None)
    [notice] = wait_for(lambda: events.ended("site-1", "job-a"), what="job-a's notice")
    assert notice.reason.endswith("(aborted: admin)")
    assert start(agent, "job-dead").state == "LOST"  # a late start does not revive it


def test_status_text_and_json(tmp_path: Path, bus_settings: Settings) -> None:
    site_dir = write_site(tmp_path / "s", site="s1",
                          broker_url=with_user(bus_settings.amqp_url,
                                               Names(bus_settings.namespace).site_user("s1"),
                                               "secret"),
                          namespace=bus_settings.namespace,
                          storage_url="http://127.0.0.1:9000/bucket", org="Org")
    text = run_cli("status", "--site-dir", str(site_dir))
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[:3] == [
        "site s1 (Org)", "agent: not running", "last server contact: never"]
    assert "no jobs" in text.stdout
    as_json = json.loads(run_cli("status", "--site-dir", str(site_dir), "--json").stdout)
    assert as_json == {"site": "s1", "org": "Org", "workspace": str(site_dir / "workspace"),
                       "agent": {"running": False, "pid": 0}, "last_server_contact_ms": None,
                       "jobs": []}
    missing = run_cli("status", "--site-dir", str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert "local/site.json: file not found" in missing.stderr
