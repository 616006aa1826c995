"""The site agent as a real process on the real broker: its control-queue commands, deploys from
S3 through presigned URLs, client jobs, resources, and the ended notice of every client job.

Every test runs twice: against `fedhive-site-agent run` and against a light-site host of the
same site (`fedhive-site-agent host`: client jobs as threads), but for what only a process can
do (survive SIGTERM, be killed by a signal)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable

import pytest

from fedhive.blobs import BlobStore
from fedhive.bus import RabbitBus
from fedhive.config import Settings
from fedhive.errors import (
    BlobAccessDenied,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    RpcTimeout,
)
from fedhive.names import Names
from fedhive.proto.v1 import site_pb2
from fedhive.structs import dict_to_struct
from tests.fixtures.infra import wait_for
from tests.fixtures.site_agent import (
    CLIENT_APP,
    HOLDING_CJ,
    Events,
    SiteAgents,
    allocate,
    app_bundle,
    deploy,
    end_runs,
    start,
    upload,
)


@pytest.fixture
def site_agents(light_sites: SiteAgents) -> SiteAgents:
    return light_sites


def process_only(site_agents: SiteAgents) -> None:
    if site_agents.light:
        pytest.skip("a light site's client job is a thread: no signal reaches it alone")


def test_check_allocate_deploy_start_finish_free(
    site_agents: SiteAgents, blob_store: BlobStore, make_bus: Callable[..., RabbitBus]
) -> None:
    events = Events(make_bus)
    agent = site_agents.start()
    assert allocate(agent, "job-1", {"gpu": 1}) == {"gpu": [0]}

    deployed = deploy(agent, blob_store, "job-1")
    assert (deployed.state, deployed.app_name) == ("DEPLOYED", "app")
    assert (agent.workspace / "job-1" / "config" / "config_fed_client.json").is_file()
    again = deploy(agent, blob_store, "job-1")  # a redelivered deploy is a no-op
    assert again.state == "DEPLOYED"

    end_runs(make_bus(name="server-job"), agent.namespace, "job-1", "site-1")
    started = start(agent, "job-1")
    assert started.state == "RUNNING"
    # The real client job reports itself: env from the consumer, cwd, broker identity.
    report = wait_for(lambda: agent.report("job-1"), what="the client job's report")
    assert report["resource_env"] == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                      "CUDA_VISIBLE_DEVICES": "0"}
    assert report["cwd"] == str(agent.workspace / "job-1")
    if agent.light:  # a thread of the host
        assert started.pid == 0 and agent.proc is not None and report["pid"] == agent.proc.pid
    else:
        assert started.pid > 0 and report["pid"] == report["process_group"] == started.pid
    beats = wait_for(lambda: events.of("site.site-1.job"), what="the job heartbeat")
    beat, user = beats[0]
    assert isinstance(beat, site_pb2.JobHeartbeat)
    assert (beat.job_id, beat.site, user) == ("job-1", "site-1",
                                              Names(agent.namespace).site_user("site-1"))

    finished = wait_for(lambda: (j := agent.job("job-1")) and j.state == "FINISHED" and j,
                        what="job-1 FINISHED")
    assert finished.exit_code == 0
    assert not finished.HasField("allocation")  # freed when the client job exited
    [ended] = wait_for(lambda: events.ended("site-1", "job-1"), what="the ended notice")
    assert (ended.exit_code, ended.reason) == (0, "the server job ended the run")
    assert start(agent, "job-1").state == "FINISHED"  # a late redelivered start: no second run
    assert agent.report("job-1") == report
    freed = agent.call(site_pb2.FreeResourcesRequest(job_id="job-1"), site_pb2.SiteJob)
    assert freed.state == "FINISHED"
    assert allocate(agent, "job-2", {"gpu": 2}) == {"gpu": [0, 1]}  # everything is free again

    status = agent.status()
    assert status["site"] == "site-1" and status["agent"]["running"]
    assert status["last_server_contact_ms"] > 0
    states = {job["job_id"]: (job["state"], job["allocation"]) for job in status["jobs"]}
    assert states == {"job-1": ("FINISHED", None), "job-2": ("ALLOCATED", {"gpu": [0, 1]})}


def test_abort_running_job_then_free(site_agents: SiteAgents, blob_store: BlobStore) -> None:
    agent = site_agents.start(client_job_module=HOLDING_CJ)
    allocate(agent, "job-1", {"gpu": 1})
    deploy(agent, blob_store, "job-1")
    started = start(agent, "job-1")
    wait_for(lambda: agent.report("job-1"), what="the client job's report")
    assert start(agent, "job-1").pid == started.pid  # a redelivered start does not start twice
    with pytest.raises(FailedPrecondition, match="job-1 is running on site site-1"):
        agent.call(site_pb2.FreeResourcesRequest(job_id="job-1"), site_pb2.SiteJob)

    aborted = agent.call(site_pb2.AbortRequest(job_id="job-1", reason="admin"), site_pb2.SiteJob)
    assert (aborted.state, aborted.reason) == ("ABORTED", "admin")
    assert not aborted.HasField("allocation")
    job = wait_for(lambda: (j := agent.job("job-1")) and j.HasField("exit_code") and j,
                   what="the aborted client job's exit")
    assert job.exit_code == -15  # SIGTERM was enough
    again = agent.call(site_pb2.AbortRequest(job_id="job-1"), site_pb2.SiteJob)
    assert again.state == "ABORTED"  # abort twice is fine
    agent.call(site_pb2.FreeResourcesRequest(job_id="job-1"), site_pb2.SiteJob)  # and free
    assert allocate(agent, "job-2", {"gpu": 2}) == {"gpu": [0, 1]}
    with pytest.raises(NotFound, match="job nope is not known on site site-1"):
        agent.call(site_pb2.AbortRequest(job_id="nope"), site_pb2.SiteJob)


def test_abort_kills_a_job_that_ignores_sigterm(
    site_agents: SiteAgents, blob_store: BlobStore
) -> None:
    process_only(site_agents)
    agent = site_agents.start(client_job_module=HOLDING_CJ, abort_grace_s=0.5)
    allocate(agent, "job-1", {})
    deploy(agent, blob_store, "job-1", {**CLIENT_APP, "hold.json": '{"ignore_sigterm": true}'})
    start(agent, "job-1")
    wait_for(lambda: agent.report("job-1"), what="the client job's report")
    agent.call(site_pb2.AbortRequest(job_id="job-1"), site_pb2.SiteJob)
    job = wait_for(lambda: (j := agent.job("job-1")) and j.HasField("exit_code") and j,
                   what="the client job's exit")
    assert (job.state, job.exit_code) == ("ABORTED", -9)


def test_concurrent_jobs_never_share_a_gpu(
    site_agents: SiteAgents, blob_store: BlobStore
) -> None:
    agent = site_agents.start(client_job_module=HOLDING_CJ)
    for job_id in ("job-a", "job-b"):
        allocate(agent, job_id, {"gpu": 1})
        deploy(agent, blob_store, job_id)
        start(agent, job_id)
    reports = [wait_for(lambda j=j: agent.report(j), what=j) for j in ("job-a", "job-b")]
    devices = sorted(r["resource_env"]["CUDA_VISIBLE_DEVICES"] for r in reports)
    assert devices == ["0", "1"]
    third = agent.call(site_pb2.CheckResourcesRequest(job_id="job-c",
                                                      requirement=dict_to_struct({"gpu": 1})),
                       site_pb2.CheckResourcesReply)
    assert not third.ok and third.reason == "gpu 1 > 0 free"
    bad = agent.call(site_pb2.CheckResourcesRequest(job_id="job-c",
                                                    requirement=dict_to_struct({"gpu": -1})),
                     site_pb2.CheckResourcesReply)
    assert not bad.ok and "gpu" in bad.reason
    running = {j["job_id"] for j in agent.status()["jobs"] if j["state"] == "RUNNING"}
    assert running == {"job-a", "job-b"}


def test_expired_url_is_refused(site_agents: SiteAgents, blob_store: BlobStore) -> None:
    agent = site_agents.start()
    allocate(agent, "job-1", {})
    url, expires = upload(blob_store, agent.namespace, "job-1", app_bundle(CLIENT_APP),
                          expires_in=1)
    wait_for(lambda: time.time() * 1000 > expires + 1500, what="the URL to expire")
    request = site_pb2.DeployRequest(job_id="job-1", app_name="app", bundle_url=url)
    # Without the expiry in the request, S3 itself refuses the expired URL.
    with pytest.raises(BlobAccessDenied, match=r"job-1.*expired"):
        agent.call(request, site_pb2.SiteJob)
    request.bundle_url_expires_at_ms = expires  # with it, the agent refuses before asking
    with pytest.raises(BlobAccessDenied, match="deploy of job job-1: the bundle URL expired"):
        agent.call(request, site_pb2.SiteJob)
    assert not (agent.workspace / "job-1").exists()


def test_unsafe_bundle_is_refused_and_nothing_is_extracted(
    site_agents: SiteAgents, blob_store: BlobStore
) -> None:
    agent = site_agents.start()
    allocate(agent, "job-1", {})
    with pytest.raises(InvalidArgument) as refused:
        deploy(agent, blob_store, "job-1", {**CLIENT_APP, "../escape.txt": "x",
                                            "/etc/evil": "y"})
    message = str(refused.value)
    assert "the bundle of job job-1: member '../escape.txt': '..' in path" in message
    assert "member '/etc/evil': absolute path" in message
    assert sorted(p.name for p in agent.workspace.iterdir()) == [".agent"]
    assert not (agent.site_dir / "escape.txt").exists()
    job = agent.job("job-1")
    assert job is not None and (job.state, job.app_name) == ("ALLOCATED", "")


def test_start_of_a_job_never_deployed_is_refused(site_agents: SiteAgents) -> None:
    agent = site_agents.start()
    with pytest.raises(FailedPrecondition, match="job job-9 was never deployed to site site-1"):
        start(agent, "job-9")
    allocate(agent, "job-9", {"gpu": 1})  # allocated but still not deployed
    with pytest.raises(FailedPrecondition, match="never deployed"):
        start(agent, "job-9")
    with pytest.raises(InvalidArgument, match=r"invalid job id '\.\./x'"):
        start(agent, "../x")


def test_redelivered_check_reserves_once(site_agents: SiteAgents) -> None:
    agent = site_agents.start()
    request = site_pb2.CheckResourcesRequest(job_id="job-1", requirement=dict_to_struct({"gpu": 1}))
    # The same command delivered twice (same message id): one reservation, not two.
    for _ in range(2):
        site_agents.bus.send(agent.queue, request, message_id="check-1")
    wait_for(lambda: "site_agent.check_redelivered" in agent.log(), what="the second delivery")
    assert agent.call(request, site_pb2.CheckResourcesReply).ok  # the second GPU is still free
    last = agent.call(request, site_pb2.CheckResourcesReply)
    assert not last.ok and last.reason == "gpu 1 > 0 free"
    assert agent.status()["jobs"] == []  # a check alone creates no job


def test_only_bundles_of_jobs_allocated_here_from_the_deployments_store_are_deployed(
    site_agents: SiteAgents, blob_store: BlobStore
) -> None:
    agent = site_agents.start()
    url, expires = upload(blob_store, agent.namespace, "job-1", app_bundle(CLIENT_APP))
    request = site_pb2.DeployRequest(job_id="job-1", app_name="app", bundle_url=url,
                                     bundle_url_expires_at_ms=expires)
    with pytest.raises(FailedPrecondition, match="job job-1 holds no resources on site site-1"):
        agent.call(request, site_pb2.SiteJob)
    allocate(agent, "job-1", {})
    other, _ = upload(blob_store, agent.namespace, "job-2", app_bundle(CLIENT_APP))
    elsewhere = url.replace("127.0.0.1", "localhost", 1)
    for bad in (other,  # another job's bundle, from the right store
                elsewhere,  # the right object, at another address
                url.replace("/app.zip", "/app2.zip"),  # another app of the job
                "http://evil.example/job-1/bundles/app.zip"):
        refused = site_pb2.DeployRequest(job_id="job-1", app_name="app", bundle_url=bad,
                                         bundle_url_expires_at_ms=expires)
        with pytest.raises(PermissionDenied, match="the bundle URL is not the deployment's "
                                                   "object"):
            agent.call(refused, site_pb2.SiteJob)
    assert sorted(p.name for p in agent.workspace.iterdir()) == [".agent"]
    assert agent.call(request, site_pb2.SiteJob).state == "DEPLOYED"


def test_commands_from_any_user_but_the_services_are_refused(
    site_agents: SiteAgents, rogue_settings: Settings
) -> None:
    """A broker user allowed everywhere (a misconfigured broker), not the services' user: the
    agent refuses its commands and logs a security event."""
    agent = site_agents.start()
    rogue = RabbitBus(rogue_settings, name="rogue")
    direct = RabbitBus(rogue_settings, name="rogue-direct", site=True)  # direct reply-to
    try:
        with pytest.raises(PermissionDenied, match="does not accept messages from broker user"):
            rogue.call(agent.queue, site_pb2.ListSiteJobsRequest(), site_pb2.ListSiteJobsReply,
                       timeout=10)
        with pytest.raises(RpcTimeout):  # a site may not publish to direct reply-to: no answer
            direct.call(agent.queue, site_pb2.ListSiteJobsRequest(), site_pb2.ListSiteJobsReply,
                        timeout=3)
    finally:
        rogue.close()
        direct.close()
    wait_for(lambda: agent.log().count('"bus.sender_refused"') == 2,
             what="the security log lines")
    assert agent.job("job-1") is None  # and the agent still serves the services


def test_a_client_job_that_fails_at_once_is_reported_ended(
    site_agents: SiteAgents, blob_store: BlobStore, make_bus: Callable[..., RabbitBus]
) -> None:
    events = Events(make_bus)
    agent = site_agents.start()
    allocate(agent, "job-1", {"gpu": 1})
    deploy(agent, blob_store, "job-1", {"config/config_fed_client.json": json.dumps({
        "executors": [{"tasks": ["train"], "executor": {"id": "trainer",
                                                        "path": "nowhere.Trainer"}}]})})
    end_runs(make_bus(name="server-job"), agent.namespace, "job-1", "site-1")
    start(agent, "job-1")
    [notice] = wait_for(lambda: events.ended("site-1", "job-1"), timeout=30,
                        what="the ended notice")
    assert notice.exit_code == 1
    assert "component 'trainer': cannot import 'nowhere.Trainer'" in notice.reason
    assert "\n" not in notice.reason and notice.sent_at_ms > 0
    job = wait_for(lambda: (j := agent.job("job-1")) and j.HasField("exit_code") and j,
                   what="the record of its end")
    assert (job.state, job.exit_code) == ("FINISHED", 1)
    assert not job.HasField("allocation")


def test_a_client_job_killed_by_sigkill_is_reported_ended(
    site_agents: SiteAgents, blob_store: BlobStore, make_bus: Callable[..., RabbitBus]
) -> None:
    process_only(site_agents)
    events = Events(make_bus)
    agent = site_agents.start(client_job_module=HOLDING_CJ)
    allocate(agent, "job-1", {"gpu": 1})
    deploy(agent, blob_store, "job-1")
    start(agent, "job-1")
    pid = wait_for(lambda: agent.report("job-1"), what="the client job's report")["pid"]
    os.kill(pid, signal.SIGKILL)  # as the OOM killer would
    [notice] = wait_for(lambda: events.ended("site-1", "job-1"), what="the ended notice")
    assert (notice.site, notice.exit_code) == ("site-1", -9)
    assert notice.reason == "killed by signal 9 (SIGKILL: the OOM killer, or killed by hand?)"
    assert agent.job("job-1").state == "FINISHED"
    assert allocate(agent, "job-2", {"gpu": 2}) == {"gpu": [0, 1]}  # its GPU was freed


def test_an_ended_notice_the_broker_refused_is_published_later(
    site_agents: SiteAgents, blob_store: BlobStore, make_bus: Callable[..., RabbitBus]
) -> None:
    process_only(site_agents)
    events = Events(make_bus)
    agent = site_agents.start(client_job_module=HOLDING_CJ)
    allocate(agent, "job-1", {})
    deploy(agent, blob_store, "job-1")
    start(agent, "job-1")
    pid = wait_for(lambda: agent.report("job-1"), what="the client job's report")["pid"]
    record_file = agent.workspace / ".agent" / "jobs" / "job-1.json"
    site_agents.refuse_events("site-1", "job", refused=True)
    try:
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: '"site_agent.notice_failed"' in agent.log(), timeout=30,
                 what="the broker refusing the notice")
        record = json.loads(record_file.read_text())
        assert (record["exit_code"], record["notice_pending"]) == (-9, True)
        assert events.ended("site-1", "job-1") == []
    finally:
        site_agents.refuse_events("site-1", "job", refused=False)
    [notice] = wait_for(lambda: events.ended("site-1", "job-1"), timeout=60,
                        what="the notice, published again")
    assert (notice.exit_code, notice.reason.split(" (")[0]) == (-9, "killed by signal 9")
    wait_for(lambda: not json.loads(record_file.read_text())["notice_pending"],
             what="the notice recorded as published")
