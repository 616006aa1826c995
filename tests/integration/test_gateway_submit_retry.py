"""A gateway killed (SIGKILL) in the middle of a submit (issue 16, point 3): the SDK and the CLI
retry with the submission id they always send, and the submit ends with exactly one job.

The real job-store and gateway run as processes. The job-store is stopped while the submit is
made, so the request provably waits in its queue when the gateway dies: the job-store then
creates the job although nobody can hear the answer, which is what makes a naive retry run a
job twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fedhive.config import Settings
from fedhive.names import Names
from fedhive.retry import Backoff
from fedhive.sdk import Session
from fedhive.state import RedisStateStore
from tests.fixtures.bus import Broker
from tests.fixtures.gateway import GatewayStack, clean_namespace, running_stack
from tests.fixtures.infra import wait_for
from tests.fixtures.job_store import job_zip

PATIENT = Backoff(base=0.2, cap=2.0, max_attempts=None, deadline=300.0)  # outlasts any restart


@pytest.fixture
def stack(settings: Settings, broker: Broker, tmp_path: Path) -> Iterator[GatewayStack]:
    with running_stack(settings, tmp_path) as running:
        yield running
    clean_namespace(settings)


def _queued(broker: Broker, settings: Settings) -> int:
    """Requests waiting in the job-store's queue."""
    channel = broker.channel()
    try:
        queue = Names(settings.namespace).service_queue("job-store")
        return int(channel.queue_declare(queue, passive=True).method.message_count)
    finally:
        channel.connection.close()


def _kill_gateway(stack: GatewayStack) -> None:
    proc = stack.gateway.proc
    assert proc is not None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _restart_gateway(stack: GatewayStack) -> None:
    stack.gateway.start()  # same address: the client's retries reach it there
    stack.gateway.wait_ready()


def test_sdk_submit_survives_a_gateway_killed_after_the_job_was_created(
    stack: GatewayStack, settings: Settings, broker: Broker, redis_state: RedisStateStore,
) -> None:
    stack.job_store.stop()
    session = Session(stack.gateway.address, stack.admins.tokens["admin@a"],
                      submit_retry=PATIENT)
    with session, ThreadPoolExecutor(1) as pool:
        submitted = pool.submit(session.submit, job_zip("once"))
        wait_for(lambda: _queued(broker, settings) == 1, timeout=60,
                 what="the gateway to forward the submit")
        _kill_gateway(stack)  # the request is in the queue; its answer has nowhere to go
        stack.job_store.start()
        created = wait_for(redis_state.recent_job_ids, timeout=60,
                           what="the job-store to create the job")
        _restart_gateway(stack)
        result = submitted.result(timeout=300)
    assert result.existed and [result.job_id] == created == redis_state.recent_job_ids()
    assert result.submission_id  # generated: the caller gave none


def test_cli_submit_survives_a_gateway_killed_while_the_job_store_is_down(
    stack: GatewayStack, settings: Settings, broker: Broker, redis_state: RedisStateStore,
    tmp_path: Path,
) -> None:
    """Here the retry reaches the job-store beside the first request: whichever the job-store
    takes first makes the job, the other finds it."""
    stack.job_store.stop()
    (tmp_path / "job.zip").write_bytes(job_zip("once"))
    env = {**os.environ, "HOME": str(tmp_path), "FEDHIVE_GATEWAY": stack.gateway.address,
           "FEDHIVE_TOKEN": stack.admins.tokens["admin@a"]}
    fedhive = Path(sys.executable).with_name("fedhive")
    with subprocess.Popen([str(fedhive), "submit", "--json", str(tmp_path / "job.zip")],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as cli:
        wait_for(lambda: _queued(broker, settings) == 1, timeout=60,
                 what="the gateway to forward the submit")
        _kill_gateway(stack)
        _restart_gateway(stack)
        wait_for(lambda: _queued(broker, settings) == 2, timeout=60,
                 what="the CLI's retry to reach the job-store's queue")
        stack.job_store.start()
        out, err = cli.communicate(timeout=300)
    assert cli.returncode == 0, err.decode()
    result = json.loads(out)
    assert redis_state.recent_job_ids() == [result["id"]]
