"""`Session.metrics` and `fedhive metrics ID` through the real gateway and job-store: the rounds
a server job logged (written here the way `RoundReports` writes them), readable while the job
is not finished, by every role (as getting a job), with typed one-line errors."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fedhive.cli.main import app
from fedhive.errors import InvalidArgument, NotFound, Unauthenticated
from fedhive.sdk import RoundMetrics, Session
from fedhive.state.rounds import RoundLog
from tests.fixtures.gateway import ADMINS, GatewayProcess, GatewayStack
from tests.fixtures.job_store import job_zip

LogRound = Callable[[str, int, float], None]
runner = CliRunner()


@pytest.fixture
def log_round(gateway_stack: GatewayStack) -> Iterator[LogRound]:
    """`log_round(job_id, round, accuracy)`: what the job's server job appends each round."""
    log = RoundLog.from_settings(gateway_stack.settings)

    def append(job_id: str, index: int, accuracy: float) -> None:
        log.append(job_id, {
            "workflow": "sag", "round": index, "num_rounds": 3,
            "metrics": {"sites": {"site-1": {"accuracy": accuracy},
                                  "site-2": {"accuracy": accuracy}},
                        "aggregate": {"accuracy": accuracy, "loss": 1 - accuracy}},
            "at_ms": 1_700_000_000_000 + index * 1000,
        })

    yield append
    log.close()


def _cli(gateway: GatewayProcess, user: str, *args: str, home: Path) -> Any:
    env = {"HOME": str(home), "FEDHIVE_GATEWAY": gateway.address,
           "FEDHIVE_TOKEN": gateway.admins.tokens[user], "COLUMNS": "160"}
    return runner.invoke(app, list(args), env=env)


def test_metrics_while_the_job_is_not_finished(gateway: GatewayProcess,
                                               log_round: LogRound) -> None:
    with gateway.session("lead@a") as lead:
        job_id = lead.submit(job_zip("metrics-live")).job_id
        assert lead.metrics(job_id) == []
        log_round(job_id, 0, 0.5)
        log_round(job_id, 1, 0.75)
        rounds = lead.metrics(job_id)
    assert rounds[1] == RoundMetrics(
        "sag", 1, 3,
        {"sites": {"site-1": {"accuracy": 0.75}, "site-2": {"accuracy": 0.75}},
         "aggregate": {"accuracy": 0.75, "loss": 0.25}},
        1_700_000_001_000,
    )
    assert [r.aggregate["accuracy"] for r in rounds] == [0.5, 0.75]


@pytest.mark.parametrize("user", sorted(ADMINS))
def test_every_role_reads_metrics_as_it_gets_jobs(gateway: GatewayProcess,
                                                  log_round: LogRound, user: str) -> None:
    with gateway.session("lead@b") as owner:
        job_id = owner.submit(job_zip("metrics-view")).job_id
    log_round(job_id, 0, 0.6)
    with gateway.session(user) as session:
        session.get(job_id)  # allowed, so metrics must be too
        assert [r.round for r in session.metrics(job_id)] == [0]


def test_metrics_errors_are_typed(gateway: GatewayProcess) -> None:
    with gateway.session("member@a") as member:
        with pytest.raises(NotFound, match="job no-such-job not found"):
            member.metrics("no-such-job")
        with pytest.raises(InvalidArgument, match="job_id is required"):
            member.metrics(" ")
    with Session(gateway.address, "fh_not-a-token") as stranger, \
            pytest.raises(Unauthenticated, match="invalid bearer token"):
        stranger.metrics("no-such-job")


def test_cli_table_json_and_plot(gateway: GatewayProcess, log_round: LogRound,
                                 tmp_path: Path) -> None:
    with gateway.session("lead@a") as lead:
        job_id = lead.submit(job_zip("metrics-cli")).job_id
    for index, accuracy in enumerate((0.5, 0.7, 0.9)):
        log_round(job_id, index, accuracy)

    table = _cli(gateway, "member@a", "metrics", job_id, home=tmp_path)
    assert table.exit_code == 0, table.output
    rows = [[cell for cell in line.split() if cell != "│"]
            for line in table.stdout.splitlines() if " sag " in line]
    assert [row[0] for row in rows] == ["1/3", "2/3", "3/3"]
    assert rows[2] == ["3/3", "sag", "0.9", "0.1", "2"]  # round, workflow, accuracy, loss, sites

    as_json = _cli(gateway, "member@a", "metrics", job_id, "--json", home=tmp_path)
    assert as_json.exit_code == 0, as_json.output
    values = json.loads(as_json.stdout)
    assert values["id"] == job_id
    assert [r["aggregate"]["accuracy"] for r in values["rounds"]] == [0.5, 0.7, 0.9]
    assert values["rounds"][0]["at"] == "2023-11-14T22:13:20.000Z"

    picture = tmp_path / "curve.png"
    plotted = _cli(gateway, "member@a", "metrics", job_id, "--plot", str(picture),
                   home=tmp_path)
    assert plotted.exit_code == 0, plotted.output
    assert plotted.stdout.strip().endswith(f"Plot written to {picture}")
    assert picture.read_bytes().startswith(b"\x89PNG") and picture.stat().st_size > 1000

    missing = _cli(gateway, "member@a", "metrics", "no-such-job", home=tmp_path)
    assert missing.exit_code == 3
    assert missing.stderr == "error: job no-such-job not found\n"
