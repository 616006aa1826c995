"""The site agent's log sharing (services/site_agent/logs.py) with a recording bus: batches of a
client job's log, the saved position a restarted agent goes on from, the last batch (`eof`)
once the client job ended, nothing but a `private` notice when sharing is off, and `share_logs`
in site.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.message import Message

from fedhive.errors import ConfigError, Unavailable
from fedhive.proto.v1 import site_pb2
from fedhive_services.site_agent.config import load_site
from fedhive_services.site_agent.logs import LogShipper
from fedhive_services.site_agent.records import JobRecord, JobState, Workspace
from tests.fixtures.site_agent import write_site

SITE = "site-1"


@dataclass
class FakeConfig:
    site: str = SITE
    share_logs: bool = True


@dataclass
class FakeAgent:
    config: FakeConfig
    records: list[JobRecord] = field(default_factory=list)

    def jobs(self) -> list[JobRecord]:
        return list(self.records)


class RecordingBus:
    def __init__(self) -> None:
        self.published: list[tuple[str, site_pb2.LogBatch, str | None]] = []
        self.down = False

    def publish_event(self, routing_key: str, message: Message, *,
                      message_id: str | None = None) -> str:
        if self.down:
            raise Unavailable("broker away")
        assert isinstance(message, site_pb2.LogBatch)
        self.published.append((routing_key, message, message_id))
        return message_id or ""


def shipper(tmp_path: Path, agent: FakeAgent, bus: RecordingBus) -> LogShipper:
    workspace = Workspace(tmp_path / "workspace")
    workspace.create()
    return LogShipper(agent, workspace, bus)  # type: ignore[arg-type]


def texts(bus: RecordingBus) -> list[str]:
    return [line.text for _, batch, _ in bus.published for line in batch.lines]


def test_lines_go_out_in_batches_and_a_restart_goes_on_where_it_stopped(tmp_path: Path) -> None:
    running = JobRecord("job-1", JobState.RUNNING, pid=123)
    agent, bus = FakeAgent(FakeConfig(), [running, JobRecord("job-2", JobState.DEPLOYED)]), \
        RecordingBus()
    first = shipper(tmp_path, agent, bus)
    log = tmp_path / "workspace" / ".agent" / "jobs" / "job-1.log"
    log.write_text("hello\nhalf")
    first.ship_all()
    assert texts(bus) == ["hello"]
    key, batch, message_id = bus.published[0]
    assert key == f"site.{SITE}.logs" and (batch.job_id, batch.site, batch.start) == (
        "job-1", SITE, 0)
    assert message_id == f"job-1.{SITE}.logs.0" and not batch.eof
    saved = json.loads((log.parent / "job-1.logs.json").read_text())
    assert (saved["offset"], saved["done"]) == (6, False)

    with log.open("a") as out:
        out.write(" line\nTraceback (most recent call last):\n  File \"x\", line 1\n"
                  "ValueError: bad\nlast words")
    bus.down = True
    first.ship_all()  # the broker is away: nothing is lost, it goes out next time
    bus.down = False
    again = shipper(tmp_path, agent, bus)  # a restarted agent
    agent.records[0] = JobRecord("job-1", JobState.FINISHED, pid=123)
    again.ship_all()
    assert texts(bus) == ["hello", "half line", "Traceback (most recent call last):",
                          '  File "x", line 1', "ValueError: bad", "last words"]
    last = bus.published[-1][1]
    assert last.eof and [line.error for line in last.lines] == [False, False, False, True,
                                                               False]
    again.ship_all()  # done: nothing more
    assert len(bus.published) == 2
    assert json.loads((log.parent / "job-1.logs.json").read_text())["done"] is True


def test_a_client_job_that_ended_without_a_log_still_ends_its_lines(tmp_path: Path) -> None:
    agent, bus = FakeAgent(FakeConfig(), [JobRecord("job-1", JobState.LOST, pid=9)]), \
        RecordingBus()
    shipper(tmp_path, agent, bus).ship_all()
    assert [(b.job_id, list(b.lines), b.eof) for _, b, _ in bus.published] == [
        ("job-1", [], True)]


def test_with_sharing_off_only_a_private_notice_leaves_the_site(tmp_path: Path) -> None:
    agent = FakeAgent(FakeConfig(share_logs=False),
                      [JobRecord("job-1", JobState.RUNNING, pid=5)])
    bus = RecordingBus()
    log = tmp_path / "workspace" / ".agent" / "jobs" / "job-1.log"
    log.parent.mkdir(parents=True)
    log.write_text("a secret\n")
    first = shipper(tmp_path, agent, bus)
    first.ship_all()
    first.ship_all()
    shipper(tmp_path, agent, bus).ship_all()  # after a restart too: once
    assert [(b.job_id, b.private, list(b.lines)) for _, b, _ in bus.published] == [
        ("job-1", True, [])]


BROKER = "amqp://ns.site-1:secret@localhost:5672/%2F"


@pytest.mark.parametrize(("value", "expected"), [(None, True), (True, True), (False, False)])
def test_share_logs_in_site_json(tmp_path: Path, value: bool | None, expected: bool) -> None:
    fields: dict[str, Any] = {} if value is None else {"share_logs": value}
    site_dir = write_site(tmp_path, site=SITE, broker_url=BROKER, namespace="ns",
                          storage_url="http://127.0.0.1:9000/bucket", **fields)
    assert load_site(site_dir).share_logs is expected


def test_share_logs_must_be_a_boolean(tmp_path: Path) -> None:
    site_dir = write_site(tmp_path, site=SITE, broker_url=BROKER, namespace="ns",
                          storage_url="http://127.0.0.1:9000/bucket", share_logs="no")
    with pytest.raises(ConfigError, match="field 'share_logs' must be true or false") as err:
        load_site(site_dir)
    assert err.value.field == "share_logs"
