"""ScatterAndGather end to end in-process: a real TaskManager, fake sites as threads, task data
and results through the codec and real S3; result errors, rejected results, a site that goes,
bad component references and resume from a checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from fedhive.errors import WorkflowFailed
from fedhive.fl.aggregators import InTimeAccumulateWeightedAggregator
from fedhive.fl.checkpoint import load_checkpoint
from fedhive.fl.components import ComponentError, build_component
from fedhive.fl.dxo import DataKind, Dxo, MetaKey
from fedhive.fl.persistors import NumpyModelPersistor
from fedhive.fl.shareables import FullModelShareableGenerator
from fedhive.fl.workflows import CrossSiteModelEval, Cyclic, FedAvg, ScatterAndGather
from tests.fixtures.fl import Federation, FederationFactory

STEPS = MetaKey.NUM_STEPS_CURRENT_ROUND
SIZE = 32  # 128 bytes of float32: past the fixture's inline threshold, so through S3


def components() -> dict[str, Any]:
    return {"aggregator": InTimeAccumulateWeightedAggregator(),
            "persistor": NumpyModelPersistor(initial={"w": [0.0] * SIZE, "b": [0.0, 0.0]}),
            "shareable_generator": FullModelShareableGenerator()}


def adder(amounts: dict[str, float], steps: dict[str, int] | None = None,
          ) -> Callable[[str, str, Dxo], Dxo]:
    """A trainer that adds its site's amount to every array and reports a loss."""
    def train(site: str, task: str, data: Dxo) -> Dxo:
        new = {name: value + np.float32(amounts[site]) for name, value in data.data.items()}
        meta = {STEPS: (steps or {}).get(site, 1), MetaKey.METRICS: {"loss": amounts[site]}}
        return Dxo(DataKind.WEIGHTS, new, meta)
    return train


def final_model(fed: Federation, name: str = "model.npz") -> dict[str, Any]:
    with np.load(fed.ctx.workspace / name) as saved:
        return {key: saved[key] for key in saved.files}


def sag(**args: Any) -> ScatterAndGather:
    args.setdefault("wait_time_after_min_received", 0)
    args.setdefault("persistor_id", "persistor")
    return ScatterAndGather(**args)


def test_scatter_and_gather_weighted_rounds_reports_and_checkpoint(
        federation: FederationFactory) -> None:
    fed = federation(["a", "b"], components())
    fed.start(adder({"a": 1.0, "b": 3.0}, steps={"a": 1, "b": 3}))
    fed.run(sag(min_clients=2, num_rounds=3))
    # each round: (1*1 + 3*3) / (1 + 3) = 2.5 added to the model
    model = final_model(fed)
    np.testing.assert_allclose(model["w"], 7.5)
    assert model["w"].dtype == np.float32 and model["w"].shape == (SIZE,)
    for site in ("a", "b"):
        got = fed.received_by(site, "train")
        assert [r.data.meta[MetaKey.CURRENT_ROUND] for r in got] == [0, 1, 2]
        assert all(r.data.meta[MetaKey.TOTAL_ROUNDS] == 3 for r in got)
        assert got[0].data.is_lazy  # the model went out as refs
    assert [(r.workflow, r.round, r.num_rounds) for r in fed.reports] == [
        ("ScatterAndGather", 0, 3), ("ScatterAndGather", 1, 3), ("ScatterAndGather", 2, 3)]
    assert fed.reports[0].metrics == {"sites": {"a": {"loss": 1.0}, "b": {"loss": 3.0}},
                                      "aggregate": {"loss": 2.5}}
    checkpoint = load_checkpoint(fed.ctx, fed.ctx.job_id)
    assert checkpoint is not None
    assert (checkpoint.workflow, checkpoint.round_, checkpoint.num_rounds) == (
        "ScatterAndGather", 2, 3)
    np.testing.assert_allclose(fed.materialized(checkpoint.model).data["w"], 7.5)


def failing_b(site: str, task: str, data: Dxo) -> Dxo:
    if site == "b":
        raise ValueError("bad batch")
    return adder({"a": 1.0})(site, task, data)


