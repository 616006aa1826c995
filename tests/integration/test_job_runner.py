"""The job-runner with real services: job-store, site agents, the runner and its server jobs.

The scheduler's part is played by `tests.fixtures.job_runner.dispatch` (reserve on the agents,
SUBMITTED -> DISPATCHED, `DispatchJob` to the runner's queue).
"""

from __future__ import annotations

import io
import json
import os
import signal
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from fedhive.blobs import S3BlobStore
from fedhive.bus import RabbitBus
from fedhive.config import Settings
from fedhive.errors import FailedPrecondition
from fedhive.jobs.record import JobRecord
from fedhive.jobs.serde import status_to_proto
from fedhive.jobs.status import JobStatus
from fedhive.names import Names
from fedhive.proto.v1 import admin_pb2, job_pb2, jobstore_pb2, runner_pb2
from fedhive.state import RedisStateStore
from fedhive.state.port import JobUpdate
from fedhive.state.runs import RunTable
from tests.fixtures.infra import wait_for
from tests.fixtures.job_runner import (
    RunnerProcess,
    Runners,
    dispatch,
    flow,
    flow_job,
    reserve,
    send_dispatch,
)
from tests.fixtures.job_store import JobStoreProcess, stage
from tests.fixtures.site_agent import (
    HOLDING_CJ,
    SiteAgentProcess,
    SiteAgents,
    allocate,
    deploy,
    start,
)

S = JobStatus
ALICE = job_pb2.Submitter(name="alice@example.com", org="org-a", role="project_admin")


@dataclass
class Stack:
    store: JobStoreProcess
    runner: RunnerProcess
    agents: list[SiteAgentProcess]
    bus: RabbitBus
    state: RedisStateStore
    blobs: S3BlobStore
    names: Names

    def submit(self, data: bytes) -> str:
        reply = self.bus.call(self.store.queue, jobstore_pb2.StoreSubmitJob(
            staging_key=stage(self.blobs, self.names, data), submitter=ALICE),
            admin_pb2.SubmitJobReply, timeout=30)
        return reply.job_id

    def run(self, data: bytes, **options: Any) -> str:
        job_id = self.submit(data)
        dispatch(self.bus, self.state, self.agents, job_id, **options)
        return job_id

    def job(self, job_id: str) -> JobRecord:
        return self.state.get_job(job_id)

    def wait_status(self, job_id: str, status: JobStatus, timeout: float = 40) -> JobRecord:
        def reached() -> bool:
            current = self.job(job_id).status
            if current != status and current.is_final:
                raise AssertionError(f"{job_id} ended {current.value}: "
                                     f"{self.job(job_id).status_reason}\n{self.runner.log()}")
            return current == status

        wait_for(reached, timeout=timeout, what=f"job {job_id} to be {status.value}")
        return self.job(job_id)

    def abort(self, job_id: str) -> job_pb2.JobRecord:
        return self.bus.call(self.store.queue, admin_pb2.AbortJobRequest(job_id=job_id),
                             job_pb2.JobRecord, timeout=40)

    def result(self, record: JobRecord) -> dict[str, bytes]:
        with zipfile.ZipFile(io.BytesIO(self.blobs.get(record.result_key))) as archive:
            return {name: archive.read(name) for name in archive.namelist()}

    def freed(self, job_id: str) -> bool:
        jobs = [agent.job(job_id) for agent in self.agents
                if agent.proc is not None and agent.proc.poll() is None]
        return all(job is None or (job.state in ("FINISHED", "ABORTED") and not job.allocation)
                   for job in jobs)


def make_stack(job_runners: Runners, site_agents: SiteAgents,
               job_store_process: JobStoreProcess,
               job_store_client: RabbitBus, redis_state: RedisStateStore,
               job_store_blobs: S3BlobStore, sites: int, *runner_args: str,
               broker_urls: dict[str, str] | None = None) -> Stack:
    """`broker_urls`: site -> the agent's own broker credentials (default: the test's)."""
    runner = job_runners.start(*runner_args)
    agents = [site_agents.start(f"site-{n}", broker_url=(broker_urls or {}).get(f"site-{n}"))
              for n in range(1, sites + 1)]
    return Stack(job_store_process, runner, agents, job_store_client, redis_state,
                 job_store_blobs, Names(redis_state._names.ns))


