"""structlog set-up: JSON lines for services, bound with the service name."""

import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from fedhive.logging import configure


@pytest.fixture(autouse=True)
def restored() -> Iterator[None]:
    """`configure` sets up the process: undone after each test (root handlers, structlog)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers, root.level = handlers, level
    structlog.reset_defaults()


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


def test_cli_logs_are_readable(capsys: pytest.CaptureFixture[str]) -> None:
    configure("cli", json=False).warning("site offline", site="site-1")
    line = capsys.readouterr().err
    assert "site offline" in line and "site=site-1" in line


def test_library_lines_are_json_with_the_process_context_and_the_task(
        capsys: pytest.CaptureFixture[str]) -> None:
    """pika, boto3 or grpc lines (stdlib logging) come out as JSON like fedhive's own, with the
    job and site of the process and the task a thread bound."""
    configure("client-job", context={"job_id": "j1", "site": "site-1"})
    library = logging.getLogger("pika.adapters.blocking_connection")
    library.info("not shown: libraries log warnings and up")
    with structlog.contextvars.bound_contextvars(task_id="t7"):
        library.warning("Published message was returned: %s", "NO_ROUTE")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["event"] == "Published message was returned: NO_ROUTE"
    assert record["logger"] == "pika.adapters.blocking_connection"
    assert record["level"] == "warning" and "timestamp" in record
    assert (record["service"], record["job_id"], record["site"], record["task_id"]) == (
        "client-job", "j1", "site-1", "t7")
