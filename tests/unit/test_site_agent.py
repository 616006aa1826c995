"""The site agent's logic without a broker: site.json, records, commands, reconcile, status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf.message import Message

from fedhive.config import Settings, child_environment
from fedhive.errors import (
    AlreadyExists,
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unavailable,
)
from fedhive.jobs.archive import UnsafeArchive
from fedhive.names import Names
from fedhive.proto.v1 import site_pb2
from fedhive.resources import build_resources
from fedhive.retry import Backoff
from fedhive_services.site_agent import process
from fedhive_services.site_agent.agent import GONE, SiteAgent
from fedhive_services.site_agent.bundle import expired
from fedhive_services.site_agent.config import agent_settings, load_site
from fedhive_services.site_agent.heartbeat import UNKNOWN_EXIT_CODE, EndedNotices, ended_notice
from fedhive_services.site_agent.records import (
    JobRecord,
    JobState,
    LastWords,
    Workspace,
    one_line,
    read_json,
)
from fedhive_services.site_agent.status import render, site_status
from tests.fixtures.infra import wait_for
from tests.fixtures.site_agent import CLIENT_APP, LIST_GPUS, app_bundle, write_site

BROKER = "amqp://ns.site-1:secret@broker.example:5672/%2F"
STORAGE = "https://s3.example.org/bucket"


def url(job_id: str, app: str = "app") -> str:
    """A presigned URL of the job's bundle, as the job-runner would send it."""
    return f"{STORAGE}/ns/jobs/{job_id}/bundles/{app}.zip?X-Amz-Signature=abc"


def make_agent(tmp_path: Path, bundles: dict[str, bytes] | None = None,
               **fields: object) -> SiteAgent:
    """An agent whose downloads of `url(job)` get `bundles[job]`; `fields` go to site.json."""
    site_dir = write_site(tmp_path, site="site-1", broker_url=BROKER, namespace="ns",
                          storage_url=STORAGE, **fields)
    config = load_site(site_dir)
    served = {url(job_id): body for job_id, body in (bundles or {}).items()}

    def download(address: str, what: str, limit: int) -> bytes:
        return served[address]

    agent = SiteAgent(config, build_resources(LIST_GPUS), Workspace(config.workspace),
                      downloader=download)
    agent.reconcile()
    return agent


def test_site_json_defaults_and_settings(tmp_path: Path) -> None:
    site_dir = tmp_path / "s"
    (site_dir / "local").mkdir(parents=True)
    broker = BROKER.replace("ns.site-1", "fedhive.site-1")
    (site_dir / "local" / "site.json").write_text(
        json.dumps({"site": "site-1", "broker_url": broker, "storage_url": STORAGE + "/"})
    )
    config = load_site(site_dir)
    assert (config.namespace, config.heartbeat_interval_s, config.abort_grace_s) == (
        "fedhive", 5.0, 10.0)
    assert (config.services_user, config.storage_url) == ("fedhive-services", STORAGE)
    assert config.workspace == site_dir.resolve() / "workspace"
    assert "secret" not in repr(config)
    base = Settings(aws_access_key_id="AK", aws_secret_access_key="SK", log_level="DEBUG")
    settings = agent_settings(base, config)
    assert (settings.amqp_url, settings.namespace, settings.log_level) == (broker, "fedhive",
                                                                          "DEBUG")
    assert settings.aws_access_key_id is None and settings.aws_secret_access_key is None


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"site": "server"}, "site", "'server' is reserved"),
        ({"namespace": "Bad NS"}, "namespace", "namespace='Bad NS' must be"),
        ({"abort_grace_s": 0}, "abort_grace_s", "must be a positive number, got 0"),
        ({"org": 3}, "org", "field 'org' must be a non-empty string, got 3"),
        ({"client_job_module": "a b"}, "client_job_module", "is not a module path"),
        ({"namespace": "other"}, "broker_url",
         "its user 'ns.site-1' is not the broker user of site 'site-1' in namespace 'other' "
         "('other.site-1')"),
        ({"storage_url": "s3://bucket"}, "storage_url", "'s3://bucket' is not an http(s) URL"),
        ({"storage_url": None}, "storage_url", "field 'storage_url' is required"),
    ],
)
def test_site_json_errors_name_file_and_field(
    tmp_path: Path, fields: dict[str, object], field: str, message: str
) -> None:
    (tmp_path / "local").mkdir()
    base = {"site": "site-1", "broker_url": BROKER, "namespace": "ns", "storage_url": STORAGE}
    values = {key: value for key, value in {**base, **fields}.items() if value is not None}
    (tmp_path / "local" / "site.json").write_text(json.dumps(values))
    with pytest.raises(ConfigError) as err:
        load_site(tmp_path)
    assert err.value.field == field
    assert str(err.value).startswith(f"{tmp_path / 'local' / 'site.json'}: ")
    assert message in str(err.value)