@pytest.fixture
def stack_of(job_runners: Runners, site_agents: SiteAgents,
             job_store_process: JobStoreProcess,
             job_store_client: RabbitBus, redis_state: RedisStateStore,
             job_store_blobs: S3BlobStore) -> Callable[..., Stack]:
    def make(sites: int, *runner_args: str, broker_urls: dict[str, str] | None = None,
             ) -> Stack:
        return make_stack(job_runners, site_agents, job_store_process, job_store_client,
                          redis_state, job_store_blobs, sites, *runner_args,
                          broker_urls=broker_urls)

    return make


@pytest.fixture
def stack(stack_of: Callable[..., Stack]) -> Stack:
    return stack_of(2)


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
    nope = stack.run(flow_job({"id": "trainer", "path": "flows.Nope", "args": {}}))
    record = stack.wait_status(nope, S.FINISHED_EXECUTION_EXCEPTION)
    assert "component 'trainer': cannot import 'flows.Nope'" in record.status_reason
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
    wait_for(lambda: _gone(entry.pid), timeout=10, what="the server job to be stopped")
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


def test_a_restarted_runner_reattaches_and_the_job_completes_once(stack: Stack) -> None:
    job_id = stack.submit(flow_job(flow("Hold")))
    command = dispatch(stack.bus, stack.state, stack.agents, job_id, message_id="once")
    stack.wait_status(job_id, S.RUNNING)
    stack.runner.kill()
    stack.runner.start()
    assert stack.runner.logged("job_runner.reattached") == 1
    # the same dispatch again: ignored, the job is not run twice (the kill may also have come
    # before the first runner's ack, so the original can be redelivered and ignored as well)
    stack.bus.send(stack.names.service_queue("job-runner"), command, message_id="again")
    wait_for(lambda: stack.runner.logged("job_runner.dispatch_ignored", message_id="again"),
             timeout=15, what="the repeated dispatch to be ignored")
    assert stack.runner.logged("job_runner.dispatch") == 1
    (stack.runner.workspace(job_id) / "go").write_text("")
    record = stack.wait_status(job_id, S.FINISHED_COMPLETED)
    assert stack.result(record)["model.txt"] == b"held"
    assert stack.result(record)["server_job.log"].count(b'"server_job.started"') == 1


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
    # the per-site sub-state outlives the run table
    assert RunTable(stack.state._client, stack.names).get(job_id) is None
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


def test_max_runtime_aborts_a_longer_job_and_a_bad_one_is_ignored(stack: Stack) -> None:
    job_id = stack.run(flow_job(flow("Hold"), max_runtime=1))
    record = stack.wait_status(job_id, S.FINISHED_ABORTED)
    assert record.status_reason == "max_runtime 1 s exceeded"
    wait_for(lambda: stack.freed(job_id), timeout=10, what="every site to be freed")
    bad = stack.run(flow_job(flow("Done"), max_runtime="soon"))
    stack.wait_status(bad, S.FINISHED_COMPLETED)
    assert stack.runner.logged("job_runner.max_runtime_ignored") == 1
    assert f'"job_id": "{bad}"' in stack.runner.log()


def test_a_site_that_goes_offline_is_gone_for_the_server_job(
    stack_of: Callable[..., Stack], site_users: Callable[..., dict[str, Settings]],
) -> None:
    users = site_users(["site-1", "site-2"])
    # client jobs report once: a long job TTL keeps that report, so only going offline counts
    stack = stack_of(2, "--job-ttl", "120",
                     broker_urls={site: s.amqp_url for site, s in users.items()})
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
    stack_of: Callable[..., Stack], site_users: Callable[..., dict[str, Settings]],
    site_agents: SiteAgents, job_store_blobs: S3BlobStore,
) -> None:
    users = site_users(["site-1"])
    stack = stack_of(0)
    agent = site_agents.start("site-1", broker_url=users["site-1"].amqp_url,
                              client_job_module=HOLDING_CJ)
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


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False
