"""Large models on the server, in real S3: the streaming weighted aggregation (every dtype, both
modes), results that do not fit or cannot be read, the global model kept as refs, round objects
deleted (50 rounds, constant count), resume after the old job's objects are gone, and the
persistors writing a lazy model tensor by tensor."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from fedhive.blobs import TensorRef
from fedhive.fl.aggregators import InTimeAccumulateWeightedAggregator
from fedhive.fl.checkpoint import checkpoint_keys, load_checkpoint
from fedhive.fl.dxo import DataKind, Dxo, MetaKey
from fedhive.fl.model_store import ModelStore, TensorSpec
from fedhive.fl.persistors import NumpyModelPersistor, TorchModelPersistor
from fedhive.fl.shareables import FullModelShareableGenerator
from fedhive.fl.tasks import Result, ReturnCode
from fedhive.fl.workflows import Cyclic, FedAvg, ScatterAndGather
from tests.fixtures.fl import Federation, FederationFactory

STEPS = MetaKey.NUM_STEPS_CURRENT_ROUND
N = 1024  # elements per tensor: past the fixture's 64-byte inline threshold


def arrays(seed: int, n: int = N) -> dict[str, Any]:
    """One tensor of each dtype the aggregator must average, of `n` elements."""
    rng = np.random.default_rng(seed)
    return {
        "f32": rng.standard_normal(n).astype(np.float32),
        "f64": rng.standard_normal((8, n // 8)),
        "f16": rng.standard_normal(n).astype(np.float16),
        "i64": rng.integers(-1000, 1000, n),
        "flags": rng.random(n) > 0.5,
        "t32": torch.from_numpy(rng.standard_normal(n).astype(np.float32)),
        "tbf16": torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(torch.bfloat16),
    }


def expected_average(results: list[tuple[dict[str, Any], float]], name: str) -> Any:
    """The weighted average computed plainly, in float64, cast like the aggregator does."""
    values = [(r[name].float().numpy() if isinstance(r[name], torch.Tensor) else r[name], w)
              for r, w in results]
    mean = sum(np.asarray(v, np.float64) * w for v, w in values) / sum(w for _, w in values)
    return mean


@pytest.mark.parametrize("n", [N, 8], ids=["stored", "inline"])
def test_streamed_and_in_time_aggregation_agree_bit_for_bit_for_every_dtype(
        federation: FederationFactory, n: int) -> None:
    fed = federation(["a", "b"], {})
    models = ModelStore.of(fed.ctx)
    model = models.pack(arrays(0, n).items())
    sent = {site: (arrays(seed, n), steps) for site, seed, steps in (("a", 1, 1), ("b", 2, 3))}
    assert {ref.is_inline for ref in fed.pack(sent["a"][0])} == {n == 8}
    aggregates = []
    for in_time_mb in (32, 0):  # in time; streamed
        aggregator = InTimeAccumulateWeightedAggregator(in_time_mb=in_time_mb,
                                                        stream_workers=2)
        aggregator.bind(models)
        aggregator.begin_round(0, model)
        for site, (values, steps) in sent.items():
            result = Dxo(DataKind.WEIGHTS, dict(zip(values, fed.pack(values), strict=True)),
                         {STEPS: steps})
            assert aggregator.accept(site, result) == (True, "")
        aggregate = aggregator.aggregate()
        assert aggregate.is_lazy and aggregate.meta == {"aggregated_sites": ["a", "b"]}
        assert all((ref.is_inline if n == 8 else ref.key.startswith(fed.ctx.tensor_prefix))
                   and not ref.url for ref in aggregate.refs())
        aggregates.append(fed.materialized(aggregate).data)
    in_time, streamed = aggregates
    for name, value in in_time.items():
        spec, got = TensorSpec.of(name, model.data[name]), streamed[name]
        assert TensorSpec.of(name, value) == spec == TensorSpec.of(name, got)
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, got)
            value = value.float().numpy()
        else:
            np.testing.assert_array_equal(value, got)
        mean = expected_average(list(sent.values()), name)
        if name == "flags":
            np.testing.assert_array_equal(value, mean != 0)
        elif name == "i64":
            np.testing.assert_array_equal(value, mean.astype(np.int64))
        else:
            tolerance = {"f16": 2e-3, "tbf16": 1e-2}.get(name, 1e-6)
            np.testing.assert_allclose(value, mean, rtol=tolerance, atol=tolerance)


def test_a_tensor_every_site_sent_unchanged_is_the_model_s_own_object(
        federation: FederationFactory) -> None:
    fed = federation(["a", "b"], {})
    models = ModelStore.of(fed.ctx)
    frozen = np.arange(N, dtype=np.float32)
    model = models.pack({"frozen": frozen, "w": np.zeros(N, np.float32)}.items())
    aggregator = InTimeAccumulateWeightedAggregator(in_time_mb=0)
    aggregator.bind(models)
    aggregator.begin_round(4, model)
    for site, value in (("a", 1.0), ("b", 3.0)):
        refs = fed.pack({"frozen": frozen.copy(), "w": np.full(N, value, np.float32)})
        aggregator.accept(site, Dxo(DataKind.WEIGHTS, {ref.name: ref for ref in refs}))
    aggregate = aggregator.aggregate()
    kept = aggregate.data["frozen"]
    assert isinstance(kept, TensorRef)
    assert (kept.key, kept.checksum) == (model.data["frozen"].key, model.data["frozen"].checksum)
    np.testing.assert_array_equal(fed.materialized(aggregate).data["w"], 2.0)


def test_inline_bytes_falsely_labelled_unchanged_are_averaged_as_what_they_are(
        federation: FederationFactory) -> None:
    """A site labels other inline bytes with the unchanged tensor's checksum: the pass-through
    checks the label, so the tensor is not taken unread as the unchanged one; it is averaged,
    the liar's bytes as the values they are (as they would be under their true label)."""
    fed = federation(["a", "b"], {})
    models = ModelStore.of(fed.ctx)
    frozen = np.arange(8, dtype=np.float32)  # 32 bytes: inline (the fixture's threshold is 64)
    model = models.pack({"frozen": frozen, "w": np.zeros(N, np.float32)}.items())
    aggregator = InTimeAccumulateWeightedAggregator(in_time_mb=0)  # streamed: "w" is stored
    aggregator.bind(models)
    aggregator.begin_round(2, model)
    for site, value in (("a", 1.0), ("b", 3.0)):
        refs = {ref.name: ref for ref in fed.pack({"frozen": frozen.copy(),
                                                   "w": np.full(N, value, np.float32)})}
        assert refs["frozen"].is_inline and not refs["w"].is_inline
        if site == "a":  # the same label on other bytes
            refs["frozen"] = replace(refs["frozen"],
                                     inline_data=np.full(8, 666, np.float32).tobytes())
        assert aggregator.accept(site, Dxo(DataKind.WEIGHTS, refs)) == (True, "")
    aggregate = fed.materialized(aggregator.aggregate())
    assert aggregator.failed == {} and aggregator.sites == ["a", "b"]
    np.testing.assert_array_equal(aggregate.data["frozen"], (666 + frozen) / 2)
    np.testing.assert_array_equal(aggregate.data["w"], 2.0)