@pytest.mark.parametrize(("ignore", "min_clients"), [(True, 2), (None, 1)])
def test_result_errors_ignored_the_workflow_goes_on(
        federation: FederationFactory, ignore: bool | None, min_clients: int) -> None:
    fed = federation(["a", "b"], components())
    fed.start(failing_b)
    # An error counts as a response (as in FLARE): wait for both sites every round.
    fed.run(sag(min_clients=min_clients, num_rounds=2, ignore_result_error=ignore,
                wait_time_after_min_received=60))
    np.testing.assert_allclose(final_model(fed)["w"], 2.0)  # a's results only
    assert list(fed.reports[1].metrics["sites"]) == ["a"]


@pytest.mark.parametrize(("ignore", "min_clients"), [(False, 1), (None, 2)])
def test_result_error_not_ignored_fails_the_workflow(
        federation: FederationFactory, ignore: bool | None, min_clients: int) -> None:
    fed = federation(["a", "b"], components())
    fed.start(failing_b)
    with pytest.raises(WorkflowFailed, match=r"round 0: the result of b is an error "
                       r"\(EXECUTION_EXCEPTION: ValueError: bad batch\)"):
        fed.run(sag(min_clients=min_clients, num_rounds=2, ignore_result_error=ignore,
                    wait_time_after_min_received=60))
    assert fed.reports == []


def test_rejected_result_is_logged_with_its_reason_and_the_round_goes_on(
        federation: FederationFactory) -> None:
    def train(site: str, task: str, data: Dxo) -> Dxo:
        result = adder({"a": 1.0, "b": 5.0})(site, task, data)
        kind = DataKind.WEIGHT_DIFF if site == "b" else DataKind.WEIGHTS
        return Dxo(kind, result.data, result.meta)

    with capture_logs() as logs:
        fed = federation(["a", "b"], components())
        fed.start(train)
        fed.run(sag(min_clients=2, num_rounds=2))
    np.testing.assert_allclose(final_model(fed)["w"], 2.0)
    rejected = [entry for entry in logs if entry["event"] == "workflow.result_rejected"]
    assert [(entry["site"], entry["round"]) for entry in rejected] == [("b", 0), ("b", 1)]
    assert rejected[0]["reason"] == "data kind WEIGHT_DIFF, expected WEIGHTS"


def test_site_gone_mid_round_with_min_clients_met_completes(
        federation: FederationFactory) -> None:
    fed = federation(["a", "b", "c"], components())
    train = adder({"a": 1.0, "b": 1.0, "c": 100.0})

    def c_dies_in_round_1(site: str, task: str, data: Dxo) -> Dxo:
        if site == "c" and data.meta[MetaKey.CURRENT_ROUND] == 1:
            fed.kill("c")  # mid-round: its result never comes
        return train(site, task, data)

    fed.start(c_dies_in_round_1)
    # A long wait after min_clients: the round ends because c is gone, not by the timer.
    fed.run(sag(min_clients=2, num_rounds=3, wait_time_after_min_received=60))
    assert [r.data.meta[MetaKey.CURRENT_ROUND] for r in fed.received_by("c")] == [0, 1]
    assert sorted(fed.reports[1].metrics["sites"]) == ["a", "b"]
    assert sorted(fed.reports[2].metrics["sites"]) == ["a", "b"]
    # round 0: (1 + 1 + 100) / 3 = 34; rounds 1 and 2: +1 each
    np.testing.assert_allclose(final_model(fed)["w"], 36.0)


def test_site_gone_below_min_clients_fails(federation: FederationFactory) -> None:
    fed = federation(["a", "b"], components())
    train = adder({"a": 1.0, "b": 1.0})

    def b_dies(site: str, task: str, data: Dxo) -> Dxo:
        if site == "b" and data.meta[MetaKey.CURRENT_ROUND] == 1:
            fed.kill("b")
        return train(site, task, data)

    fed.start(b_dies)
    with pytest.raises(WorkflowFailed, match=r"round 1: fewer than min_clients \(2\) sites "
                       r"still responding \(gone: \['b'\]\)"):
        fed.run(sag(min_clients=2, num_rounds=3, wait_time_after_min_received=60))


