"""structlog set-up: JSON lines for services, bound with the service name."""

import json

import pytest
import structlog

from fedhive.logging import configure


def test_service_logs_are_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    log = configure("scheduler", level="INFO", json=True)
    log.info("job dispatched", job_id="j1")
    log.debug("not shown at INFO")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["event"] == "job dispatched"
    assert record["service"] == "scheduler" and record["job_id"] == "j1"
    assert record["level"] == "info" and "timestamp" in record
    structlog.reset_defaults()


def test_cli_logs_are_readable(capsys: pytest.CaptureFixture[str]) -> None:
    configure("cli", json=False).warning("site offline", site="site-1")
    line = capsys.readouterr().err
    assert "site offline" in line and "site=site-1" in line
    structlog.reset_defaults()
