"""The job-runner with real services: job-store, site agents, the runner and its server jobs.

The scheduler's part is played by `tests.fixtures.job_runner.dispatch` (reserve on the agents,
SUBMITTED -> DISPATCHED, `DispatchJob` to the runner's queue).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pika
import pytest

from fedhive.blobs import S3BlobStore
from fedhive.bus import RabbitBus
from fedhive.config import Settings
from fedhive.errors import FailedPrecondition
from fedhive.jobs.record import JobRecord
from fedhive.jobs.serde import status_to_proto
from fedhive.jobs.status import JobStatus
from fedhive.names import Names
from fedhive.proto.v1 import admin_pb2, job_pb2, jobstore_pb2, runner_pb2, site_pb2
from fedhive.state import RedisStateStore
from fedhive.state.port import JobUpdate
from fedhive.state.runs import RunTable
from tests.fixtures.bus import Broker
from tests.fixtures.infra import wait_for
from tests.fixtures.job_runner import (
    DYING_CJ,
    RunnerProcess,
    Runners,
    dispatch,
    flow,
    flow_job,
    reserve,
    sag_job,
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
from tests.fixtures.tcp_proxy import TcpProxy

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
               runner_settings: Settings | None = None) -> Stack:
    """`runner_settings`: the runner's own (default: the test's)."""
    runner = job_runners.start(*runner_args, settings=runner_settings)
    agents = [site_agents.start(f"site-{n}") for n in range(1, sites + 1)]
    return Stack(job_store_process, runner, agents, job_store_client, redis_state,
                 job_store_blobs, Names(redis_state._names.ns))


@pytest.fixture
def stack_of(job_runners: Runners, site_agents: SiteAgents,
             job_store_process: JobStoreProcess,
             job_store_client: RabbitBus, redis_state: RedisStateStore,
             job_store_blobs: S3BlobStore) -> Callable[..., Stack]:
    def make(sites: int, *runner_args: str, runner_settings: Settings | None = None) -> Stack:
        return make_stack(job_runners, site_agents, job_store_process, job_store_client,
                          redis_state, job_store_blobs, sites, *runner_args,
                          runner_settings=runner_settings)

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
    # one live runner per id: a second one with the same id refuses to start
    code, output = RunnerProcess(stack.runner.settings, stack.runner.log_path.parent,
                                 name="second").refused()
    assert code == 2, output
    assert "job-runner: runner id 'test-runner' is in use by the live job-runner " in output
    stack.runner.kill()
    stack.runner.start()  # its predecessor's pid is gone: the id is taken over at once
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


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


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


def test_a_runner_frozen_past_its_lease_is_fenced_by_its_successor(
    stack_of: Callable[..., Stack], job_runners: Runners,
) -> None:
    stack = stack_of(2, "--lease-ttl", "2")
    job_id = stack.run(flow_job(flow("Hold")))
    stack.wait_status(job_id, S.RUNNING)
    first = stack.runner
    assert first.proc is not None
    os.killpg(first.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: stack.state.get_lease("runner:test-runner") is None, timeout=15,
                 what="the frozen runner's id lease to lapse")
        second = job_runners.start("--lease-ttl", "2", name="second")
        assert second.logged("job_runner.reattached") == 1, second.log()
    finally:
        os.killpg(first.proc.pid, signal.SIGCONT)
    wait_for(lambda: first.proc is not None and first.proc.poll() is not None, timeout=30,
             what="the fenced runner to stop")
    assert first.logged("job_runner.fenced") == 1, first.log()
    assert first.logged("job_runner.site_gone") == 0, first.log()
    assert first.logged("job_runner.job_ended") == 0, first.log()
    (second.workspace(job_id) / "go").write_text("")
    stack.runner = second
    record = stack.wait_status(job_id, S.FINISHED_COMPLETED)
    assert stack.result(record)["server_job.log"].count(b'"server_job.started"') == 1


def test_a_runner_cut_off_from_the_broker_judges_nothing_on_what_it_missed(
    stack_of: Callable[..., Stack], settings: Settings,
) -> None:
    upstream = pika.URLParameters(settings.amqp_url)
    proxy = TcpProxy(upstream.host, upstream.port)
    try:
        stack = stack_of(2, "--site-ttl", "2", "--job-ttl", "2", runner_settings=Settings(
            **{**vars(settings), "amqp_url": proxy.for_url(settings.amqp_url)}))
        runner = stack.runner
        wait_for(lambda: runner.logged("heartbeat_intake.verdicts_resumed") == 1, timeout=15,
                 what="the intake to trust its view")
        job_id = stack.run(flow_job(flow("Watch")))
        stack.wait_status(job_id, S.RUNNING)
        wait_for(lambda: all(s["last_heartbeat_ms"] for s in stack.job(job_id).site_states
                             .values()), timeout=15, what="both client jobs' heartbeats")
        # cut off for three TTLs while every site keeps beating: nothing is judged on the gap
        proxy.cut()
        time.sleep(6)
        proxy.heal()
        wait_for(lambda: runner.logged("heartbeat_intake.verdicts_resumed") == 2, timeout=30,
                 what="the intake to trust its view again")
        assert runner.logged("heartbeat_intake.verdicts_paused") == 1
        assert runner.logged("site_transition", transition="site.offline") == 0
        assert runner.logged("job_runner.site_gone") == 0
        assert stack.job(job_id).status == S.RUNNING
        assert set(stack.state.online_sites()) == {"site-1", "site-2"}
        # a site that really dies during a cut is gone once a whole TTL came in after it
        proxy.cut()
        stack.agents[1].kill()
        time.sleep(6)
        proxy.heal()
        record = stack.wait_status(job_id, S.FINISHED_COMPLETED, timeout=60)
    finally:
        proxy.close()
    assert json.loads(stack.result(record)["gone.json"]) == {"site-2": "site went offline"}
    lines = runner.log_path.read_text().splitlines()
    resumed = max(i for i, line in enumerate(lines) if "verdicts_resumed" in line)
    offline = next(i for i, line in enumerate(lines) if '"transition": "site.offline"' in line)
    assert resumed < offline and runner.logged("heartbeat_intake.verdicts_resumed") == 3


def _ended(props: Any, body: bytes, site: str) -> bool:
    if props.type != "fedhive.v1.JobHeartbeat":
        return False
    beat = site_pb2.JobHeartbeat.FromString(body)
    return beat.ended and beat.site == site


def test_a_runner_gone_for_good_has_its_jobs_taken_over_by_another(
    stack_of: Callable[..., Stack], job_runners: Runners,
) -> None:
    """The runner's host died and its replacement has another id: once no process holds the
    dead runner's id and the job's lease lapsed, another runner owns the job, watches its
    server job and ends it once."""
    stack = stack_of(2, "--lease-ttl", "2")
    job_id = stack.run(flow_job(flow("Hold")))
    stack.wait_status(job_id, S.RUNNING)
    other = job_runners.start("--lease-ttl", "2", "--runner-id", "other-runner",
                              name="other")
    stack.runner.kill()  # and never started again
    wait_for(lambda: other.logged("job_runner.taking_over", job_id=job_id), timeout=30,
             what="the other runner to take the job over")
    assert other.logged("job_runner.reattached") == 1, other.log()
    (stack.runner.workspace(job_id) / "go").write_text("")
    stack.runner = other
    record = stack.wait_status(job_id, S.FINISHED_COMPLETED)
    assert stack.result(record)["server_job.log"].count(b'"server_job.started"') == 1
    wait_for(lambda: stack.freed(job_id), timeout=15, what="the sites to be freed")


def test_a_server_job_on_a_host_the_runner_cannot_see_is_judged_and_stopped_through_redis(
    stack_of: Callable[..., Stack], job_runners: Runners, settings: Settings,
) -> None:
    """The server job of a taken-over job runs on another host (simulated: its entry names
    another host): its pid says nothing to the new runner, its liveness record does, and an
    abort reaches it as a stop request in Redis."""
    stack = stack_of(2, "--lease-ttl", "2")
    job_id = stack.run(flow_job(flow("Hold")))
    stack.wait_status(job_id, S.RUNNING)
    table = RunTable.from_settings(settings)
    try:
        stack.runner.kill()
        entry = table.get(job_id)
        assert entry is not None and entry.pid
        table.put(dataclasses.replace(entry, host="elsewhere.example"))
        other = job_runners.start("--lease-ttl", "2", "--runner-id", "other-runner",
                                  name="other")
        wait_for(lambda: other.logged("job_runner.reattached") == 1, timeout=30,
                 what="the other runner to take the job over")
        time.sleep(3)  # the server job runs on: a pid of "another host" is not judged dead
        assert stack.job(job_id).status == S.RUNNING, other.log()
        stack.runner = other
        assert stack.abort(job_id).status == status_to_proto(S.FINISHED_ABORTED)
        wait_for(lambda: other.logged("job_runner.server_job_asked_to_stop") >= 1, timeout=20,
                 what="the stop request")
        wait_for(lambda: _gone(entry.pid), timeout=20, what="the server job to stop itself")
        wait_for(lambda: stack.freed(job_id), timeout=20, what="the sites to be freed")
    finally:
        table.close()
