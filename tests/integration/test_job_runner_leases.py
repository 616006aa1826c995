"""The job-runner's identity, leases and takeover, with real services: one live process per
runner id, a restarted runner re-attaching, one frozen past its lease fenced by its successor,
one gone for good taken over by another runner (also with its server job on another host),
and one cut off from the broker judging nothing on what it missed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from collections.abc import Callable

import pika
import pytest

from fedhive.config import Settings
from fedhive.errors import StaleFencingToken
from fedhive.jobs.serde import status_to_proto
from fedhive.jobs.status import JobStatus
from fedhive.state.runs import RunEntry, RunTable
from tests.fixtures.infra import wait_for
from tests.fixtures.job_runner import (
    RunnerProcess,
    Runners,
    Stack,
    dispatch,
    flow,
    flow_job,
    group_gone,
)
from tests.fixtures.tcp_proxy import TcpProxy

S = JobStatus


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


def test_a_running_jobs_entry_is_written_only_with_the_jobs_newest_token(
    settings: Settings,
) -> None:
    """A runner frozen past its lease may resume mid-tick holding the entry it read before:
    its write (the old token) must not replace its successor's, whose token renews the job."""
    table = RunTable.from_settings(settings)
    try:
        mine = RunEntry("job-1", "test-runner", 2, "running").with_site("site-1", started=True)
        table.put(mine)
        stale = dataclasses.replace(mine, fence_token=1, phase="starting")
        with pytest.raises(StaleFencingToken, match=r"job job-1: .*newer token than 1"):
            table.put(stale)
        with pytest.raises(StaleFencingToken):
            table.remove("job-1", 1)
        assert table.get("job-1") == mine
        table.put(dataclasses.replace(mine, fence_token=3))  # a later owner's takes its place
        table.remove("job-1", 3)
        assert table.get("job-1") is None
        table.put(stale)  # no entry: nothing newer to protect
        assert table.get("job-1") == stale
    finally:
        table.close()


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
    # logged once the lease is its own and the entry rewritten, a moment after `taking_over`
    wait_for(lambda: other.logged("job_runner.reattached") == 1, timeout=15,
             what="the other runner to re-attach")
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
        wait_for(lambda: group_gone(entry.pid), timeout=20, what="the server job to stop itself")
        wait_for(lambda: stack.freed(job_id), timeout=20, what="the sites to be freed")
    finally:
        table.close()
