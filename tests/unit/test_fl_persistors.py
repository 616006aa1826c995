"""Persistors, the full-model shareable generator and FLModel <-> Dxo."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import structlog
import torch

from fedhive.errors import InvalidArgument
from fedhive.fl.dxo import DataKind, Dxo, MetaKey
from fedhive.fl.model import FLModel, ParamsType
from fedhive.fl.persistors import NumpyModelPersistor, TorchModelPersistor
from fedhive.fl.shareables import FullModelShareableGenerator
from fedhive.fl.workflow import WorkflowContext


@pytest.fixture
def ctx(tmp_path: Path) -> WorkflowContext:
    return WorkflowContext(job_id="j1", sites=["a", "b"], workspace=tmp_path,
                           log=structlog.get_logger())


def test_numpy_persistor_initial_model_then_saved_model(ctx: WorkflowContext) -> None:
    persistor = NumpyModelPersistor(initial={"w": [[1, 2], [3, 4]], "b": 0.5}, dtype="float64")
    model = persistor.load(ctx)
    assert model.data_kind is DataKind.WEIGHTS
    assert model.data["w"].dtype == np.float64 and model.data["w"].shape == (2, 2)
    assert model.data["b"].shape == ()
    model.data["w"] += 10  # the loaded model is a copy: the initial one is untouched
    path = persistor.save(ctx, model, 3)
    assert path == ctx.workspace / "model.npz"
    with np.load(path) as saved:
        np.testing.assert_array_equal(saved["w"], [[11, 12], [13, 14]])
    # A later load (cross-site evaluation after training) sees the saved model.
    np.testing.assert_array_equal(persistor.load(ctx).data["w"], [[11, 12], [13, 14]])
    other = NumpyModelPersistor(initial={"w": [1]}, final_file="other.npz")
    assert other.load(ctx).data["w"].tolist() == [1.0]


def test_numpy_persistor_saves_torch_tensors_too(ctx: WorkflowContext) -> None:
    persistor = NumpyModelPersistor(final_file="out/final.npz")
    assert persistor.load(ctx).data == {}
    persistor.save(ctx, Dxo(DataKind.WEIGHTS, {"t": torch.arange(3.0)}), 0)
    with np.load(ctx.workspace / "out" / "final.npz") as saved:
        assert saved["t"].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize(("args", "field"), [
    ({"dtype": "floaty"}, "dtype"),
    ({"initial": [1, 2]}, "initial"),
    ({"initial": {"w": [[1, 2], [3]]}}, "initial"),
    ({"final_file": "../escape.npz"}, "final_file"),
    ({"final_file": "/abs.npz"}, "final_file"),
])
def test_numpy_persistor_bad_arguments(args: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        NumpyModelPersistor(**args)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_torch_persistor_round_trips_the_module_state(ctx: WorkflowContext) -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    persistor = TorchModelPersistor(model=net)
    model = persistor.load(ctx)
    assert sorted(model.data) == ["bias", "weight"]
    new = {"weight": np.ones((2, 3), np.float32), "bias": torch.zeros(2)}
    persistor.save(ctx, Dxo(DataKind.WEIGHTS, new), 1)
    assert torch.equal(net.weight.detach(), torch.ones(2, 3))
    state = torch.load(ctx.workspace / "model.pt", weights_only=True)
    assert torch.equal(state["bias"], torch.zeros(2))
    fresh = TorchModelPersistor(model=torch.nn.Linear(3, 2))
    assert torch.equal(fresh.load(ctx).data["weight"], torch.ones(2, 3))
    with pytest.raises(InvalidArgument, match=r"tensor 'weight' has shape \(3, 3\), the "
                       r"module's is \(2, 3\)"):
        persistor.save(ctx, Dxo(DataKind.WEIGHTS, {"weight": np.ones((3, 3), np.float32),
                                                   "bias": np.zeros(2, np.float32)}), 2)
    with pytest.raises(InvalidArgument, match=r"missing \['bias'\], unexpected \['b'\]"):
        persistor.save(ctx, Dxo(DataKind.WEIGHTS, {"weight": np.ones((2, 3), np.float32),
                                                   "b": np.zeros(2, np.float32)}), 2)
    assert torch.equal(net.weight.detach(), torch.ones(2, 3))  # refused before any copy


def test_torch_persistor_needs_a_module() -> None:
    with pytest.raises(InvalidArgument, match=r"torch\.nn\.Module") as caught:
        TorchModelPersistor(model={"path": "x"})
    assert caught.value.field == "model"


def test_persistor_refuses_a_lazy_model(ctx: WorkflowContext) -> None:
    from fedhive.blobs import TensorKind, TensorRef

    ref = TensorRef(name="w", dtype="float32", shape=(1,), kind=TensorKind.NUMPY, key="k",
                    length=4, checksum="sha256:00")
    with pytest.raises(InvalidArgument, match="materialized"):
        NumpyModelPersistor().save(ctx, Dxo(DataKind.WEIGHTS, {"w": ref}), 0)


def test_generator_weights_replace_named_arrays_and_diffs_add() -> None:
    gen = FullModelShareableGenerator()
    model = Dxo(DataKind.WEIGHTS, {"w": np.ones(2, np.float32), "bn": np.zeros(2, np.float32)},
                {"note": 1})
    task = gen.learnable_to_shareable(model)
    assert task.data_kind is DataKind.WEIGHTS and task.data.keys() == model.data.keys()
    updated = gen.shareable_to_learnable(
        Dxo(DataKind.WEIGHTS, {"w": np.full(2, 5.0, np.float32)}), model)
    assert updated.data["w"].tolist() == [5.0, 5.0] and updated.data["bn"] is model.data["bn"]
    diff = Dxo(DataKind.WEIGHT_DIFF, {"w": np.full(2, 0.5, np.float32)})
    added = gen.shareable_to_learnable(diff, model)
    assert added.data["w"].tolist() == [1.5, 1.5] and added.data["w"].dtype == np.float32
    assert added.meta == {"note": 1}
    torch_model = Dxo(DataKind.WEIGHTS, {"w": torch.ones(2)})
    assert gen.shareable_to_learnable(diff, torch_model).data["w"].tolist() == [1.5, 1.5]


@pytest.mark.parametrize(("dxo", "message"), [
    (Dxo(DataKind.WEIGHT_DIFF, {"x": np.ones(2)}), "lacks"),
    (Dxo(DataKind.WEIGHTS, {"w": np.ones(3)}), r"tensor 'w' has shape \(3,\)"),
    (Dxo(DataKind.WEIGHTS, {"w": np.ones(2, np.float32)}),
     "tensor 'w' has dtype float32, the model's is float64"),
    (Dxo(DataKind.WEIGHT_DIFF, {"w": np.ones(2, np.float16)}), "has dtype float16"),
    (Dxo(DataKind.METRICS, {}), "cannot update"),
])
def test_generator_rejects_what_cannot_update_the_model(dxo: Dxo, message: str) -> None:
    model = Dxo(DataKind.WEIGHTS, {"w": np.ones(2)})
    with pytest.raises(InvalidArgument, match=message):
        FullModelShareableGenerator().shareable_to_learnable(dxo, model)


def test_fl_model_dxo_round_trip() -> None:
    model = FLModel(params={"w": np.ones(2)}, params_type=ParamsType.DIFF, current_round=2,
                    total_rounds=5, metrics={"loss": 0.1},
                    meta={MetaKey.NUM_STEPS_CURRENT_ROUND: 8})
    dxo = model.to_dxo()
    assert dxo.data_kind is DataKind.WEIGHT_DIFF
    assert dxo.meta == {MetaKey.NUM_STEPS_CURRENT_ROUND: 8, "current_round": 2,
                        "total_rounds": 5, "metrics": {"loss": 0.1}}
    back = FLModel.from_dxo(Dxo(dxo.data_kind, dxo.data, {**dxo.meta, "current_round": 2.0}))
    assert back.params_type is ParamsType.DIFF and back.current_round == 2
    assert back.metrics == {"loss": 0.1} and back.meta == {MetaKey.NUM_STEPS_CURRENT_ROUND: 8}
    metrics_only = FLModel(params_type=None, metrics={"accuracy": 0.9}).to_dxo()
    assert metrics_only.data_kind is DataKind.METRICS
    assert FLModel.from_dxo(metrics_only).params_type is None
    with pytest.raises(InvalidArgument, match="whole number"):
        FLModel.from_dxo(Dxo(DataKind.WEIGHTS, {}, {"current_round": 1.5}))
    with pytest.raises(InvalidArgument, match="COLLECTION"):
        FLModel.from_dxo(Dxo(DataKind.COLLECTION, {}))
