"""The job-runner with real services: job-store, site agents, the runner and its server jobs.

The scheduler's part is played by `tests.fixtures.job_runner.dispatch` (reserve on the agents,
SUBMITTED -> DISPATCHED, `DispatchJob` to the runner's queue). The runner's identity, leases and
takeover: test_job_runner_leases.py.
"""

from __future__ import annotations

import io
import json
import os
import signal
import zipfile
from collections.abc import Callable
from typing import Any

import pytest

from fedhive.blobs import S3BlobStore
from fedhive.errors import FailedPrecondition
from fedhive.jobs.serde import status_to_proto
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import runner_pb2, site_pb2
from fedhive.state.port import JobUpdate
from fedhive.state.runs import RunTable
from tests.fixtures.bus import Broker
from tests.fixtures.infra import wait_for
from tests.fixtures.job_runner import (
    DYING_CJ,
    Stack,
    dispatch,
    flow,
    flow_job,
    group_gone,
    reserve,
    sag_job,
    send_dispatch,
)
from tests.fixtures.site_agent import (
    HOLDING_CJ,
    SiteAgentProcess,
    SiteAgents,
    allocate,
    deploy,
    start,
)

S = JobStatus


def test_a_completing_workflow_finishes_the_job_with_its_result(stack: Stack) -> None:
    job_id = stack.submit(flow_job(flow("Done", message="trained")))
    command = dispatch(stack.bus, stack.state, stack.agents, job_id)
    record = stack.wait_status(job_id, S.FINISHED_COMPLETED)
    assert record.status_reason == "server job completed"
    assert record.sites == ["site-1", "site-2"] and record.failed_sites == []
    assert [c.to_status for c in record.history] == [
        S.SUBMITTED, S.DISPATCHED, S.RUNNING, S.FINISHED_COMPLETED]
    assert record.result_key == stack.names.job_result_key(job_id)
    result = stack.result(record)
    assert result["model.txt"] == b"trained" and b"server_job.started" in result["server_job.log"]
    wait_for(lambda: stack.freed(job_id), timeout=10, what="every site to be freed")
    assert RunTable(stack.state._client, stack.names).get(job_id) is None
    # the same command again for the finished job: ignored, nothing changes
    stack.bus.send(stack.names.service_queue("job-runner"), command)
    wait_for(lambda: stack.runner.logged("job_runner.dispatch_ignored") == 1, timeout=15,
             what="the repeated dispatch to be ignored")
    with pytest.raises(FailedPrecondition, match=f"job {job_id} is already done"):
        stack.abort(job_id)
    assert stack.job(job_id).history == record.history


def test_a_raising_workflow_or_a_bad_component_is_an_execution_exception(stack: Stack) -> None:
    boom = stack.run(flow_job(flow("Boom")))
    record = stack.wait_status(boom, S.FINISHED_EXECUTION_EXCEPTION)
    assert record.status_reason == "RuntimeError: boom in the workflow"
    # a module that is not in the job's custom/ could be a site-installed library: only the
    # server job's import finds it missing (a class missing from custom/ is refused at submit)
    nope = stack.run(flow_job({"id": "trainer", "path": "not_installed.Nope", "args": {}}))
    record = stack.wait_status(nope, S.FINISHED_EXECUTION_EXCEPTION)
    assert "component 'trainer': cannot import 'not_installed.Nope'" in record.status_reason
    wait_for(lambda: stack.freed(boom) and stack.freed(nope), timeout=10, what="sites freed")


