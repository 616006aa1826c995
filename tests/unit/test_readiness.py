"""Readiness without servers: aggregation, freshness, the file, the loop's bounds and
transitions (`fedhive.readiness`), and the compose probe that reads the file
(`deploy/compose/healthcheck.py ready`). tests/integration/test_readiness.py runs the real
checks against real servers and a real service process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fedhive.config import Settings
from fedhive.errors import ConfigError
from fedhive.readiness import (
    STALE_AFTER,
    Check,
    Outcome,
    Readiness,
    ReadyConfig,
    Report,
    default_path,
    read_report,
    verdict,
    write_report,
)
from fedhive.readiness_checks import NotReady, published_within
from tests.fixtures.infra import wait_for

from .deploy_scripts import healthcheck

NOW = 1_767_000_000.0


class Recorder:
    """A structlog-shaped logger that keeps what it was told."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def _keep(self, level: str, event: str, **fields: Any) -> None:
        self.events.append((level, event, fields))

    def info(self, event: str, **fields: Any) -> None:
        self._keep("info", event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._keep("warning", event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self._keep("error", event, **fields)

    def names(self) -> list[str]:
        return [event for _, event, _ in self.events]


def report(**checks: Outcome) -> Report:
    return Report("job-store", checks, NOW, 5.0)


def failing(reason: str) -> Any:
    def probe() -> str:
        raise NotReady(reason)

    return probe


# --- aggregation and freshness ---------------------------------------------------------------
def test_ready_only_when_every_check_is_ok_and_the_line_names_the_failing_ones() -> None:
    ok = report(broker=Outcome(True, "consuming"), redis=Outcome(True, "PONG"))
    assert ok.ready and verdict(ok, NOW) == (True, "job-store ready: broker, redis")
    down = report(broker=Outcome(True, "consuming"), redis=Outcome(False, "refused"),
                  s3=Outcome(False, "403"))
    assert not down.ready
    assert verdict(down, NOW) == (False, "job-store not ready: redis: refused; s3: 403")


def test_a_report_older_than_three_intervals_is_stale_whatever_it_says() -> None:
    ok = report(redis=Outcome(True, "PONG"))
    assert verdict(ok, NOW + STALE_AFTER * 5.0)[0]  # the last moment it counts
    healthy, line = verdict(ok, NOW + STALE_AFTER * 5.0 + 1)
    assert not healthy
    assert line == ("job-store readiness is stale: last written 16s ago, every 5s expected "
                    "(the process is dead or wedged)")


def test_the_file_round_trips_and_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "ready.json"
    first = report(redis=Outcome(False, "refused"))
    write_report(path, first)
    assert read_report(path) == first
    assert json.loads(path.read_text()) == {
        "service": "job-store", "ready": False, "at": NOW, "interval_s": 5.0,
        "checks": {"redis": {"ok": False, "detail": "refused"}}}
    write_report(path, report(redis=Outcome(True, "PONG")))
    assert read_report(path).ready
    assert [p.name for p in tmp_path.iterdir()] == ["ready.json"]  # no temporary left


def test_a_file_that_is_not_a_report_is_named(tmp_path: Path) -> None:
    path = tmp_path / "ready.json"
    path.write_text("{")
    with pytest.raises(ValueError, match=r"ready\.json: not JSON"):
        read_report(path)
    path.write_text('{"ready": true}')
    with pytest.raises(ValueError, match=r"ready\.json: not a readiness report"):
        read_report(path)


def test_the_path_and_interval_come_from_the_settings() -> None:
    assert ReadyConfig.for_service("fedhive-job-store", Settings.from_env({})) == ReadyConfig(
        default_path("job-store"), 5.0)
    assert default_path("job-store").name == "fedhive-job-store.ready"
    settings = Settings.from_env({"FEDHIVE_READY_FILE": "/run/gw.ready",
                                  "FEDHIVE_READY_INTERVAL": "0.5"})
    config = ReadyConfig.for_service("gateway", settings)
    assert config == ReadyConfig(Path("/run/gw.ready"), 0.5) and config.timeout_s == 0.5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ConfigError, match=r"^FEDHIVE_READY_INTERVAL=") as caught:
            Settings.from_env({"FEDHIVE_READY_INTERVAL": bad})
        assert caught.value.field == "FEDHIVE_READY_INTERVAL"


# --- the loop ----------------------------------------------------------------------------------
def test_a_round_writes_every_outcome_and_one_line_details(tmp_path: Path) -> None:
    path = tmp_path / "r"
    checks = [Check("broker", lambda: "consuming from q"),
              Check("redis", failing("redis at h:1: Error 111\nconnecting. Connection refused."))]
    readiness = Readiness("fedhive-job-store", checks, ReadyConfig(path, 5.0), Recorder())
    written = readiness.evaluate()
    assert read_report(path) == written and written.service == "job-store"
    assert written.checks == {
        "broker": Outcome(True, "consuming from q"),
        "redis": Outcome(False, "redis at h:1: Error 111 connecting. Connection refused.")}


def test_a_hung_probe_fails_within_the_bound_and_is_not_called_again_meanwhile(
        tmp_path: Path) -> None:
    release = threading.Event()
    calls: list[int] = []

    def hangs() -> str:
        calls.append(1)
        release.wait(30)
        return "PONG"

    readiness = Readiness("scheduler", [Check("redis", hangs)],
                          ReadyConfig(tmp_path / "r", 0.5), Recorder())
    for _ in range(2):
        outcome = readiness.evaluate().checks["redis"]
        assert not outcome.ok and outcome.detail.startswith("no answer for ")
        assert outcome.detail.endswith("(limit 0.5s)")
    assert calls == [1]
    release.set()
    wait_for(lambda: readiness.evaluate().ready, what="the released probe's answer")
    assert readiness.evaluate().ready and len(calls) >= 2  # a fresh call once it answered


def test_transitions_are_logged_and_announced_once_each(tmp_path: Path) -> None:
    up = threading.Event()
    up.set()

    def redis() -> str:
        if not up.is_set():
            raise NotReady("refused")
        return "PONG"

    log, changes = Recorder(), list[bool]()
    readiness = Readiness("job-store", [Check("redis", redis)], ReadyConfig(tmp_path / "r", 5.0),
                          log, on_change=changes.append)
    readiness.evaluate()
    readiness.evaluate()
    up.clear()
    readiness.evaluate()
    readiness.evaluate()
    up.set()
    readiness.evaluate()
    assert changes == [True, False, True]
    assert log.names() == ["readiness.ready", "readiness.not_ready", "readiness.ready"]
    assert log.events[1][2] == {"failing": "redis: refused"}


def test_start_writes_at_once_close_removes_the_file_and_closes_the_checks(
        tmp_path: Path) -> None:
    path, closed = tmp_path / "r", []
    check = Check("broker", lambda: "up", close=lambda: closed.append("broker"))
    readiness = Readiness("gateway", [check], ReadyConfig(path, 0.05), Recorder())
    first = readiness.start()
    assert first.ready and read_report(path) == first
    deadline = time.monotonic() + 10
    while read_report(path).at == first.at:  # the loop rewrites it
        assert time.monotonic() < deadline, "the loop did not rewrite the file"
        time.sleep(0.02)
    readiness.close()
    assert not path.exists() and closed == ["broker"]


def test_a_file_that_cannot_be_written_stops_the_start_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "missing-dir" / "r"
    readiness = Readiness("gateway", [], ReadyConfig(path, 5.0), Recorder())
    with pytest.raises(ConfigError, match=r"^FEDHIVE_READY_FILE .*missing-dir/r: cannot write"):
        readiness.start()


def test_published_within_says_when_the_last_publish_is_too_old() -> None:
    last: list[float | None] = [None]
    check = published_within("heartbeats", lambda: last[0], 15.0, "heartbeat")
    with pytest.raises(NotReady, match=r"^no heartbeat published yet$"):
        check.probe()
    last[0] = time.monotonic()
    assert check.probe().startswith("heartbeat published ")
    last[0] = time.monotonic() - 100
    with pytest.raises(NotReady, match=r"^no heartbeat published for 10\ds \(limit 15s\)$"):
        check.probe()


# --- the compose probe -------------------------------------------------------------------------
def probe(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = healthcheck.main(["ready", *argv])
    out = capsys.readouterr()
    return code, (out.out + out.err).strip()


def test_the_probe_exits_0_only_for_a_fresh_ready_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ready"
    now = time.time()
    write_report(path, Report("job-store", {"broker": Outcome(True, "consuming")}, now, 5.0))
    assert probe(capsys, "--file", str(path)) == (0, "healthy: job-store ready: broker")
    write_report(path, Report("job-store", {"broker": Outcome(True, "consuming"),
                                            "redis": Outcome(False, "refused")}, now, 5.0))
    assert probe(capsys, "--file", str(path)) == (
        1, "unhealthy: job-store not ready: redis: refused")
    write_report(path, Report("job-store", {"broker": Outcome(True, "consuming")},
                              now - 600, 5.0))
    code, line = probe(capsys, "--file", str(path))
    assert code == 1 and line.startswith("unhealthy: job-store readiness is stale: last written ")
    path.unlink()
    assert probe(capsys, "--file", str(path)) == (
        1, f"unhealthy: no readiness file {path} (the service has not started, or has stopped)")
    path.write_text("garbage")
    code, line = probe(capsys, "--file", str(path))
    assert code == 1 and line.startswith(f"unhealthy: {path}: not JSON")


def test_the_probe_finds_a_service_file_where_the_service_writes_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "site.ready"
    monkeypatch.setenv("FEDHIVE_READY_FILE", str(path))
    assert ReadyConfig.for_service("site-agent", Settings.from_env()).path == path
    write_report(path, Report("site-agent", {"heartbeats": Outcome(False, "no heartbeat "
                                                                   "published for 40s")},
                              time.time(), 5.0))
    assert probe(capsys, "site-agent") == (
        1, "unhealthy: site-agent not ready: heartbeats: no heartbeat published for 40s")
    with pytest.raises(SystemExit):
        healthcheck.parse_args(["ready"])  # a service or --file, not neither


def test_a_service_with_a_bad_readiness_setting_stops_with_one_line() -> None:
    env = {"PATH": os.environ["PATH"], "FEDHIVE_READY_INTERVAL": "soon"}
    done = subprocess.run([sys.executable, "-m", "fedhive_services.job_store.main"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr == ("fedhive-job-store: FEDHIVE_READY_INTERVAL='soon' must be a number of "
                           "seconds above 0 (at most 3600)\n")
