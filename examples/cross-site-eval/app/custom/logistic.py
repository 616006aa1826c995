"""Logistic regression in numpy on each site's own data, for cross-site evaluation.

Each site draws its data from a fixed generator (no download): two Gaussian classes in the
plane, shifted by the site's number (`site-1` -> 0, `site-2` -> 1, ...), so a model trained
at one site does measurably worse at another, which is what cross-site evaluation shows. The
site keeps its last trained model (memory and `local_model.npz` in its workspace) for
`submit_model`, and `validate` reports a model's accuracy on the site's validation split.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np

from fedhive.blobs import TensorKind
from fedhive.fl.dxo import DataKind, Dxo, MetaKey
from fedhive.fl.executor import ExecTask

Array = np.ndarray[Any, Any]
SAMPLES = 400  # per site: 300 to train, 100 to validate


def site_index(site: str, num_sites: int) -> int:
    match = re.search(r"(\d+)$", site)
    if match:
        return (int(match.group(1)) - 1) % num_sites
    return int(hashlib.sha256(site.encode()).hexdigest(), 16) % num_sites


def site_data(index: int) -> tuple[tuple[Array, Array], tuple[Array, Array]]:
    """(train x, y), (validation x, y) of the site with this index."""
    rng = np.random.default_rng(100 + index)
    y = rng.integers(0, 2, SAMPLES)
    shift = np.array([0.8 * index, 0.0])
    centers = np.where(y[:, None] == 1, [1.0, 1.0], [-1.0, -1.0]) + shift
    x = centers + rng.normal(scale=0.9, size=(SAMPLES, 2))
    cut = SAMPLES * 3 // 4
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def accuracy(model: dict[str, Array], data: tuple[Array, Array]) -> float:
    x, y = data
    predicted = (x @ model["w"] + model["b"][0]) > 0
    return float(np.mean(predicted == (y == 1)))


def train(model: dict[str, Array], data: tuple[Array, Array], epochs: int, lr: float
          ) -> dict[str, Array]:
    """Full-batch gradient descent on the logistic loss, from `model`."""
    x, y = data
    w, b = model["w"].astype(np.float64), model["b"].astype(np.float64)
    for _ in range(epochs):
        p = 1.0 / (1.0 + np.exp(-(x @ w + b[0])))
        w = w - lr * x.T @ (p - y) / len(y)
        b = b - lr * np.array([np.mean(p - y)])
    return {"w": w, "b": b}


class LogisticTrainer:
    """Answers `train`, `submit_model` and `validate`."""

    def __init__(self, num_sites: int = 2, epochs: int = 20, lr: float = 0.5) -> None:
        self.num_sites = num_sites
        self.epochs = epochs
        self.lr = lr
        self.local: dict[str, Array] | None = None

    def execute(self, task: ExecTask) -> Dxo:
        (train_data, validation) = site_data(site_index(task.site, self.num_sites))
        if task.name == "train":
            received = task.load(kind=TensorKind.NUMPY)
            self.local = train(dict(received.data), train_data, self.epochs, self.lr)
            np.savez(task.workspace / "local_model.npz", **self.local)
            metrics = {"accuracy": accuracy(self.local, validation)}
            return Dxo(DataKind.WEIGHTS, self.local,
                       {MetaKey.NUM_STEPS_CURRENT_ROUND: len(train_data[1]),
                        MetaKey.METRICS: metrics})
        if task.name == "submit_model":
            return Dxo(DataKind.WEIGHTS, self._local_model(task))
        if task.name == "validate":
            model = task.load(kind=TensorKind.NUMPY)
            owner = model.meta.get(MetaKey.MODEL_OWNER, "?")
            metrics = {"accuracy": accuracy(dict(model.data), validation)}
            task.log.info("logistic.validated", model_owner=owner, **metrics)
            return Dxo(DataKind.METRICS, {}, {MetaKey.METRICS: metrics})
        raise ValueError(f"LogisticTrainer does not handle task {task.name!r}")

    def _local_model(self, task: ExecTask) -> dict[str, Array]:
        if self.local is None:
            saved = task.workspace / "local_model.npz"
            if not saved.exists():
                raise RuntimeError(f"{task.site} has no local model: it has not trained yet")
            with np.load(saved) as arrays:
                self.local = {name: arrays[name] for name in arrays.files}
        return self.local
