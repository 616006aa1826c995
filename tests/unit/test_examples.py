"""The example jobs in examples/: each passes the job validator, its site executors and server
components build from its own configs, and its trainers do what the example promises, run
here the way a client job runs them (no infrastructure; end to end: tests/e2e/test_fl_jobs.py).
hello-pt's training script, under FedAvg with the example's own settings, reaches the accuracy
goal."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
import torch

from fedhive.blobs import BlobLocation
from fedhive.fl.components import build_component
from fedhive.fl.dxo import DataKind, Dxo, MetaKey
from fedhive.fl.executor import ExecTask, Executor, Executors
from fedhive.jobs.definition import load_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NAMES = sorted(path.name for path in EXAMPLES.iterdir() if (path / "meta.json").is_file())
SITES = ("site-1", "site-2")
ACCURACY_GOAL = 0.90


class _NoFetch:
    """Task data here is arrays already: nothing may be fetched."""

    def fetch_range(self, where: BlobLocation, offset: int, dests: Sequence[memoryview]) -> None:
        raise AssertionError(f"unexpected fetch of {where}")


@contextmanager
def _app(name: str) -> Iterator[Path]:
    """The example's app folder, its `custom/` code importable only inside the block (the
    examples reuse module names such as np_trainer)."""
    app = EXAMPLES / name / "app"
    custom = str(app / "custom")
    path = list(sys.path)
    sys.path.insert(0, custom)
    try:
        yield app
    finally:
        sys.path[:] = path
        for module_name, module in list(sys.modules.items()):
            if (getattr(module, "__file__", None) or "").startswith(custom):
                del sys.modules[module_name]


def _config(app: Path, side: str) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((app / "config" / f"config_fed_{side}.json").read_text())
    return config


def _task(name: str, site: str, data: Dxo, workspace: Path) -> ExecTask:
    return ExecTask(name=name, data=data, props={}, job_id="job-1", site=site,
                    workspace=workspace, abort=threading.Event(),
                    log=structlog.get_logger().bind(site=site), fetcher=_NoFetch())


def _train(data: dict[str, Any], round_: int, total: int) -> Dxo:
    return Dxo(DataKind.WEIGHTS, data,
               {MetaKey.CURRENT_ROUND: round_, MetaKey.TOTAL_ROUNDS: total})


def test_every_example_is_found() -> None:
    assert NAMES == ["cross-site-eval", "cyclic-numpy", "hello-large", "hello-numpy", "hello-pt"]


@pytest.mark.parametrize("name", NAMES)
def test_example_passes_the_job_validator(name: str) -> None:
    job = load_job(EXAMPLES / name)
    assert job.meta.name == name and job.deploys_to_all and job.meta.min_clients == 2
    assert job.byoc  # the trainers are the job's own custom/ code


def test_the_hierarchy_example_job_validates_with_its_operators(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("hierarchy_run", EXAMPLES / "hierarchy/run.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    job = load_job(script.hierarchy_job(tmp_path / "job"))
    server = job.configs["app"].server
    assert server is not None and server["operators"] == script.OPERATORS
    assert job.meta.name == "hello-hierarchy" and job.meta.min_clients == 2


@pytest.mark.parametrize("name", NAMES)
def test_example_builds_its_site_executors_and_server_app(name: str) -> None:
    with _app(name) as app:
        executors = Executors.load(app)
        assert isinstance(executors.get("train"), Executor)
        server, built = _config(app, "server"), {}
        for section in ("components", "workflows"):
            for index, spec in enumerate(server[section]):
                build_component(spec, f"{section}[{index}]", built)
        assert "persistor" in built and all(hasattr(built[w["id"]], "run")
                                            for w in server["workflows"])


def _fedavg(local_round: Any, args: Any, state: dict[str, torch.Tensor], rounds: int,
            ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """FedAvg as the workflow runs it: each round every site trains from the global model (as
    custom/train.py does for each task it receives) and the results are averaged weighted by
    NUM_STEPS_CURRENT_ROUND. Returns the final model and the step-weighted mean of the sites'
    reported accuracy per round."""
    reported = []
    for round_ in range(rounds):
        results = [local_round(state, site, round_, args) for site in SITES]
        total = sum(steps for _, steps, _ in results)
        state = {name: sum(new[name] * steps for new, steps, _ in results) / total
                 for name in state}
        reported.append(sum(metrics["accuracy"] * steps for _, steps, metrics in results)
                        / total)
    return state, reported


def test_hello_pt_reaches_the_accuracy_goal_under_fedavg() -> None:
    with _app("hello-pt") as app:
        from digits import site_data
        from train import local_round, options
        from trainer import accuracy

        server = _config(app, "server")
        rounds = server["workflows"][0]["args"]["num_rounds"]
        executor = _config(app, "client")["executors"][0]["executor"]["args"]
        args = options(shlex.split(executor["command"])[3:])  # python -u custom/train.py ...
        persistor = build_component(server["components"][0], "components[0]", {})
        initial = {name: value.clone() for name, value in persistor.model.state_dict().items()}
        _, test = site_data("site-1", 2)
        assert accuracy(initial, test) < 0.3  # untrained: about chance

        final, reported = _fedavg(local_round, args, initial, rounds)
        assert rounds <= 5  # "after a few rounds"
        assert accuracy(final, test) >= ACCURACY_GOAL
        assert reported[-1] >= ACCURACY_GOAL  # what the job's metrics.json reports


def test_hello_pt_splits_the_data_by_site_number() -> None:
    with _app("hello-pt"):
        from digits import site_data, site_index, split

        shards, (_, test_y) = split(2)
        assert [site_index(site, 2) for site in ("site-1", "site-2", "e42-3")] == [0, 1, 0]
        assert sum(len(y) for _, y in shards) + len(test_y) == 1797 and len(test_y) == 359
        for index, site in enumerate(SITES):
            (x, y), _ = site_data(site, 2)
            np.testing.assert_array_equal(x, shards[index][0])
            assert len(y) in (718, 719) and x.min() >= 0.0 and x.max() <= 1.0
        assert site_index("hub", 2) in (0, 1)  # a name without a number: by a stable hash


@pytest.mark.parametrize("name", ["hello-numpy", "cyclic-numpy"])
def test_numpy_trainer_adds_its_delta(name: str, tmp_path: Path) -> None:
    with _app(name) as app:
        trainer = Executors.load(app).get("train")
        assert trainer is not None
        weights = np.arange(9, dtype=np.float32).reshape(3, 3)
        result = trainer.execute(_task("train", "site-1", _train({"weights": weights}, 0, 3),
                                       tmp_path))
    assert result.data_kind is DataKind.WEIGHTS
    assert result.data["weights"].dtype == np.float32
    np.testing.assert_array_equal(result.data["weights"], weights + 1)
    assert result.meta[MetaKey.NUM_STEPS_CURRENT_ROUND] == 1
    assert result.meta[MetaKey.METRICS] == {"weight_mean": 5.0}


def test_cross_site_eval_trains_submits_and_validates(tmp_path: Path) -> None:
    with _app("cross-site-eval") as app:
        executors = Executors.load(app)
        trainer = executors.get("train")
        assert trainer is not None
        assert executors.get("submit_model") is trainer is executors.get("validate")
        empty = Dxo(DataKind.WEIGHTS, {})
        with pytest.raises(RuntimeError, match="site-1 has no local model"):
            trainer.execute(_task("submit_model", "site-1", empty, tmp_path))

        initial = {"w": np.zeros(2), "b": np.zeros(1)}
        local = {}
        for site in SITES:
            workspace = tmp_path / site
            workspace.mkdir()
            trained = trainer.execute(_task("train", site, _train(initial, 0, 2), workspace))
            assert trained.meta[MetaKey.METRICS]["accuracy"] > 0.8
            local[site] = trainer.execute(_task("submit_model", site, empty, workspace))
            assert local[site].data_kind is DataKind.WEIGHTS
            assert (workspace / "local_model.npz").is_file()
        for owner, model in local.items():
            for validator in SITES:
                request = Dxo(DataKind.WEIGHTS, model.data, {MetaKey.MODEL_OWNER: owner})
                result = trainer.execute(_task("validate", validator, request, tmp_path))
                assert result.data_kind is DataKind.METRICS and result.data == {}
                assert 0.5 < result.meta[MetaKey.METRICS]["accuracy"] <= 1.0
        with pytest.raises(ValueError, match="does not handle task 'other'"):
            trainer.execute(_task("other", "site-1", empty, tmp_path))
