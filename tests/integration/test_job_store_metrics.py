"""The job-store's GetJobMetrics handler on real Redis and S3: the rounds a server job logged,
oldest first, while the job runs and after; NOT_FOUND for an unknown job; gone with the job.

The `Store` harness is test_job_store_handlers.py's.
"""

from __future__ import annotations

from typing import Any

import pytest

from fedhive.blobs import S3BlobStore
from fedhive.errors import NotFound
from fedhive.jobs.metrics import RoundMetrics, round_from_proto
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import admin_pb2
from fedhive.state import RedisStateStore
from fedhive.state.rounds import RoundLog
from tests.fixtures.job_store import job_zip
from tests.fixtures.job_store_handlers import NoRunner, Store, handler_store


@pytest.fixture
def store(redis_state: RedisStateStore, job_store_blobs: S3BlobStore, round_log: RoundLog
          ) -> Store:
    return handler_store(redis_state, job_store_blobs, round_log, NoRunner())


def _logged(index: int, accuracy: Any, workflow: str = "sag") -> dict[str, Any]:
    """A round as the server job logs it."""
    return {"workflow": workflow, "round": index, "num_rounds": 3,
            "metrics": {"sites": {"site-1": {"accuracy": accuracy, "n": 10}},
                        "aggregate": {"accuracy": accuracy}},
            "at_ms": 1_700_000_000_000 + index}


def _metrics(store: Store, job_id: str) -> admin_pb2.JobMetrics:
    reply = store.call(admin_pb2.GetJobMetricsRequest(job_id=job_id))
    assert isinstance(reply, admin_pb2.JobMetrics)
    return reply


def test_metrics_of_a_running_job_grow_round_by_round(store: Store, round_log: RoundLog) -> None:
    job_id = store.submit(job_zip("mnist")).job_id
    store.move_to(job_id, JobStatus.RUNNING)
    reply = _metrics(store, job_id)
    assert reply.job_id == job_id and list(reply.rounds) == []  # no round yet

    round_log.append(job_id, _logged(0, 0.5))
    assert [r.round for r in _metrics(store, job_id).rounds] == [0]
    round_log.append(job_id, _logged(1, 0.75))
    round_log.append(job_id, _logged(0, 0.7, workflow="cross_site_eval"))
    rounds = [round_from_proto(r) for r in _metrics(store, job_id).rounds]
    assert rounds[1] == RoundMetrics(
        "sag", 1, 3, {"sites": {"site-1": {"accuracy": 0.75, "n": 10}},
                      "aggregate": {"accuracy": 0.75}}, 1_700_000_000_001)
    assert [(r.workflow, r.round) for r in rounds] == [
        ("sag", 0), ("sag", 1), ("cross_site_eval", 0)]
    assert isinstance(rounds[0].sites["site-1"]["n"], int)  # whole numbers stay ints


def test_metrics_of_an_unknown_job_is_not_found(store: Store, round_log: RoundLog) -> None:
    round_log.append("no-such-job", _logged(0, 0.5))  # a log without a job is not a job
    with pytest.raises(NotFound, match="job no-such-job not found"):
        store.call(admin_pb2.GetJobMetricsRequest(job_id="no-such-job"))


def test_deleting_a_job_deletes_its_metrics(store: Store, round_log: RoundLog) -> None:
    job_id = store.submit(job_zip("done")).job_id
    store.move_to(job_id, JobStatus.FINISHED_COMPLETED)
    round_log.append(job_id, _logged(0, 0.9))
    assert len(_metrics(store, job_id).rounds) == 1
    store.call(admin_pb2.DeleteJobRequest(job_id=job_id))
    assert round_log.read(job_id) == []
    with pytest.raises(NotFound):
        _metrics(store, job_id)


def test_a_null_value_crosses_the_wire(store: Store, round_log: RoundLog) -> None:
    job_id = store.submit(job_zip("diverged")).job_id
    round_log.append(job_id, _logged(0, float("nan")))  # stored as null
    (entry,) = [round_from_proto(r) for r in _metrics(store, job_id).rounds]
    assert entry.aggregate == {"accuracy": None}