def allocated(agent: SiteAgent, job_id: str) -> SiteAgent:
    agent.allocate(job_id, agent.check_resources(job_id, {}).token)
    return agent


def test_deploy_is_idempotent_and_one_app_per_job(tmp_path: Path) -> None:
    agent = allocated(make_agent(tmp_path, {"job-1": app_bundle(CLIENT_APP)}), "job-1")
    record = agent.deploy("job-1", "app", url("job-1"), 0)
    assert (record.state, record.app_name) == (JobState.DEPLOYED, "app")
    assert agent.deploy("job-1", "app", "u-never-fetched", 0) == record
    with pytest.raises(AlreadyExists, match="job job-1 already has app 'app' on site site-1"):
        agent.deploy("job-1", "other", url("job-1", "other"), 0)
    with pytest.raises(InvalidArgument, match="invalid app name"):
        agent.deploy("job-2", "../app", url("job-2"), 0)
    with pytest.raises(InvalidArgument, match="invalid job id"):
        agent.deploy(".hidden", "app", url("job-2"), 0)


@pytest.mark.parametrize("address", [
    url("job-2"),  # another job's bundle
    url("job-1", "other"),  # another app
    url("job-1").replace("s3.example.org", "evil.example"),
    url("job-1").replace("https://", "http://"),
    url("job-1").replace("s3.example.org", "s3.example.org:8443"),
    url("job-1").replace("https://", "https://user@"),
    url("job-1").replace("/bucket/", "/bucket2/"),
    url("job-1").replace("/ns/jobs/", "/ns/jobs/job-1/../"),
    url("job-1") + "#x",
])
def test_only_the_jobs_own_bundle_at_the_deployments_store_is_deployed(
    tmp_path: Path, address: str
) -> None:
    agent = allocated(make_agent(tmp_path, {"job-1": app_bundle(CLIENT_APP)}), "job-1")
    with pytest.raises(PermissionDenied, match=r"deploy of job job-1 refused: the bundle URL "
                       r"is not the deployment's object ns/jobs/job-1/bundles/app.zip at "
                       r"https://s3.example.org/bucket"):
        agent.deploy("job-1", "app", address, 0)
    assert agent.deploy("job-1", "app", url("job-1"), 0).state is JobState.DEPLOYED


def test_a_job_not_allocated_here_is_not_deployed(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, {"job-1": app_bundle(CLIENT_APP)})
    with pytest.raises(FailedPrecondition, match="job job-1 holds no resources on site site-1"):
        agent.deploy("job-1", "app", url("job-1"), 0)
    assert agent.jobs() == []


def test_unsafe_bundle_leaves_nothing(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, {"job-1": app_bundle({"ok.txt": "x", "a/../../b": "y"})})
    allocated(agent, "job-1")
    with pytest.raises(UnsafeArchive) as err:
        agent.deploy("job-1", "app", url("job-1"), 0)
    assert err.value.violations == ["the bundle of job job-1: member 'a/../../b': '..' in path"]
    workspace = agent.config.workspace
    assert sorted(p.name for p in workspace.iterdir()) == [".agent"]
    assert [(r.job_id, r.state, r.app_name) for r in agent.jobs()] == [
        ("job-1", JobState.ALLOCATED, "")]


def test_allocate_free_and_start_preconditions(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, {"job-1": app_bundle(CLIENT_APP)})
    token = agent.check_resources("job-1", {"gpu": 1}).token
    allocated = agent.allocate("job-1", token)
    assert allocated.allocation == {"gpu": [0]}
    assert agent.allocate("job-1", token) == allocated  # redelivered
    other = agent.check_resources("job-1", {"gpu": 1}).token
    with pytest.raises(AlreadyExists, match="job-1 already holds resources"):
        agent.allocate("job-1", other)
    with pytest.raises(FailedPrecondition, match="never deployed"):
        agent.start("job-1")
    agent.deploy("job-1", "app", url("job-1"), 0)
    freed = agent.free("job-1")
    assert freed is not None and freed.allocation is None and freed.state is JobState.DEPLOYED
    assert agent.free("job-1") == freed  # free twice is fine
    assert agent.free("never-heard-of") is None
    with pytest.raises(FailedPrecondition, match="holds no resources"):
        agent.start("job-1")
    aborted = agent.abort("job-1", "")
    assert (aborted.state, aborted.reason) == (JobState.ABORTED, "aborted")
    assert agent.abort("job-1", "again").reason == "aborted"
    assert agent.start("job-1").state is JobState.ABORTED  # never started afterwards
    assert agent.report_resources()["free"] == {"gpu": 1}  # `other` is still reserved


