"""FedAvg, Cyclic and CrossSiteModelEval end to end in-process (real TaskManager, fake sites as
threads, data through the codec and real S3)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from fedhive.blobs import TensorRef
from fedhive.errors import WorkflowFailed
from fedhive.fl.checkpoint import load_checkpoint
from fedhive.fl.dxo import DataKind, Dxo, MetaKey
from fedhive.fl.model import FLModel, ParamsType
from fedhive.fl.persistors import NumpyModelPersistor
from fedhive.fl.shareables import FullModelShareableGenerator
from fedhive.fl.tasks import Result, ReturnCode
from fedhive.fl.workflows import CrossSiteModelEval, Cyclic, FedAvg
from tests.fixtures.fl import FederationFactory

SIZE = 32


def components(initial: float = 0.0) -> dict[str, Any]:
    return {"persistor": NumpyModelPersistor(initial={"w": [initial] * SIZE}),
            "shareable_generator": FullModelShareableGenerator()}


def saved_w(path: Any) -> Any:
    with np.load(path) as saved:
        return saved["w"]


def diff_trainer(accuracy: Callable[[int], float]) -> Callable[[str, str, Dxo], Dxo]:
    """FLModel in, a DIFF of +1 out, with accuracy(round) as its metric."""
    def train(site: str, task: str, data: Dxo) -> Dxo:
        model = FLModel.from_dxo(data)
        assert model.params_type is ParamsType.FULL and model.current_round is not None
        out = FLModel(params={name: np.ones_like(value) for name, value in model.params.items()},
                      params_type=ParamsType.DIFF,
                      metrics={"accuracy": accuracy(model.current_round)},
                      meta={MetaKey.NUM_STEPS_CURRENT_ROUND: 10})
        return out.to_dxo()
    return train


def test_fedavg_samples_clients_adds_diffs_and_stops_on_its_condition(
        federation: FederationFactory) -> None:
    fed = federation(["a", "b", "c"], components())
    fed.start(diff_trainer(lambda r: 0.25 * (r + 1)))
    fed.run(FedAvg(num_clients=2, num_rounds=6, stop_cond="accuracy >= 0.75"))
    assert [r.round for r in fed.reports] == [0, 1, 2]  # 0.25, 0.5, 0.75: stop
    assert fed.reports[2].metrics["aggregate"] == {"accuracy": 0.75}
    per_round = [sorted(site for site in "abc" if any(
        r.data.meta[MetaKey.CURRENT_ROUND] == n for r in fed.received_by(site)))
        for n in range(3)]
    assert all(len(sites) == 2 for sites in per_round)
    np.testing.assert_allclose(saved_w(fed.ctx.workspace / "model.npz"), 3.0)
    checkpoint = load_checkpoint(fed.ctx, fed.ctx.job_id)
    assert checkpoint is not None and (checkpoint.workflow, checkpoint.round_) == ("FedAvg", 2)


def test_fedavg_patience_stops_when_the_metric_does_not_improve(
        federation: FederationFactory) -> None:
    fed = federation(["a", "b"], components())
    fed.start(diff_trainer(lambda r: 0.5))
    fed.run(FedAvg(num_clients=2, num_rounds=10, stop_cond="accuracy >= 0.9", patience=2))
    assert [r.round for r in fed.reports] == [0, 1, 2]


def test_fedavg_site_error_ends_the_workflow(federation: FederationFactory) -> None:
    fed = federation(["a", "b"], components())

    def train(site: str, task: str, data: Dxo) -> Dxo | Result:
        if site == "b":
            return Result(ReturnCode.EXECUTION_EXCEPTION, None, "out of memory")
        return diff_trainer(lambda r: 0.1)(site, task, data)

    fed.start(train)
    with pytest.raises(WorkflowFailed, match=r"the result of b is bad \(EXECUTION_EXCEPTION: "
                       r"out of memory\)"):
        fed.run(FedAvg(num_clients=2, num_rounds=3))


def plus_one(site: str, task: str, data: Dxo) -> Dxo:
    return Dxo(DataKind.WEIGHTS, {name: value + 1 for name, value in data.data.items()},
               {MetaKey.METRICS: {"loss": 1.0}})


def test_cyclic_relays_the_model_site_to_site_as_refs(federation: FederationFactory) -> None:
    fed = federation(["a", "b", "c"], components())
    fed.start(plus_one)
    fed.run(Cyclic(num_rounds=2))
    received = [r for r in fed.received if r.task == "train"]
    assert [r.site for r in received] == ["a", "b", "c", "a", "b", "c"]
    np.testing.assert_allclose(saved_w(fed.ctx.workspace / "model.npz"), 6.0)
    # Each site got the previous site's result as the very refs it sent: never re-packed.
    sent = list(fed.results.values())
    for before, after in zip(sent, received[1:], strict=False):
        ref, forwarded = before.data["w"], after.data.data["w"]
        assert isinstance(ref, TensorRef) and ref.key
        assert (forwarded.key, forwarded.checksum) == (ref.key, ref.checksum)
    assert [r.data.meta[MetaKey.CURRENT_ROUND] for r in received] == [0, 0, 0, 1, 1, 1]
    assert [sorted(r.metrics["sites"]) for r in fed.reports] == [["a", "b", "c"]] * 2
    checkpoint = load_checkpoint(fed.ctx, fed.ctx.job_id)
    assert checkpoint is not None and checkpoint.round_ == 1
    np.testing.assert_allclose(fed.materialized(checkpoint.model).data["w"], 6.0)


def test_cyclic_random_order_never_repeats_a_site_across_rounds(
        federation: FederationFactory) -> None:
    fed = federation(["a", "b", "c"], components())
    fed.start(plus_one)
    fed.run(Cyclic(num_rounds=6, order="RANDOM_WITHOUT_SAME_IN_A_ROW"))
    order = [r.site for r in fed.received if r.task == "train"]
    assert len(order) == 18
    assert all(sorted(order[i:i + 3]) == ["a", "b", "c"] for i in range(0, 18, 3))
    assert all(first != second for first, second in itertools.pairwise(order))


def test_cyclic_site_error_and_missing_listed_site_fail(federation: FederationFactory) -> None:
    fed = federation(["a", "b"], components())

    def broken(site: str, task: str, data: Dxo) -> Dxo:
        if site == "b":
            raise RuntimeError("disk full")
        return plus_one(site, task, data)

    fed.start(broken)
    with pytest.raises(WorkflowFailed, match=r"Result from b is bad \(EXECUTION_EXCEPTION: "
                       r"RuntimeError: disk full\)\. Cyclic exiting at round 0\."):
        fed.run(Cyclic(num_rounds=2))

    gone = federation(["a", "b", "c"], components())
    gone.start(plus_one)
    gone.kill("c")
    with pytest.raises(WorkflowFailed, match=r"Required client site \(c\) is not in active "
                       r"clients\."):
        gone.run(Cyclic(num_rounds=1, order=["a", "c"]))


def test_cyclic_early_termination_stops_after_the_round(federation: FederationFactory) -> None:
    fed = federation(["a", "b"], components())

    def stop_in_round_1(site: str, task: str, data: Dxo) -> Dxo | Result:
        if data.meta[MetaKey.CURRENT_ROUND] == 1 and site == "b":
            return Result(ReturnCode.EARLY_TERMINATION)
        return plus_one(site, task, data)

    fed.start(stop_in_round_1)
    fed.run(Cyclic(num_rounds=5, allow_early_termination=True))
    assert [r.round for r in fed.reports] == [0, 1]
    np.testing.assert_allclose(saved_w(fed.ctx.workspace / "model.npz"), 3.0)


def test_cross_site_eval_writes_every_model_at_every_site(federation: FederationFactory) -> None:
    fed = federation(["a", "b"], components(initial=0.5))
    own = {"a": 1.0, "b": 2.0}

    def site(name: str, task: str, data: Dxo) -> Dxo:
        if task == "submit_model":
            return Dxo(DataKind.WEIGHTS, {"w": np.full(SIZE, own[name], np.float32)})
        assert task == "validate"
        score = float(np.mean(data.data["w"])) + (0.25 if name == "b" else 0.0)
        return Dxo(DataKind.METRICS, {}, {MetaKey.METRICS: {"accuracy": score}})

    fed.start(site)
    fed.run(CrossSiteModelEval(persistor_id="persistor"))
    path = fed.ctx.workspace / "cross_site_val" / "cross_val_results.json"
    assert json.loads(path.read_text()) == {
        "a": {"a": {"accuracy": 1.0}, "b": {"accuracy": 1.25}},
        "b": {"a": {"accuracy": 2.0}, "b": {"accuracy": 2.25}},
        "SRV_persistor": {"a": {"accuracy": 0.5}, "b": {"accuracy": 0.75}},
    }
    validations = [r for r in fed.received if r.task == "validate"]
    assert sorted(r.data.meta[MetaKey.MODEL_OWNER] for r in validations) == [
        "SRV_persistor", "SRV_persistor", "a", "a", "b", "b"]
    # A site's model went to the validators as the refs it sent.
    submitted = {ref.checksum for dxo in fed.results.values() for ref in dxo.refs()}
    forwarded = {r.data.data["w"].checksum for r in validations
                 if r.data.meta[MetaKey.MODEL_OWNER] != "SRV_persistor"}
    assert forwarded <= submitted and len(forwarded) == 2


def test_cross_site_eval_records_a_failed_validation(federation: FederationFactory) -> None:
    fed = federation(["a", "b"], components())

    def site(name: str, task: str, data: Dxo) -> Dxo:
        if task == "submit_model":
            return Dxo(DataKind.WEIGHTS, {"w": np.zeros(SIZE, np.float32)})
        if name == "b":
            raise ValueError("no validation data")
        return Dxo(DataKind.METRICS, {}, {MetaKey.METRICS: {"accuracy": 0.5}})

    fed.start(site)
    fed.run(CrossSiteModelEval(cross_val_dir="eval"))
    results = json.loads((fed.ctx.workspace / "eval" / "cross_val_results.json").read_text())
    assert results["a"] == {"a": {"accuracy": 0.5},
                            "b": {"error": "EXECUTION_EXCEPTION: ValueError: no validation data"}}


class FailingPersistor(NumpyModelPersistor):
    """Saves until round `fail_at`, then the disk is full."""

    def __init__(self, fail_at: int) -> None:
        super().__init__(initial={"w": [0.0] * SIZE})
        self.fail_at = fail_at

    def save(self, ctx: Any, model: Dxo, round_: int) -> Any:
        if round_ >= self.fail_at:
            raise OSError(28, "No space left on device")
        return super().save(ctx, model, round_)


def test_a_round_write_that_fails_fails_the_workflow(federation: FederationFactory) -> None:
    """The round's writes run beside the next round; their failure still ends the workflow
    (at the next round's close, or at its end), with the write's error."""
    for fail_at, rounds in ((1, 5), (2, 3)):  # mid-job; the last round's own write
        fed = federation(["a", "b"], {**components(), "persistor": FailingPersistor(fail_at)})
        fed.start(plus_one)
        with pytest.raises(OSError, match="No space left on device"):
            fed.run(FedAvg(num_clients=2, num_rounds=rounds))
        assert [r.round for r in fed.reports] == list(range(fail_at + 1))