def test_results_that_do_not_fit_the_global_model_are_rejected_naming_job_round_site_tensor(
        federation: FederationFactory) -> None:
    fed = federation(["a"], {})
    models = ModelStore.of(fed.ctx)
    model = models.pack({"w": np.zeros((4, 8), np.float32)}.items())
    aggregator = InTimeAccumulateWeightedAggregator(in_time_mb=0)
    aggregator.bind(models)
    aggregator.begin_round(7, model)
    where = f"job {fed.ctx.job_id} round 7 site a"
    for value, problem in [
        (np.zeros((8, 4), np.float32), "has shape (8, 4), the global model's is (4, 8)"),
        (np.zeros((4, 8), np.float64), "has dtype float64, the global model's is float32"),
        (torch.zeros((4, 8), dtype=torch.bfloat16),
         "has dtype bfloat16, the global model's is float32"),
    ]:
        (ref,) = fed.pack({"w": value})
        assert aggregator.accept("a", Dxo(DataKind.WEIGHTS, {"w": ref})) == (
            False, f"{where}: tensor 'w' {problem}")
    assert aggregator.aggregate().data == {} and aggregator.sites == []


def corrupting(victim: str, how: str, fed: Federation) -> Any:
    """Sites add their weight to the model; `victim`'s result object then goes bad."""
    amounts = {"a": 1.0, "b": 3.0, "c": 100.0}

    def train(site: str, task: str, data: Dxo) -> Dxo:
        new = {name: np.full(N, amounts[site], np.float32)
               + fed.fetch(ref) for name, ref in data.data.items()}
        refs = {ref.name: ref for ref in fed.pack(new)}
        if site == victim:
            store = fed.ctx.store
            assert store is not None
            key = refs["w2"].key
            if how == "missing":
                store.delete(key)
            else:
                store.put(key, np.full(N, 7.0, np.float32).tobytes())  # same size, other bytes
        return Dxo(DataKind.WEIGHTS, refs, {STEPS: 1})
    return train