def gone_pid() -> int:
    """The pid of a process that has ended."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


@pytest.fixture
def holder() -> Iterator[subprocess.Popen[bytes]]:
    """A process standing for a client job that outlived its agent, in its own process group
    (as the agent starts them); killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            start_new_session=True)
    wait_for(lambda: process.start_time(proc.pid), what="the holder's start time")
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def record_of(agent: SiteAgent, job_id: str) -> JobRecord:
    return next(r for r in agent.jobs() if r.job_id == job_id)


def running(job_id: str, pid: int, started: int | None, gpus: list[int]) -> JobRecord:
    return JobRecord(job_id, JobState.RUNNING, app_name="app", token=f"t-{job_id}",
                     allocation={"gpu": gpus}, pid=pid, pid_started=started)


def test_reconcile_marks_vanished_jobs_lost_and_holds_nothing(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "workspace")
    ws.save_job(running("job-run", gone_pid(), 1, [0]))
    ws.save_job(running("job-said", gone_pid(), 1, [1]))
    ws.save_last_words("job-said", LastWords(1, "executor 'train' failed: boom"))
    ws.save_job(JobRecord("job-dep", JobState.DEPLOYED, app_name="app", token="t2",
                          allocation={"gpu": [1]}))
    ws.save_job(JobRecord("job-old", JobState.FINISHED, app_name="app", exit_code=0))
    agent = make_agent(tmp_path)
    states = {r.job_id: (r.state, r.allocation, r.exit_code, r.notice_pending)
              for r in agent.jobs()}
    assert states == {"job-run": (JobState.LOST, None, None, True),
                      "job-said": (JobState.LOST, None, 1, True),
                      "job-dep": (JobState.DEPLOYED, None, None, False),
                      "job-old": (JobState.FINISHED, None, 0, False)}
    assert agent.running_job_ids() == []
    saved = read_json(ws.job_file("job-run"))
    assert (saved["state"], saved["reason"], saved["notice_pending"]) == ("LOST", GONE, True)
    assert agent.report_resources()["free"] == {"gpu": 2}
    assert agent.notice_due.is_set()
    by_id = {r.job_id: r for r in agent.pending_notices()}
    assert sorted(by_id) == ["job-run", "job-said"]
    said = ended_notice(by_id["job-said"], "site-1")
    assert (said.ended, said.exit_code, said.reason) == (
        True, 1, f"{GONE}: executor 'train' failed: boom")
    unknown = ended_notice(by_id["job-run"], "site-1")
    assert unknown.exit_code == UNKNOWN_EXIT_CODE
    assert unknown.reason.startswith(f"{GONE}: it ended without last words") and \
        "exit code unknown" in unknown.reason
    assert (f"  job-said: {GONE}; executor 'train' failed: boom; its end is not yet reported to "
            "the server") in render(site_status(tmp_path)).splitlines()


def test_reconcile_readopts_a_live_client_job_with_its_resources(
    tmp_path: Path, holder: subprocess.Popen[bytes]
) -> None:
    ws = Workspace(tmp_path / "workspace")
    ws.save_job(running("job-run", holder.pid, process.start_time(holder.pid), [1]))
    agent = make_agent(tmp_path)
    assert agent.running_job_ids() == ["job-run"]
    assert read_json(ws.job_file("job-run"))["state"] == "RUNNING"
    assert agent.report_resources()["free"] == {"gpu": 1}  # GPU 1 is held again
    assert not agent.check_resources("job-2", {"gpu": 2}).ok
    token = agent.check_resources("job-2", {"gpu": 1}).token
    assert agent.allocate("job-2", token).allocation == {"gpu": [0]}
    assert not agent.notice_due.is_set()

    ws.save_last_words("job-run", LastWords(0, "the server job ended the run"))
    os.killpg(holder.pid, signal.SIGTERM)  # its end, seen by the watcher (not its parent)
    holder.wait()
    ended = wait_for(lambda: (r := record_of(agent, "job-run")).state is JobState.FINISHED
                     and r, what="the re-adopted job's end")
    assert (ended.job_id, ended.exit_code, ended.exit_reason, ended.notice_pending) == (
        "job-run", 0, "the server job ended the run", True)
    assert ended.allocation is None and agent.report_resources()["free"] == {"gpu": 1}
    assert agent.notice_due.is_set()


