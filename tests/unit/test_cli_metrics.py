"""`fedhive metrics ID` without a gateway: the JSON schema, the table, the plot file, the exit
codes, and the round metrics' serde. (Through the real gateway: test_gateway_metrics.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
from typer.testing import CliRunner

from fedhive.cli.connection import GatewayTarget
from fedhive.cli.main import app
from fedhive.cli.metrics import metric_names, metrics_json, plot_series, write_plot
from fedhive.errors import NotFound
from fedhive.jobs.metrics import (
    RoundMetrics,
    round_from_dict,
    round_from_proto,
    round_to_dict,
    round_to_proto,
)
from fedhive.jobs.record import JobMeta, JobRecord, Submitter
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import admin_pb2

runner = CliRunner()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
AT = 1_700_000_000_000


def _round(index: int, num_rounds: int = 3, workflow: str = "sag", **aggregate: Any
           ) -> RoundMetrics:
    sites = {"site-1": {"accuracy": 0.5, "loss": 1.0}, "site-2": {"accuracy": 0.7}}
    return RoundMetrics(workflow, index, num_rounds,
                        {"sites": sites, "aggregate": aggregate}, AT + index * 1000)


ROUNDS = [_round(0, accuracy=0.61, loss=1.25), _round(1, accuracy=0.8, loss=0.5),
          _round(2, accuracy=0.9125, loss=0.25, note="best")]


class FakeSession:
    """Stands in for `fedhive.sdk.Session`: answers `metrics` with fixed rounds, and `get` of
    job `j1` (or a prefix of it, any case: what the gateway resolves) with its record."""

    def __init__(self, rounds: list[RoundMetrics]) -> None:
        self.rounds = rounds
        self.asked: list[str] = []

    def get(self, job_id: str) -> JobRecord:
        if not "j1".startswith(job_id.lower()):
            raise NotFound(f"job {job_id} not found", field="job_id")
        return JobRecord("j1", JobMeta(name="n", deploy_map={}), JobStatus.RUNNING,
                         Submitter("alice", "a", "lead"), AT)

    def metrics(self, job_id: str) -> list[RoundMetrics]:
        self.asked.append(job_id)
        return self.rounds

    def __enter__(self) -> FakeSession:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        return None


@pytest.fixture
def answer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """`answer(rounds)`: the CLI's session answers those rounds; returns the fake session."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("FEDHIVE_GATEWAY", "127.0.0.1:9")
    monkeypatch.setenv("FEDHIVE_TOKEN", "x")

    def install(rounds: list[RoundMetrics]) -> FakeSession:
        session = FakeSession(rounds)
        monkeypatch.setattr(GatewayTarget, "open", lambda self: session)
        return session

    return install


def test_metrics_json_schema() -> None:
    values = metrics_json("j1", ROUNDS)
    assert list(values) == ["id", "rounds"] and values["id"] == "j1"
    first = values["rounds"][0]
    assert list(first) == ["workflow", "round", "num_rounds", "at", "aggregate", "sites"]
    assert first == {
        "workflow": "sag", "round": 0, "num_rounds": 3, "at": "2023-11-14T22:13:20.000Z",
        "aggregate": {"accuracy": 0.61, "loss": 1.25},
        "sites": {"site-1": {"accuracy": 0.5, "loss": 1.0}, "site-2": {"accuracy": 0.7}},
    }
    json.dumps(values)  # JSON-able as is
    assert metrics_json("j2", []) == {"id": "j2", "rounds": []}


