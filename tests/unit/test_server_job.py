"""The server job's loading/running shell: components by import path, workflows in order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog

from fedhive.fl.components import ComponentError, build_component
from fedhive.fl.server_job import RoundReports, run_app
from fedhive.fl.workflow import RoundReport, WorkflowContext

FLOWS = '''
class Recorder:
    def __init__(self, name, sink=None):
        self.name = name
        self.sink = sink

    def prepare(self, ctx):
        ctx.components.setdefault("order", []).append(f"prepare {self.name}")
        if self.name == "bad":
            raise ValueError("workflow 'bad': aggregator_id names component 'x', which ...")

    def run(self, ctx):
        ctx.components.setdefault("order", []).append(self.name)
        if self.name == "stop":
            ctx.abort.set()
'''


def _app(tmp_path: Path, workflows: list[dict[str, Any]], components: Any = ()) -> Path:
    app = tmp_path / "app"
    (app / "config").mkdir(parents=True)
    (app / "custom").mkdir()
    (app / "custom" / "unit_flows.py").write_text(FLOWS)
    (app / "config" / "config_fed_server.json").write_text(json.dumps(
        {"format_version": 2, "components": list(components), "workflows": workflows}))
    return app


def _ctx(tmp_path: Path) -> WorkflowContext:
    return WorkflowContext(job_id="j1", sites=["site-1"], workspace=tmp_path,
                           log=structlog.get_logger())


def _wf(name: str) -> dict[str, Any]:
    return {"id": name, "path": "unit_flows.Recorder", "args": {"name": name}}


def test_workflows_run_in_order_and_stop_at_abort(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    run_app(_app(tmp_path, [_wf("a"), _wf("stop"), _wf("never")]), ctx)
    assert ctx.components["order"] == ["prepare a", "prepare stop", "prepare never", "a", "stop"]
    assert set(ctx.components) == {"a", "stop", "never", "order"}


def test_nested_components_are_built_first() -> None:
    built: dict[str, Any] = {}
    spec = {"id": "outer", "path": "fractions.Fraction",
            "args": {"numerator": {"id": "inner", "path": "builtins.int", "args": {}},
                     "denominator": 2}}
    assert build_component(spec, "components[0]", built) == 0
    assert built == {"inner": 0, "outer": 0}


@pytest.mark.parametrize(("spec", "message"), [
    ({"id": "t", "path": "nowhere.Thing"}, "component 't': cannot import 'nowhere.Thing'"),
    ({"id": "t", "path": "json.NoSuch"}, "component 't': cannot import 'json.NoSuch'"),
    ({"id": "t", "path": "json.JSONDecoder", "args": {"bogus": 1}},
     "component 't': bad arguments for json.JSONDecoder"),
    ({"id": "t", "path": "json.JSONDecoder", "args": []}, "component 't': args must be"),
    ({"id": "t", "path": "fractions.Fraction", "args": {"numerator": 1, "denominator": 0}},
     "component 't': fractions.Fraction raised ZeroDivisionError: Fraction\\(1, 0\\)"),
    ({"args": {}}, "workflows\\[2\\]: must be an object with a 'path'"),
])
def test_a_component_that_cannot_be_built_names_itself(spec: dict[str, Any], message: str,
                                                       ) -> None:
    with pytest.raises(ComponentError, match=message):
        build_component(spec, "workflows[2]", {})


def test_gone_sites_keep_the_first_reason(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    ctx.site_gone("site-1", "site went offline")
    ctx.site_gone("site-1", "site stopped reporting the job")
    assert ctx.gone_sites() == {"site-1": "site went offline"}


def test_every_workflow_is_prepared_before_any_runs(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    with pytest.raises(ValueError, match="workflow 'bad'"):
        run_app(_app(tmp_path, [_wf("a"), _wf("bad"), _wf("c")]), ctx)
    assert ctx.components["order"] == ["prepare a", "prepare bad"]  # nothing ran


def test_round_reports_accumulate_in_metrics_json(tmp_path: Path) -> None:
    reports = RoundReports("j1", tmp_path, None, structlog.get_logger())
    reports(RoundReport("FedAvg", 0, 2, {"aggregate": {"loss": np.float32(0.5)},
                                         "sites": {"site-1": {"n": np.int64(3)}}}))
    reports(RoundReport("FedAvg", 1, 2, {"aggregate": {"loss": 0.25}}))
    rounds = json.loads((tmp_path / "metrics.json").read_text())["rounds"]
    assert [(r["workflow"], r["round"], r["num_rounds"]) for r in rounds] == [
        ("FedAvg", 0, 2), ("FedAvg", 1, 2)]
    assert rounds[0]["metrics"] == {"aggregate": {"loss": 0.5}, "sites": {"site-1": {"n": 3}}}
    assert rounds[1]["time"] >= rounds[0]["time"] > 0