@pytest.mark.parametrize("in_time_mb", [32, 0], ids=["in_time", "streamed"])
@pytest.mark.parametrize("how", ["missing", "corrupt"])
def test_an_unreadable_result_fails_its_site_and_the_round_goes_on_without_it(
        federation: FederationFactory, in_time_mb: float, how: str) -> None:
    components = {
        "aggregator": InTimeAccumulateWeightedAggregator(in_time_mb=in_time_mb),
        # w1 and w2 of other contents, so that the victim spoils one object only
        "persistor": NumpyModelPersistor(initial={"w1": [0.0] * N, "w2": [0.5] * N}),
        "shareable_generator": FullModelShareableGenerator()}
    fed = federation(["a", "b", "c"], components)
    fed.start(corrupting("c", how, fed), lazy=True)
    with capture_logs() as logs:
        fed.run(ScatterAndGather(min_clients=2, num_rounds=2, persistor_id="persistor",
                                 wait_time_after_min_received=60))
    with np.load(fed.ctx.workspace / "model.npz") as saved:  # c's 100s never got in
        np.testing.assert_array_equal(saved["w1"], 4.0)
        np.testing.assert_array_equal(saved["w2"], 4.5)
    errors = [entry for entry in logs if entry["event"] == "workflow.result_error_ignored"]
    assert [(entry["site"], entry["round"]) for entry in errors] == [("c", 0), ("c", 1)]
    error = errors[0]["error"]
    assert "\n" not in error
    assert f"job {fed.ctx.job_id} round 0 site c" in error and "tensor 'w2'" in error
    assert ("not found" if how == "missing" else "do not match checksum") in error
    assert [sorted(report.metrics["sites"]) for report in fed.reports] == [["a", "b"]] * 2
    # What the failed attempt of a streamed aggregate stored is collected with the rest.
    checkpoint = load_checkpoint(fed.ctx, fed.ctx.job_id)
    assert checkpoint is not None
    assert set(fed.objects()) == {ref.key for ref in checkpoint.model.refs()}