@pytest.mark.parametrize(("workflow", "sites", "message"), [
    (sag(min_clients=1, aggregator_id="persistor"), ["a"],
     "workflow 'ScatterAndGather': aggregator_id names component 'persistor', a "
     "NumpyModelPersistor, not a Aggregator"),
    (sag(min_clients=1, shareable_generator_id="gen"), ["a"],
     "workflow 'ScatterAndGather': shareable_generator_id names component 'gen', which the "
     "server config does not define"),
    (sag(min_clients=3), ["a", "b"],
     "workflow 'ScatterAndGather': min_clients is 3 but the job has 2 site(s)"),
    (FedAvg(persistor_id="aggregator"), ["a"],
     "workflow 'FedAvg': persistor_id names component 'aggregator', a "
     "InTimeAccumulateWeightedAggregator, not a ModelPersistor"),
    (Cyclic(), ["a"], "workflow 'Cyclic': Not enough client sites."),
    (Cyclic(order=["a", "x"]), ["a", "b"],
     "workflow 'Cyclic': order names 'x', which is not a site of the job"),
    (CrossSiteModelEval(participating_clients=["z"]), ["a"],
     "workflow 'CrossSiteModelEval': participating_clients names 'z', which is not a site of "
     "the job"),
])
def test_bad_component_references_fail_at_prepare(
        federation: FederationFactory, workflow: Any, sites: list[str], message: str) -> None:
    fed = federation(sites, components())
    with pytest.raises(ComponentError) as caught:
        workflow.prepare(fed.ctx)
    assert str(caught.value) == message


@pytest.mark.parametrize(("path", "args", "field"), [
    ("ScatterAndGather", {"min_clients": 0}, "min_clients"),
    ("ScatterAndGather", {"ignore_result_error": "yes"}, "ignore_result_error"),
    ("FedAvg", {"stop_cond": "accuracy >>= 1"}, "stop_cond"),
    ("FedAvg", {"patience": 2}, "patience"),
    ("Cyclic", {"order": "SPIRAL"}, "order"),
    ("CrossSiteModelEval", {"cross_val_dir": "../out"}, "cross_val_dir"),
])
def test_bad_workflow_arguments_name_the_component_and_field(
        path: str, args: dict[str, Any], field: str) -> None:
    spec = {"id": "wf", "path": f"fedhive.fl.workflows.{path}", "args": args}
    with pytest.raises(ComponentError, match=f"component 'wf': .*{field}"):
        build_component(spec, "workflows[0]", {})


def test_resume_starts_at_the_round_after_the_checkpoint_with_its_model(
        federation: FederationFactory) -> None:
    crashed = federation(["a", "b"], components())
    train = adder({"a": 1.0, "b": 1.0})

    def abort_in_round_2(site: str, task: str, data: Dxo) -> Dxo:
        if data.meta[MetaKey.CURRENT_ROUND] == 2:
            crashed.ctx.abort.set()  # the job dies during round 2
        return train(site, task, data)

    crashed.start(abort_in_round_2)
    crashed.run(sag(min_clients=2, num_rounds=4))
    assert [r.round for r in crashed.reports] == [0, 1]

    resumed = federation(["a", "b"], components(), resume_from=crashed.ctx.job_id)
    resumed.start(train)
    resumed.run(sag(min_clients=2, num_rounds=4))
    assert [r.round for r in resumed.reports] == [2, 3]
    first = resumed.received_by("a", "train")[0]
    assert first.data.meta[MetaKey.CURRENT_ROUND] == 2
    assert first.arrays is not None
    np.testing.assert_allclose(first.arrays.data["w"], 2.0)
    np.testing.assert_allclose(final_model(resumed)["w"], 4.0)
    checkpoint = load_checkpoint(resumed.ctx, resumed.ctx.job_id)
    assert checkpoint is not None and checkpoint.round_ == 3