def test_cli_json_prints_the_schema(answer: Any) -> None:
    session = answer(ROUNDS)
    result = runner.invoke(app, ["metrics", "j1", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == metrics_json("j1", ROUNDS)
    assert session.asked == ["j1"]


def test_cli_takes_a_prefix_and_names_the_full_id(answer: Any) -> None:
    session = answer(ROUNDS)
    result = runner.invoke(app, ["metrics", "J", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["id"] == "j1" and session.asked == ["j1"]
    unknown = runner.invoke(app, ["metrics", "x"])
    assert unknown.exit_code == 3 and unknown.stderr == "error: job x not found\n"


def test_cli_table_has_a_row_per_round_and_a_column_per_metric(answer: Any) -> None:
    answer(ROUNDS)
    result = runner.invoke(app, ["metrics", "j1"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(line for line in lines if "Round" in line)
    for column in ("Round", "Workflow", "accuracy", "loss", "note", "Sites"):
        assert column in header
    assert header.index("accuracy") < header.index("loss") < header.index("note")
    rows = [[cell for cell in line.split() if cell != "│"] for line in lines if "sag" in line]
    assert [row[0] for row in rows] == ["1/3", "2/3", "3/3"]
    assert rows[0] == ["1/3", "sag", "0.61", "1.25", "2"]  # no note: an empty cell
    assert rows[2] == ["3/3", "sag", "0.9125", "0.25", "best", "2"]
    assert metric_names(ROUNDS) == ["accuracy", "loss", "note"]


def test_cli_says_when_no_round_was_recorded(answer: Any) -> None:
    answer([])
    result = runner.invoke(app, ["metrics", "j1"])
    assert result.exit_code == 0 and result.stdout.strip() == "Job j1 has recorded no round yet."


def test_cli_plot_writes_a_png_and_says_where(answer: Any, tmp_path: Path) -> None:
    answer(ROUNDS)
    target = tmp_path / "curve.png"
    result = runner.invoke(app, ["metrics", "j1", "--plot", str(target)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().endswith(f"Plot written to {target}")
    data = target.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_cli_plot_with_json_keeps_stdout_json(answer: Any, tmp_path: Path) -> None:
    answer(ROUNDS)
    target = tmp_path / "curve.svg"
    result = runner.invoke(app, ["metrics", "j1", "--json", "--plot", str(target)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["id"] == "j1"
    assert result.stderr.strip() == f"Plot written to {target}"
    assert target.read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize(("rounds", "name", "message", "code"), [
    ([], "curve.png", "recorded no numeric aggregate metric: nothing to plot", 1),
    ([_round(0, note="text only")], "curve.png", "nothing to plot", 1),
    (ROUNDS, "curve.nope", "cannot write the plot", 2),  # a bad --plot: usage
    (ROUNDS, "missing-folder/curve.png", "cannot write the plot", 2),
])
def test_cli_plot_errors_are_one_line(answer: Any, tmp_path: Path, rounds: list[RoundMetrics],
                                      name: str, message: str, code: int) -> None:
    answer(rounds)
    result = runner.invoke(app, ["metrics", "j1", "--plot", str(tmp_path / name)])
    assert result.exit_code == code
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output


def test_plot_series_per_workflow_with_gaps(tmp_path: Path) -> None:
    rounds = [_round(0, workflow="sag", accuracy=0.5, loss=None),
              _round(1, workflow="sag", accuracy=0.75, loss=2.0),
              _round(0, num_rounds=1, workflow="eval", accuracy=0.7, flag=True)]
    series = plot_series(rounds)
    assert list(series) == ["sag: accuracy", "sag: loss", "eval: accuracy"]
    assert series["sag: accuracy"] == ([1, 2], [0.5, 0.75])
    xs, ys = series["sag: loss"]
    assert xs == [1, 2] and math.isnan(ys[0]) and ys[1] == 2.0  # null: a gap in the line
    assert plot_series([_round(0, loss=None)]) == {}  # nothing finite: no line
    target = tmp_path / "p.png"
    write_plot(target, "j1", series)
    assert target.read_bytes().startswith(PNG_MAGIC)


def test_round_metrics_round_trip() -> None:
    entry = _round(2, accuracy=0.9, count=12)
    wire = admin_pb2.RoundMetrics.FromString(round_to_proto(entry).SerializeToString())
    assert round_from_proto(wire) == entry
    assert round_from_dict(round_to_dict(entry)) == entry
    assert isinstance(round_from_proto(wire).aggregate["count"], int)  # whole numbers stay ints
    assert entry.aggregate == {"accuracy": 0.9, "count": 12} and set(entry.sites) == {
        "site-1", "site-2"}


def test_round_from_dict_reads_odd_entries_as_empty() -> None:
    odd = round_from_dict({"round": "x", "num_rounds": float("inf"), "metrics": [1, 2]})
    assert odd == RoundMetrics("", 0, 0, {}, 0)
    assert odd.aggregate == {} and odd.sites == {}
    other = RoundMetrics("w", 0, 1, {"aggregate": 5, "sites": {"s": 3}})
    assert other.aggregate == {} and other.sites == {"s": {}}