def stored(archive: bytes) -> bytes:
    """The same zip with its members stored uncompressed (as some zip tools write them)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as source, \
            zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dest:
        for name in source.namelist():
            dest.writestr(name, source.read(name))
    return out.getvalue()


def test_a_compressible_job_runs_and_an_unreadable_one_fails_to_run(stack: Stack) -> None:
    # 2 MiB of zeros: the job-store's deflated copy compresses ~1000x, past the upload's ratio
    # limit, and must still deploy
    zeros = flow("Done", message="0" * (2 * 1024 * 1024))
    job_id = stack.run(stored(flow_job(zeros)))
    assert stack.wait_status(job_id, S.FINISHED_COMPLETED).status_reason == "server job completed"

    broken = stack.submit(flow_job(flow("Done")))
    stack.blobs.put(stack.names.job_definition_key(broken), b"not a zip")
    dispatch(stack.bus, stack.state, stack.agents, broken)
    record = stack.wait_status(broken, S.FINISHED_FAILED_TO_RUN)
    assert record.status_reason.startswith("the stored job definition cannot be loaded: ")
    wait_for(lambda: stack.freed(job_id) and stack.freed(broken), timeout=10,
             what="sites freed")


def test_a_killed_server_job_is_abnormal(stack: Stack) -> None:
    job_id = stack.run(flow_job(flow("Hold")))
    stack.wait_status(job_id, S.RUNNING)
    entry = RunTable(stack.state._client, stack.names).get(job_id)
    assert entry is not None and entry.pid > 0
    os.killpg(entry.pid, signal.SIGKILL)
    record = stack.wait_status(job_id, S.FINISHED_ABNORMAL)
    assert record.status_reason == "server job ended without reporting: killed by signal SIGKILL"
    wait_for(lambda: stack.freed(job_id), timeout=10, what="every site to be freed")


def test_abort_of_a_running_job_stops_everything(stack: Stack) -> None:
    job_id = stack.run(flow_job(flow("Hold")))
    stack.wait_status(job_id, S.RUNNING)
    entry = RunTable(stack.state._client, stack.names).get(job_id)
    assert entry is not None
    reply = stack.abort(job_id)
    assert reply.history[-1].to_status == status_to_proto(S.FINISHED_ABORTED)
    wait_for(lambda: stack.freed(job_id), timeout=15, what="every site to be freed")
    wait_for(lambda: group_gone(entry.pid), timeout=10, what="the server job to be stopped")
    assert stack.job(job_id).status == S.FINISHED_ABORTED
    # the result is stored after the sites are freed (the runner zips the workspace last)
    wait_for(lambda: stack.job(job_id).result_key, timeout=15, what="the job's result")
    assert "server_job.log" in stack.result(stack.job(job_id))


def test_a_job_aborted_while_dispatched_never_starts(stack: Stack) -> None:
    job_id = stack.submit(flow_job(flow("Done")))
    stack.state.change_status(job_id, S.SUBMITTED, S.DISPATCHED, "test dispatch")
    reply = stack.abort(job_id)
    assert reply.history[-1].to_status == status_to_proto(S.FINISHED_ABORTED)
    # the dispatch command arrives late: ignored, its reservations cancelled
    late = stack.bus.send(stack.names.service_queue("job-runner"), runner_pb2.DispatchJob(
        job_id=job_id, sites=reserve(stack.agents, job_id)))
    wait_for(lambda: stack.runner.logged("job_runner.dispatch_ignored") == 1, timeout=15,
             what="the late dispatch to be ignored")
    assert stack.job(job_id).status == S.FINISHED_ABORTED
    assert all(agent.job(job_id) is None for agent in stack.agents), late


def test_a_deploy_timeout_leaves_the_job_running_on_the_others(
    stack_of: Callable[..., Stack],
) -> None:
    stack = stack_of(3)
    job_id = stack.submit(flow_job(flow("Done"), sites=("site-1", "site-2", "site-3"),
                                   min_clients=2))
    strict = stack.submit(flow_job(flow("Done"), sites=("site-1", "site-2", "site-3")))
    reserved = {job: reserve(stack.agents, job) for job in (job_id, strict)}
    stack.agents[2].kill()  # site-3 said yes, then stops answering
    send_dispatch(stack.bus, stack.state, job_id, reserved[job_id])
    record = stack.wait_status(job_id, S.FINISHED_COMPLETED)
    assert record.sites == ["site-1", "site-2"] and record.failed_sites == ["site-3"]
    send_dispatch(stack.bus, stack.state, strict, reserved[strict])
    record = stack.wait_status(strict, S.FINISHED_FAILED_TO_RUN)
    assert record.status_reason == ("deploy failed: site-3: no reply (allocation timeout); "
                                    "num_ok_sites 2 < required_min_sites 3")
    wait_for(lambda: stack.freed(job_id) and stack.freed(strict), timeout=10,
             what="sites freed")


def test_a_lost_dispatch_command_is_issued_again_and_the_job_runs(
    stack_of: Callable[..., Stack],
) -> None:
    stack = stack_of(2, "--orphan-grace", "1")
    job_id = stack.submit(flow_job(flow("Done")))
    sites = reserve(stack.agents, job_id)
    stack.state.change_status(  # what the scheduler does, but its DispatchJob never arrives
        job_id, S.SUBMITTED, S.DISPATCHED, "scheduled",
        update=JobUpdate(sites=[s.site for s in sites],
                         reservations={s.site: s.token for s in sites}))
    record = stack.wait_status(job_id, S.FINISHED_COMPLETED)
    assert record.sites == ["site-1", "site-2"] and record.failed_sites == []
    assert stack.runner.logged("job_runner.redispatch") == 1
    # the per-site sub-state outlives the run table (the runner forgets the job right after
    # writing its final status)
    wait_for(lambda: RunTable(stack.state._client, stack.names).get(job_id) is None,
             timeout=10, what="the runner to forget the job")
    assert set(record.site_states) == {"site-1", "site-2"}
    for state in record.site_states.values():
        assert state["allocated"] and state["deployed"] and state["started"]
        assert state["excluded"] == "" and state["gone"] == ""


def test_a_runner_killed_mid_dispatch_is_resumed_and_the_job_runs_once(
    stack_of: Callable[..., Stack],
) -> None:
    stack = stack_of(2, "--sync-timeout", "5")
    job_id = stack.submit(flow_job(flow("Done")))
    sites = reserve(stack.agents, job_id)
    slow = stack.agents[1].proc
    assert slow is not None
    os.kill(slow.pid, signal.SIGSTOP)  # site-2 answers nothing while the runner allocates
    try:
        send_dispatch(stack.bus, stack.state, job_id, sites)
        wait_for(lambda: _allocated(stack.agents[0], job_id), timeout=15,
                 what="site-1 to allocate")
        stack.runner.kill()  # waiting for site-2's allocation reply
    finally:
        os.kill(slow.pid, signal.SIGCONT)
    assert stack.job(job_id).status == S.DISPATCHED
    stack.runner.start()
    record = stack.wait_status(job_id, S.FINISHED_COMPLETED)
    assert record.sites == ["site-1", "site-2"] and record.failed_sites == []
    assert stack.runner.logged("job_runner.dispatch_resumed") == 1
    assert stack.runner.logged("job_runner.server_job_launched") == 1
    assert stack.result(record)["server_job.log"].count(b'"server_job.started"') == 1
    wait_for(lambda: stack.freed(job_id), timeout=10, what="every site to be freed")


def test_max_runtime_aborts_a_longer_job(stack: Stack) -> None:
    job_id = stack.run(flow_job(flow("Hold"), max_runtime=1))
    record = stack.wait_status(job_id, S.FINISHED_ABORTED)
    assert record.status_reason == "max_runtime 1 s exceeded"
    wait_for(lambda: stack.freed(job_id), timeout=10, what="every site to be freed")


def test_a_site_that_goes_offline_is_gone_for_the_server_job(
    stack_of: Callable[..., Stack],
) -> None:
    # client jobs report once: a long job TTL keeps that report, so only going offline counts
    stack = stack_of(2, "--job-ttl", "120")
    wait_for(lambda: set(stack.state.online_sites()) == {"site-1", "site-2"}, timeout=15,
             what="both sites online")
    job_id = stack.run(flow_job(flow("Watch")))
    stack.wait_status(job_id, S.RUNNING)
    wait_for(lambda: all(s["last_heartbeat_ms"] for s in stack.job(job_id).site_states.values()),
             timeout=15, what="both client jobs' heartbeats")
    stack.agents[1].kill()
    record = stack.wait_status(job_id, S.FINISHED_COMPLETED)
    assert json.loads(stack.result(record)["gone.json"]) == {"site-2": "site went offline"}
    assert record.site_states["site-2"]["gone"] == "site went offline"
    assert record.site_states["site-1"]["gone"] == "" and record.failed_sites == ["site-2"]


def test_a_site_running_a_job_it_should_not_is_told_to_abort(
    stack_of: Callable[..., Stack], site_agents: SiteAgents, job_store_blobs: S3BlobStore,
) -> None:
    stack = stack_of(0)
    agent = site_agents.start("site-1", client_job_module=HOLDING_CJ)
    allocate(agent, "ghost", {})
    deploy(agent, job_store_blobs, "ghost")
    start(agent, "ghost")  # a job fedhive never had, running on the site
    wait_for(lambda: _state(agent, "ghost") == "ABORTED", timeout=20,
             what="the site to abort the stray job")
    assert stack.runner.logged("job_runner.stray_job") == 1


def _allocated(agent: SiteAgentProcess, job_id: str) -> bool:
    job = agent.job(job_id)
    return job is not None and job.state == "ALLOCATED"


def _state(agent: SiteAgentProcess, job_id: str) -> str:
    job = agent.job(job_id)
    return "" if job is None else job.state


def test_a_client_job_dead_before_its_first_beat_leaves_the_job_to_its_minimums(
    stack_of: Callable[..., Stack], site_agents: SiteAgents,
) -> None:
    stack = stack_of(1)
    stack.agents.append(site_agents.start("site-2", client_job_module=DYING_CJ))
    # one site is enough: the round carries on without site-2 (it would wait 600 s for it)
    carry_on = stack.run(sag_job(min_clients=1, wait_s=600))
    record = stack.wait_status(carry_on, S.FINISHED_COMPLETED, timeout=60)
    gone = record.site_states["site-2"]["gone"]
    assert gone.startswith("client job exited with code 1: "), gone
    assert "cannot log in to the broker" in gone
    assert record.failed_sites == ["site-2"] and record.site_states["site-1"]["gone"] == ""
    wait_for(lambda: stack.freed(carry_on), timeout=15, what="every site to be freed")
    # both sites needed: the workflow fails the job
    strict = stack.run(sag_job(min_clients=2, wait_s=600))
    record = stack.wait_status(strict, S.FINISHED_EXECUTION_EXCEPTION, timeout=60)
    assert "min_clients is 2" in record.status_reason \
        or "fewer than min_clients (2)" in record.status_reason, record.status_reason
    assert record.site_states["site-2"]["gone"].startswith("client job exited with code 1: ")
    wait_for(lambda: stack.freed(strict), timeout=15, what="every site to be freed")


def test_a_lost_ended_notice_is_made_up_for_by_the_sites_heartbeat(
    stack_of: Callable[..., Stack], site_agents: SiteAgents, broker: Broker,
) -> None:
    stack = stack_of(1)
    holder = site_agents.start("site-2", client_job_module=HOLDING_CJ)  # reports, never works
    stack.agents.append(holder)
    job_id = stack.run(sag_job(min_clients=1, wait_s=600))
    stack.wait_status(job_id, S.RUNNING)
    wait_for(lambda: holder.report(job_id), timeout=15, what="site-2's client job to report")
    stack.runner.kill()
    job = holder.job(job_id)
    assert job is not None and job.pid
    os.killpg(job.pid, signal.SIGKILL)  # the OOM killer, say
    # its site agent's ended notice is lost: the test takes it off the runners' queue
    queue = stack.names.events_queue("heartbeats")
    wait_for(lambda: any(_ended(props, body, "site-2") for props, body in broker.drain(queue)),
             timeout=20, what="site-2's ended notice")
    stack.runner.start()
    record = stack.wait_status(job_id, S.FINISHED_COMPLETED, timeout=60)
    assert record.site_states["site-2"]["gone"] == "client job is no longer running at the site"
    assert record.failed_sites == ["site-2"]
    wait_for(lambda: stack.freed(job_id), timeout=15, what="every site to be freed")


def _ended(props: Any, body: bytes, site: str) -> bool:
    if props.type != "fedhive.v1.JobHeartbeat":
        return False
    beat = site_pb2.JobHeartbeat.FromString(body)
    return beat.ended and beat.site == site