def test_an_unreadable_result_below_min_clients_fails_the_workflow(
        federation: FederationFactory) -> None:
    components = {
        "aggregator": InTimeAccumulateWeightedAggregator(in_time_mb=0),
        "persistor": NumpyModelPersistor(initial={"w1": [0.0] * N, "w2": [0.5] * N}),
        "shareable_generator": FullModelShareableGenerator()}
    fed = federation(["a", "c"], components)
    fed.start(corrupting("c", "corrupt", fed), lazy=True)
    from fedhive.errors import WorkflowFailed

    with pytest.raises(WorkflowFailed, match=r"round 0: the result of c is an error \(job "
                       rf"{fed.ctx.job_id} round 0 site c: tensor 'w2'"):
        fed.run(ScatterAndGather(min_clients=2, num_rounds=2, persistor_id="persistor",
                                 wait_time_after_min_received=60))
    assert fed.reports == []


def frozen_and_trained(fed: Federation) -> Any:
    """A trainer that leaves "frozen" as it got it (sends the same ref back) and adds its
    amount to the rest, reading and writing one tensor at a time."""
    amounts = {"a": 1.0, "b": 3.0}

    def train(site: str, task: str, data: Dxo) -> Dxo:
        out: dict[str, Any] = {}
        for name, ref in data.data.items():
            if name == "frozen":
                out[name] = ref
            else:
                (out[name],) = fed.pack({name: fed.fetch(ref) + np.float32(amounts[site])})
        return Dxo(DataKind.WEIGHTS, out, {STEPS: 1, MetaKey.METRICS: {"loss": amounts[site]}})
    return train


def large_components(**aggregator: Any) -> dict[str, Any]:
    initial = {"frozen": list(range(N)), "w1": [0.0] * N, "w2": [1000.0] * N,
               "w3": [2000.0] * N, "bias": [0.0]}  # contents of their own; "bias" is inline
    return {"aggregator": InTimeAccumulateWeightedAggregator(**aggregator),
            "persistor": NumpyModelPersistor(initial=initial),
            "shareable_generator": FullModelShareableGenerator()}


@pytest.mark.parametrize(("in_time_mb", "rounds"), [(0, 50), (32, 10)],
                         ids=["streamed", "in_time"])
def test_fifty_rounds_keep_a_constant_number_of_objects(
        federation: FederationFactory, in_time_mb: float, rounds: int) -> None:
    fed = federation(["a", "b"], large_components(in_time_mb=in_time_mb))
    counts: list[int] = []
    reports = fed.ctx.report_round

    def count(report: Any) -> None:
        counts.append(len(fed.objects()))
        reports(report)

    fed.ctx.report_round = count
    fed.start(frozen_and_trained(fed), lazy=True)
    fed.run(ScatterAndGather(min_clients=2, num_rounds=rounds, persistor_id="persistor",
                             wait_time_after_min_received=0))
    assert len(fed.reports) == rounds
    # Bounded, not growing: the model (frozen, w1, w2, w3; "bias" is inline), the previous
    # model's w1, w2, w3 (deleted at the next round's close, once the checkpoint naming the new
    # ones is written) and, as reports are written while the next round runs, what the two
    # sites may have uploaded for it already.
    assert max(counts) <= 4 + 3 + 2 * 3
    checkpoint = load_checkpoint(fed.ctx, fed.ctx.job_id)
    assert checkpoint is not None and set(fed.objects()) == checkpoint_keys(fed.ctx)
    final = fed.materialized(checkpoint.model).data
    np.testing.assert_array_equal(final["frozen"], np.arange(N, dtype=np.float32))
    np.testing.assert_array_equal(final["w1"], 2.0 * rounds)  # +2 a round
    with np.load(fed.ctx.workspace / "model.npz") as saved:
        np.testing.assert_array_equal(saved["w3"], 2000.0 + 2 * rounds)
    # Every round's task carried the same object for the frozen tensor: uploaded once.
    keys = {r.data.data["frozen"].key for r in fed.received}
    assert len(keys) == 1


