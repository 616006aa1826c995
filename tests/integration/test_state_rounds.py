"""The jobs' round log (`fedhive.state.rounds.RoundLog`) on real Redis, the server job's
`RoundReports` writing to it, and deleting a job deleting it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis
import structlog
from structlog.testing import capture_logs

from fedhive.config import Settings
from fedhive.fl.server_job import RoundReports
from fedhive.fl.workflow import RoundReport
from fedhive.jobs.status import JobStatus
from fedhive.names import Names
from fedhive.state import RedisStateStore
from fedhive.state import rounds as rounds_module
from fedhive.state.rounds import RoundLog
from tests.fixtures.state import submit_in


def _entry(index: int, **aggregate: Any) -> dict[str, Any]:
    return {"workflow": "sag", "round": index, "num_rounds": 3,
            "metrics": {"sites": {"site-1": aggregate}, "aggregate": aggregate},
            "at_ms": 1_700_000_000_000 + index}


def test_rounds_read_back_oldest_first(round_log: RoundLog) -> None:
    assert round_log.read("job-1") == []
    for index in range(3):
        round_log.append("job-1", _entry(index, accuracy=0.5 + index / 10))
    round_log.append("job-2", _entry(0, accuracy=0.1))
    assert round_log.read("job-1") == [_entry(i, accuracy=0.5 + i / 10) for i in range(3)]
    assert [e["metrics"]["aggregate"] for e in round_log.read("job-2")] == [{"accuracy": 0.1}]


def test_rounds_live_at_the_named_key(round_log: RoundLog, settings: Settings) -> None:
    round_log.append("job-1", _entry(0, loss=1.0))
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        key = Names(settings.namespace).job_rounds_key("job-1")
        assert key == f"{{{settings.namespace}:job:job-1}}:rounds"  # the job's hash slot
        assert [json.loads(v) for v in client.lrange(key, 0, -1)] == [_entry(0, loss=1.0)]
    finally:
        client.close()


def test_numbers_json_cannot_hold_are_null(round_log: RoundLog) -> None:
    round_log.append("job-1", _entry(0, loss=float("nan"), grad=float("inf"), acc=0.5))
    aggregate = round_log.read("job-1")[0]["metrics"]["aggregate"]
    assert aggregate == {"loss": None, "grad": None, "acc": 0.5}


def test_only_the_newest_rounds_are_kept(round_log: RoundLog,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rounds_module, "MAX_ROUNDS", 4)
    for index in range(7):
        round_log.append("job-1", _entry(index))
    assert [e["round"] for e in round_log.read("job-1")] == [3, 4, 5, 6]


def test_deleting_a_job_deletes_its_rounds(redis_state: RedisStateStore,
                                           round_log: RoundLog) -> None:
    submit_in(redis_state, "job-1", JobStatus.FINISHED_COMPLETED)
    submit_in(redis_state, "job-2", JobStatus.FINISHED_COMPLETED)
    for job_id in ("job-1", "job-2"):
        round_log.append(job_id, _entry(0, accuracy=0.9))
    assert redis_state.delete_job("job-1") is True
    assert round_log.read("job-1") == []
    assert len(round_log.read("job-2")) == 1  # another job's rounds stay


def test_server_job_reports_reach_the_round_log(round_log: RoundLog, tmp_path: Path) -> None:
    reports = RoundReports("job-1", tmp_path, None, structlog.get_logger(), rounds=round_log)
    for index in range(2):
        reports(RoundReport("sag", index, 2, {"sites": {"site-1": {"accuracy": 0.5}},
                                              "aggregate": {"accuracy": 0.5 + index}}))
    logged = round_log.read("job-1")
    assert [(e["workflow"], e["round"], e["num_rounds"]) for e in logged] == [
        ("sag", 0, 2), ("sag", 1, 2)]
    assert logged[1]["metrics"]["aggregate"] == {"accuracy": 1.5}
    in_file = json.loads((tmp_path / "metrics.json").read_text())["rounds"]
    assert [int(e["time"] * 1000) for e in in_file] == [e["at_ms"] for e in logged]


def test_a_redis_hiccup_is_logged_and_the_round_still_kept(tmp_path: Path,
                                                           settings: Settings) -> None:
    unreachable = redis.Redis.from_url("redis://127.0.0.1:9/0", socket_connect_timeout=0.5)
    broken = RoundLog(unreachable, Names(settings.namespace))
    reports = RoundReports("job-1", tmp_path, None, structlog.get_logger(), rounds=broken)
    with capture_logs() as logs:
        reports(RoundReport("sag", 0, 1, {"aggregate": {"accuracy": 0.5}}))
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "server_job.round_log_failed"]
    assert len(json.loads((tmp_path / "metrics.json").read_text())["rounds"]) == 1
    broken.close()
