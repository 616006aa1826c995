"""A stand-in for training, as in FLARE's hello-numpy: the site adds `delta` to every weight of
the model it gets and reports one step and the mean weight."""

from __future__ import annotations

import numpy as np

from fedhive.blobs import TensorKind
from fedhive.fl.dxo import DataKind, Dxo, MetaKey
from fedhive.fl.executor import ExecTask


class NumpyTrainer:
    def __init__(self, delta: float = 1.0) -> None:
        self.delta = delta

    def execute(self, task: ExecTask) -> Dxo:
        if task.name != "train":
            raise ValueError(f"NumpyTrainer does not handle task {task.name!r}")
        model = task.load(kind=TensorKind.NUMPY)
        trained = {name: np.asarray(value) + np.asarray(self.delta, dtype=value.dtype)
                   for name, value in model.data.items()}
        mean = float(np.mean([array.mean() for array in trained.values()])) if trained else 0.0
        task.log.info("numpy.trained", round=model.meta.get(MetaKey.CURRENT_ROUND), mean=mean)
        return Dxo(DataKind.WEIGHTS, trained,
                   {MetaKey.NUM_STEPS_CURRENT_ROUND: 1, MetaKey.METRICS: {"weight_mean": mean}})