def test_a_checkpoint_that_lags_keeps_its_objects_and_a_crash_resumes_from_it(
        federation: FederationFactory) -> None:
    crashed = federation(["a", "b"], large_components(in_time_mb=0))
    train = frozen_and_trained(crashed)

    def crash_in_round_4(site: str, task: str, data: Dxo) -> Dxo | Result:
        if data.meta[MetaKey.CURRENT_ROUND] == 4:
            crashed.ctx.abort.set()  # the job dies: its sites upload nothing more
            return Result(ReturnCode.TASK_ABORTED)
        return train(site, task, data)

    crashed.start(crash_in_round_4, lazy=True)
    crashed.run(ScatterAndGather(min_clients=2, num_rounds=10, persistor_id="persistor",
                                 wait_time_after_min_received=0, snapshot_every_n_rounds=3))
    assert [r.round for r in crashed.reports] == [0, 1, 2, 3]
    checkpoint = load_checkpoint(crashed.ctx, crashed.ctx.job_id)
    assert checkpoint is not None and checkpoint.round_ == 2  # rounds 3 and 4 not snapshotted
    # Kept although the model had moved on; the rest (the round-3 model, round 4's results)
    # was deleted when the workflow stopped.
    assert set(crashed.objects()) == checkpoint_keys(crashed.ctx)
    assert len(checkpoint_keys(crashed.ctx)) == 4

    resumed = federation(["a", "b"], large_components(in_time_mb=0),
                         resume_from=crashed.ctx.job_id)
    resumed_train = frozen_and_trained(resumed)

    def forget_the_old_job(site: str, task: str, data: Dxo) -> Dxo:
        # The old job's refs were copied in at the start: deleting the old job breaks nothing.
        assert all(ref.is_inline or ref.key.startswith(resumed.ctx.tensor_prefix)
                   for ref in data.refs())
        if data.meta[MetaKey.CURRENT_ROUND] == 3 and site == "a":
            assert resumed.ctx.store is not None
            resumed.ctx.store.delete_prefix(crashed.ctx.tensor_prefix)
        return resumed_train(site, task, data)

    before = set(crashed.objects())
    resumed.start(forget_the_old_job, lazy=True)
    resumed.run(ScatterAndGather(min_clients=2, num_rounds=5, persistor_id="persistor",
                                 wait_time_after_min_received=0))
    assert [r.round for r in resumed.reports] == [3, 4]
    assert before and crashed.objects() == []  # only the test deleted them
    with np.load(resumed.ctx.workspace / "model.npz") as saved:
        np.testing.assert_array_equal(saved["w1"], 10.0)  # rounds 0-2 and 3-4: +2 each
        np.testing.assert_array_equal(saved["frozen"], np.arange(N, dtype=np.float32))


def test_the_new_job_never_deletes_the_old_job_s_objects_and_can_resume_twice(
        federation: FederationFactory) -> None:
    crashed = federation(["a", "b"], large_components())
    train = frozen_and_trained(crashed)

    def crash_in_round_1(site: str, task: str, data: Dxo) -> Dxo:
        if data.meta[MetaKey.CURRENT_ROUND] == 1:
            crashed.ctx.abort.set()
        return train(site, task, data)

    crashed.start(crash_in_round_1, lazy=True)
    crashed.run(ScatterAndGather(min_clients=2, num_rounds=3, persistor_id="persistor",
                                 wait_time_after_min_received=0))
    old = crashed.objects()
    for _ in range(2):
        again = federation(["a", "b"], large_components(), resume_from=crashed.ctx.job_id)
        again.start(frozen_and_trained(again), lazy=True)
        again.run(ScatterAndGather(min_clients=2, num_rounds=3, persistor_id="persistor",
                                   wait_time_after_min_received=0))
        assert [r.round for r in again.reports] == [1, 2]
        assert crashed.objects() == old
        with np.load(again.ctx.workspace / "model.npz") as saved:
            np.testing.assert_array_equal(saved["w2"], 1006.0)