def test_a_readopted_job_is_aborted_by_its_process_group(
    tmp_path: Path, holder: subprocess.Popen[bytes]
) -> None:
    ws = Workspace(tmp_path / "workspace")
    ws.save_job(running("job-run", holder.pid, process.start_time(holder.pid), [0]))
    agent = make_agent(tmp_path)
    aborted = agent.abort("job-run", "admin")
    assert (aborted.state, aborted.allocation) == (JobState.ABORTED, None)
    assert holder.wait(timeout=10) == -signal.SIGTERM
    ended = wait_for(lambda: (r := record_of(agent, "job-run")).notice_pending and r,
                     what="its end")
    assert (ended.state, ended.reason, ended.exit_code) == (JobState.ABORTED, "admin", None)
    notice = ended_notice(ended, "site-1")
    assert notice.reason.endswith("(aborted: admin)") and notice.exit_code == UNKNOWN_EXIT_CODE
    assert agent.report_resources()["free"] == {"gpu": 2}
    agent.shutdown()


def test_reconcile_stops_a_job_whose_resources_cannot_be_taken_again(
    tmp_path: Path, holder: subprocess.Popen[bytes]
) -> None:
    ws = Workspace(tmp_path / "workspace")
    started = process.start_time(holder.pid)
    ws.save_job(running("job-a", holder.pid, started, [0, 7]))  # GPU 7 is not on the site now
    agent = make_agent(tmp_path)
    assert holder.wait(timeout=10) == -signal.SIGTERM
    record = agent.jobs()[0]
    assert (record.state, record.allocation, record.notice_pending) == (JobState.LOST, None, True)
    assert record.reason.startswith("client job stopped: the restarted site agent could not "
                                    "take its resources again: cannot restore")
    assert "gpu unit 7 is not on this site" in record.reason
    assert agent.report_resources()["free"] == {"gpu": 2}


def test_reconcile_finishes_an_abort_the_killed_agent_did_not_see_through(
    tmp_path: Path, holder: subprocess.Popen[bytes]
) -> None:
    ws = Workspace(tmp_path / "workspace")
    record = running("job-a", holder.pid, process.start_time(holder.pid), [0])
    ws.save_job(record.but(state=JobState.ABORTED, reason="admin"))  # saved before the kill
    agent = make_agent(tmp_path)
    assert holder.wait(timeout=10) == -signal.SIGTERM
    ended = agent.jobs()[0]
    assert (ended.state, ended.reason, ended.allocation, ended.notice_pending) == (
        JobState.ABORTED, "admin", None, True)
    assert agent.report_resources()["free"] == {"gpu": 2}
    assert make_agent(tmp_path).pending_notices()[0].updated_at_ms == ended.updated_at_ms


@pytest.mark.parametrize(
    ("code", "words", "log", "expected"),
    [
        (1, None, "x\nfedhive-client-job: bad config\n\n", "exited with code 1: "
                                                         "fedhive-client-job: bad config"),
        (-9, None, "anything", "killed by signal 9 (SIGKILL: the OOM killer, or killed by "
                               "hand?)"),
        (-15, None, "", "killed by signal 15 (SIGTERM)"),
        (0, None, "done", "exited with code 0"),
        (1, LastWords(1, "the executor failed"), "x", "the executor failed"),
        (-9, LastWords(0, "the server job ended the run"), "",
         "the server job ended the run; then killed by signal 9 (SIGKILL: the OOM killer, or "
         "killed by hand?)"),
    ],
)
def test_why_a_client_job_ended(tmp_path: Path, code: int, words: LastWords | None, log: str,
                                expected: str) -> None:
    agent = make_agent(tmp_path)
    ws = Workspace(agent.config.workspace)
    ws.log_file("job-1").write_text(log)
    if words is not None:
        ws.save_last_words("job-1", words)
    ended = agent._with_end(JobRecord("job-1", JobState.FINISHED), code)
    assert (ended.exit_code, ended.exit_reason, ended.notice_pending) == (code, expected, True)


