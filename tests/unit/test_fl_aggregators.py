"""Aggregators: in-time weighted averaging and collection, with the rejections and reasons."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from fedhive.errors import InvalidArgument
from fedhive.fl.aggregators import CollectAggregator, InTimeAccumulateWeightedAggregator
from fedhive.fl.dxo import DataKind, Dxo, MetaKey

STEPS = MetaKey.NUM_STEPS_CURRENT_ROUND


def weights(value: float, steps: float | None = None, kind: DataKind = DataKind.WEIGHTS,
            **extra: Any) -> Dxo:
    meta = {} if steps is None else {STEPS: steps}
    data = {"w": np.full(3, value, dtype=np.float32), **extra}
    return Dxo(kind, data, meta)


def test_weighted_by_steps_and_site_weights() -> None:
    agg = InTimeAccumulateWeightedAggregator(aggregation_weights={"a": 1.0, "b": 3.0})
    assert agg.accept("a", weights(1.0, steps=2)) == (True, "")
    assert agg.accept("b", weights(5.0, steps=2)) == (True, "")
    result = agg.aggregate()
    assert result.data_kind is DataKind.WEIGHTS
    # (1*2*1 + 3*2*5) / (2 + 6) = 4
    np.testing.assert_allclose(result.data["w"], 4.0)
    assert result.data["w"].dtype == np.float32
    assert result.meta["aggregated_sites"] == ["a", "b"]


def test_missing_steps_count_as_one_and_weigh_by_local_iter_off_ignores_them() -> None:
    agg = InTimeAccumulateWeightedAggregator()
    agg.accept("a", weights(0.0))
    agg.accept("b", weights(3.0, steps=2))
    np.testing.assert_allclose(agg.aggregate().data["w"], 2.0)  # (0*1 + 3*2) / 3
    plain = InTimeAccumulateWeightedAggregator(weigh_by_local_iter=False)
    plain.accept("a", weights(0.0, steps=100))
    plain.accept("b", weights(3.0, steps=2))
    np.testing.assert_allclose(plain.aggregate().data["w"], 1.5)


def test_wrong_data_kind_is_rejected_with_a_reason() -> None:
    agg = InTimeAccumulateWeightedAggregator(expected_data_kind="WEIGHTS")
    accepted, reason = agg.accept("a", weights(1.0, kind=DataKind.WEIGHT_DIFF))
    assert not accepted
    assert reason == "data kind WEIGHT_DIFF, expected WEIGHTS"
    assert agg.aggregate().data == {}


def test_duplicate_site_bad_steps_and_shape_mismatch_are_rejected() -> None:
    agg = InTimeAccumulateWeightedAggregator()
    assert agg.accept("a", weights(1.0))[0]
    assert agg.accept("a", weights(9.0)) == (
        False, "this round already has a result from the site")
    accepted, reason = agg.accept("b", weights(1.0, steps="many"))  # type: ignore[arg-type]
    assert not accepted and STEPS in reason
    assert agg.accept("c", weights(1.0, steps=0)) == (
        False, "aggregation weight 0.0 (must be > 0)")
    bad = Dxo(DataKind.WEIGHTS, {"w": np.zeros(4, np.float32)})
    accepted, reason = agg.accept("d", bad)
    assert not accepted and "shape (4,)" in reason
    np.testing.assert_allclose(agg.aggregate().data["w"], 1.0)  # only a's result counted
    assert agg.sites == ["a"]


def test_exclude_vars_and_per_array_counts() -> None:
    agg = InTimeAccumulateWeightedAggregator(exclude_vars="^bn\\.")
    with_extra = weights(2.0, b=np.ones(2))
    with_extra.data["bn.mean"] = np.ones(2)
    agg.accept("a", with_extra)
    agg.accept("b", weights(4.0))
    result = agg.aggregate()
    assert sorted(result.data) == ["b", "w"]
    np.testing.assert_allclose(result.data["w"], 3.0)
    np.testing.assert_allclose(result.data["b"], 1.0)  # only a sent it


def test_weight_diff_stays_a_diff_and_reset_starts_over() -> None:
    agg = InTimeAccumulateWeightedAggregator(expected_data_kind="WEIGHT_DIFF")
    agg.accept("a", weights(-1.0, kind=DataKind.WEIGHT_DIFF))
    agg.accept("b", weights(1.0, kind=DataKind.WEIGHT_DIFF))
    result = agg.aggregate()
    assert result.data_kind is DataKind.WEIGHT_DIFF
    np.testing.assert_allclose(result.data["w"], 0.0)
    agg.reset()
    assert agg.aggregate().data == {} and agg.sites == []
    assert agg.accept("a", weights(7.0, kind=DataKind.WEIGHT_DIFF))[0]


def test_integer_arrays_keep_their_dtype_and_torch_tensors_work() -> None:
    agg = InTimeAccumulateWeightedAggregator()
    agg.accept("a", Dxo(DataKind.WEIGHTS, {"n": np.array([2, 4]), "t": torch.ones(2)}))
    agg.accept("b", Dxo(DataKind.WEIGHTS, {"n": np.array([4, 8]), "t": torch.zeros(2)}))
    result = agg.aggregate()
    assert result.data["n"].dtype == np.int64 and result.data["n"].tolist() == [3, 6]
    assert isinstance(result.data["t"], torch.Tensor)
    assert result.data["t"].tolist() == [0.5, 0.5]


def test_lazy_results_must_be_materialized_first() -> None:
    from fedhive.blobs import TensorKind, TensorRef
    from fedhive.blobs.checksum import digest

    array = np.zeros(1, np.float32)
    ref = TensorRef(name="w", dtype="float32", shape=(1,), kind=TensorKind.NUMPY, length=4,
                    checksum=digest(array.view(np.uint8)), inline_data=array.tobytes())
    with pytest.raises(InvalidArgument, match="materialized"):
        InTimeAccumulateWeightedAggregator().accept("a", Dxo(DataKind.WEIGHTS, {"w": ref}))


def test_concurrent_accepts_are_all_counted() -> None:
    agg = InTimeAccumulateWeightedAggregator()
    sites = [f"s{i}" for i in range(16)]
    threads = [threading.Thread(target=agg.accept, args=(site, weights(float(i))))
               for i, site in enumerate(sites)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(agg.sites) == sorted(sites)
    np.testing.assert_allclose(agg.aggregate().data["w"], 7.5)


@pytest.mark.parametrize(("args", "field"), [
    ({"expected_data_kind": "COLLECTION"}, "expected_data_kind"),
    ({"aggregation_weights": {"a": "x"}}, "aggregation_weights"),
    ({"aggregation_weights": [1.0]}, "aggregation_weights"),
    ({"exclude_vars": "("}, "exclude_vars"),
    ({"weigh_by_local_iter": "yes"}, "weigh_by_local_iter"),
])
def test_bad_arguments_name_the_field(args: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        InTimeAccumulateWeightedAggregator(**args)  # type: ignore[arg-type]
    assert caught.value.field == field and field in str(caught.value)


def test_collect_aggregator_keeps_each_site_result() -> None:
    agg = CollectAggregator(expected_data_kind="METRICS")
    metrics = Dxo(DataKind.METRICS, {}, {"metrics": {"accuracy": 0.5}})
    assert agg.accept("a", metrics) == (True, "")
    assert agg.accept("b", weights(1.0)) == (False, "data kind WEIGHTS, expected METRICS")
    assert agg.accept("a", metrics)[0] is False
    assert agg.collected() == {"a": metrics}
    anything = CollectAggregator()
    anything.accept("a", weights(1.0))
    anything.accept("b", weights(2.0, steps=3))
    result = anything.aggregate()
    assert result.data_kind is DataKind.COLLECTION
    assert sorted(result.data) == ["a/w", "b/w"]
    assert result.meta["sites"]["b"] == {"data_kind": "WEIGHTS", "meta": {STEPS: 3}}
    anything.reset()
    assert anything.collected() == {}


def test_half_precision_is_averaged_in_float32_and_comes_back_in_its_dtype() -> None:
    agg = InTimeAccumulateWeightedAggregator()
    a = {"h": torch.tensor([1.0, 3.0], dtype=torch.bfloat16),
         "f": np.array([1.0, 2.0], np.float16)}
    b = {"h": torch.tensor([2.0, 4.0], dtype=torch.bfloat16),
         "f": np.array([2.0, 4.0], np.float16)}
    agg.accept("a", Dxo(DataKind.WEIGHTS, a))
    agg.accept("b", Dxo(DataKind.WEIGHTS, b))
    result = agg.aggregate().data
    assert result["h"].dtype == torch.bfloat16 and result["h"].tolist() == [1.5, 3.5]
    assert result["f"].dtype == np.float16 and result["f"].tolist() == [1.5, 3.0]


def test_bfloat16_rounding_is_torch_s() -> None:
    from fedhive.fl.model_store import from_compute

    values = np.concatenate([np.random.default_rng(0).standard_normal(10_000) * 1e3,
                             [np.inf, -np.inf, np.nan, 0.0, -0.0, 3.4e38]]).astype(np.float32)
    bits = from_compute(values, "bfloat16")
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy()
    nan = np.isnan(values)
    np.testing.assert_array_equal(bits.view(np.int16)[~nan], expected[~nan])
    assert torch.from_numpy(bits[nan].view(np.int16)).view(torch.bfloat16).isnan().all()


def test_results_must_fit_the_global_model_and_the_reason_names_round_site_tensor() -> None:
    agg = InTimeAccumulateWeightedAggregator()
    model = Dxo(DataKind.WEIGHTS, {"w": np.zeros(3, np.float32), "t": torch.zeros(2)})
    agg.begin_round(5, model)
    assert agg.accept("a", Dxo(DataKind.WEIGHTS, {"w": np.zeros(3, np.float64)})) == (
        False, "round 5 site a: tensor 'w' has dtype float64, the global model's is float32")
    assert agg.accept("a", Dxo(DataKind.WEIGHTS, {"t": torch.zeros(3)})) == (
        False, "round 5 site a: tensor 't' has shape (3,), the global model's is (2,)")
    assert agg.accept("a", Dxo(DataKind.WEIGHTS, {"w": [1.0, 2.0, 3.0]})) == (  # type: ignore
        False, "round 5 site a: tensor 'w' is a list, not an array")
    # a tensor the model lacks must match the first site's
    assert agg.accept("a", Dxo(DataKind.WEIGHTS, {"extra": np.ones(2, np.float32)}))[0]
    assert agg.accept("b", Dxo(DataKind.WEIGHTS, {"extra": np.ones(4, np.float32)})) == (
        False, "round 5 site b: tensor 'extra' has shape (4,), other sites sent (2,)")
    agg.begin_round(6, model)  # a new round forgets them all
    assert agg.sites == [] and agg.aggregate().data == {}


@pytest.mark.parametrize(("args", "field"), [
    ({"in_time_mb": -1}, "in_time_mb"),
    ({"stream_memory_mb": "lots"}, "stream_memory_mb"),
    ({"stream_workers": 0}, "stream_workers"),
])
def test_bad_streaming_arguments_name_the_field(args: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        InTimeAccumulateWeightedAggregator(**args)  # type: ignore[arg-type]
    assert caught.value.field == field