def test_fedavg_and_cyclic_keep_the_model_as_refs_and_collect_round_objects(
        federation: FederationFactory) -> None:
    fed = federation(["a", "b"], large_components())
    fed.start(frozen_and_trained(fed), lazy=True)
    fed.run(FedAvg(num_clients=2, num_rounds=4), Cyclic(num_rounds=3))
    checkpoint = load_checkpoint(fed.ctx, fed.ctx.job_id)
    assert checkpoint is not None and checkpoint.workflow == "Cyclic"
    assert set(fed.objects()) == checkpoint_keys(fed.ctx)
    with np.load(fed.ctx.workspace / "model.npz") as saved:
        # FedAvg: +2 a round for 4 rounds; Cyclic: a then b, 3 rounds: +4 a round
        np.testing.assert_array_equal(saved["w1"], 20.0)


def test_a_lazy_weight_diff_is_added_tensor_by_tensor(federation: FederationFactory) -> None:
    fed = federation(["a"], {})
    models = ModelStore.of(fed.ctx)
    generator = FullModelShareableGenerator()
    generator.bind(models)
    model = models.pack({"w": np.ones(N, np.float32),
                         "h": torch.ones(N, dtype=torch.bfloat16)}.items())
    diff = Dxo(DataKind.WEIGHT_DIFF, {ref.name: ref for ref in fed.pack(
        {"w": np.full(N, 0.5, np.float32), "h": torch.full((N,), 0.25, dtype=torch.bfloat16)})})
    updated = generator.shareable_to_learnable(diff, model)
    assert updated.is_lazy
    values = fed.materialized(updated).data
    np.testing.assert_array_equal(values["w"], 1.5)
    assert values["h"].dtype == torch.bfloat16 and torch.equal(values["h"],
                                                               torch.full((N,), 1.25).bfloat16())


def test_persistors_load_refs_and_save_a_lazy_model_tensor_by_tensor(
        federation: FederationFactory) -> None:
    fed = federation(["a"], {})
    numpy_persistor = NumpyModelPersistor(initial={"w": [1.0] * N, "b": [2.0]})
    loaded = numpy_persistor.load(fed.ctx)
    assert loaded.is_lazy and loaded.data["b"].is_inline and not loaded.data["w"].is_inline
    models = ModelStore.of(fed.ctx)
    lazy = models.pack({"w": np.full(N, 3.0, np.float32),
                        "h": torch.full((N,), 1.5, dtype=torch.bfloat16)}.items())
    numpy_persistor.save(fed.ctx, lazy, 0)
    with np.load(fed.ctx.workspace / "model.npz") as saved:
        np.testing.assert_array_equal(saved["w"], 3.0)
        assert saved["h"].dtype == np.uint16  # bfloat16 kept as its bits
        assert torch.equal(torch.from_numpy(saved["h"].astype(np.int16)).view(torch.bfloat16),
                           torch.full((N,), 1.5, dtype=torch.bfloat16))
    assert fed.materialized(numpy_persistor.load(fed.ctx)).data["w"].tolist() == [3.0] * N

    net = torch.nn.Linear(N, 2)
    torch_persistor = TorchModelPersistor(model=net, final_file="net.pt")
    state = models.pack({"weight": torch.full((2, N), 0.5), "bias": torch.ones(2)}.items())
    torch_persistor.save(fed.ctx, state, 1)
    assert torch.equal(net.weight.detach(), torch.full((2, N), 0.5))
    saved_state = torch.load(fed.ctx.workspace / "net.pt", weights_only=True)
    assert torch.equal(saved_state["bias"], torch.ones(2))
    fresh = TorchModelPersistor(model=torch.nn.Linear(N, 2), final_file="net.pt")
    reloaded = fed.materialized(fresh.load(fed.ctx)).data
    assert isinstance(reloaded["weight"], torch.Tensor)
    assert torch.equal(reloaded["weight"], torch.full((2, N), 0.5))