def test_last_words_and_reasons_are_one_bounded_line(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    assert ws.load_last_words("job-1") is None
    ws.create()
    ws.last_words_file("job-1").write_text("{not json")
    assert ws.load_last_words("job-1") is None
    ws.save_last_words("job-1", LastWords(1, "line one\n  line two"))
    assert ws.load_last_words("job-1") == LastWords(1, "line one line two",
                                                    ws.load_last_words("job-1").at_ms)
    long = one_line("x" * 1000)
    assert len(long) == 500 and long.endswith("...")
    ws.log_file("job-1").write_bytes(b"\xff\xfe broken utf-8\n" + b"y" * 9000 + b"\n")
    assert ws.log_tail("job-1") == one_line("y" * 9000)
    assert [r.job_id for r in ws.load_jobs()] == []  # <job>.end.json is not a record


class FlakyBus:
    """A bus whose first `failures` publishes fail as a broker away for longer than the
    publisher retries would."""

    user = "ns.site-1"
    names = Names("ns")

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.published: list[tuple[str, Message, str | None]] = []

    def publish_event(self, routing_key: str, message: Message, *,
                      message_id: str | None = None) -> str:
        if self.failures:
            self.failures -= 1
            raise Unavailable("publish not confirmed", field=routing_key)
        self.published.append((routing_key, message, message_id))
        return message_id or ""


def ended_job(ws: Workspace, job_id: str) -> None:
    ws.save_job(running(job_id, gone_pid(), 1, [0]))


def test_a_notice_stays_pending_until_published_even_across_a_restart(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "workspace")
    ended_job(ws, "job-1")
    agent = make_agent(tmp_path)
    down = FlakyBus(failures=1)
    notices = EndedNotices(agent, down, retry=Backoff(base=0.01, cap=0.01, max_attempts=None))
    assert notices.publish_pending() is False
    assert down.published == []
    assert read_json(ws.job_file("job-1"))["notice_pending"] is True

    restarted = make_agent(tmp_path)  # the agent killed, started again: still pending
    assert [r.job_id for r in restarted.pending_notices()] == ["job-1"]
    bus = FlakyBus(failures=2)
    notices = EndedNotices(restarted, bus, retry=Backoff(base=0.01, cap=0.01,
                                                         max_attempts=None))
    notices.start()  # publishes what is pending at once, retrying past the failures
    wait_for(lambda: bus.published, what="the notice")
    notices.stop()
    [(key, message, message_id)] = bus.published
    assert (key, message_id) == ("site.site-1.job", "job-1.site-1.ended")
    assert isinstance(message, site_pb2.JobHeartbeat)
    assert (message.job_id, message.site, message.ended) == ("job-1", "site-1", True)
    assert message.reason.startswith(GONE) and message.sent_at_ms > 0
    assert restarted.pending_notices() == []
    assert read_json(ws.job_file("job-1"))["notice_pending"] is False
    assert make_agent(tmp_path).pending_notices() == []  # never published twice


def test_a_client_job_that_dies_at_once_is_noticed(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, {"job-1": app_bundle(CLIENT_APP)},
                       client_job_module="no_such_module_of_fedhive")
    bus = FlakyBus(failures=0)
    notices = EndedNotices(agent, bus)
    notices.start()
    allocated(agent, "job-1")
    agent.deploy("job-1", "app", url("job-1"), 0)
    agent.start("job-1")
    wait_for(lambda: bus.published, what="the notice")
    notices.stop()
    [(_, message, _)] = bus.published
    assert isinstance(message, site_pb2.JobHeartbeat)
    assert (message.job_id, message.ended, message.exit_code) == ("job-1", True, 1)
    assert message.reason.startswith("exited with code 1: ")
    assert message.reason.endswith("No module named no_such_module_of_fedhive")
    record = agent.jobs()[0]
    assert (record.state, record.notice_pending, record.allocation) == (
        JobState.FINISHED, False, None)


def test_status_reads_only_the_site_files(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, {"job-1": app_bundle(CLIENT_APP)})
    agent.allocate("job-1", agent.check_resources("job-1", {"gpu": 2}).token)
    agent.deploy("job-1", "app", url("job-1"), 0)
    status = site_status(tmp_path)
    assert status.to_json()["jobs"][0]["allocation"] == {"gpu": [0, 1]}
    text = render(status)
    assert "site site-1" in text and "agent: not running" in text
    assert any(line.split()[:4] == ["job-1", "DEPLOYED", "app", '{"gpu":'] for line in
               text.splitlines())


def test_process_identity() -> None:
    me = process.start_time(os.getpid())
    assert me is not None
    assert process.alive(os.getpid(), me)
    assert not process.alive(os.getpid(), me + 1)  # a reused pid is not our process
    assert not process.alive(0, None)
    assert child_environment({"CUDA_VISIBLE_DEVICES": "3"})["CUDA_VISIBLE_DEVICES"] == "3"


def test_expiry() -> None:
    assert not expired(0, 10)  # unknown expiry: let S3 decide
    assert expired(10, 10) and not expired(11, 10)
