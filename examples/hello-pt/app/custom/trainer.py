"""The site's executor for `train`: a few local epochs of SGD on this site's digits shard,
starting from the global model, reporting the held-out test accuracy.

`train_round` and `accuracy` are plain functions of a state dict, so the same training can run
outside fedhive (tests/unit/test_examples.py checks that FedAvg over them reaches the goal).
"""

from __future__ import annotations

from typing import Any

import torch
from digits import Arrays, site_data, site_index
from net import Net
from torch import nn

from fedhive.blobs import TensorKind
from fedhive.fl.dxo import DataKind, Dxo, MetaKey
from fedhive.fl.executor import ExecTask

State = dict[str, torch.Tensor]


def accuracy(state: State, data: Arrays, hidden: int = 64) -> float:
    model = Net(hidden)
    model.load_state_dict(state)
    model.eval()
    x, y = data
    with torch.no_grad():
        predicted = model(torch.from_numpy(x)).argmax(dim=1)
    return float((predicted == torch.from_numpy(y)).float().mean())


def train_round(state: State, data: Arrays, *, epochs: int, lr: float, batch_size: int,
                seed: int, hidden: int = 64, stop: Any = None) -> tuple[State, int, float]:
    """`epochs` of SGD from `state`: the new state, the number of optimizer steps, the mean
    loss of the last epoch. `stop` (a threading.Event) ends training early."""
    model = Net(hidden)
    model.load_state_dict(state)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.from_numpy(data[0]), torch.from_numpy(data[1])
    shuffle = torch.Generator().manual_seed(seed)
    steps, losses = 0, []
    for _ in range(epochs):
        losses = []
        for batch in torch.randperm(len(y), generator=shuffle).split(batch_size):
            if stop is not None and stop.is_set():
                raise RuntimeError("training stopped: the job is ending")
            optimizer.zero_grad()
            loss = loss_fn(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
            steps += 1
            losses.append(loss.item())
    new_state = {name: value.detach().clone() for name, value in model.state_dict().items()}
    return new_state, steps, sum(losses) / max(len(losses), 1)


class DigitsTrainer:
    def __init__(self, num_sites: int = 2, epochs: int = 5, lr: float = 0.05,
                 batch_size: int = 32, hidden: int = 64) -> None:
        self.num_sites = num_sites
        self.epochs = epochs
        self.lr = lr
        self.batch_size = batch_size
        self.hidden = hidden

    def execute(self, task: ExecTask) -> Dxo:
        if task.name != "train":
            raise ValueError(f"DigitsTrainer does not handle task {task.name!r}")
        received = task.load(kind=TensorKind.TORCH)
        train, test = site_data(task.site, self.num_sites)
        current_round = int(received.meta.get(MetaKey.CURRENT_ROUND, 0))
        seed = 1000 * current_round + site_index(task.site, self.num_sites)
        state, steps, loss = train_round(
            dict(received.data), train, epochs=self.epochs, lr=self.lr,
            batch_size=self.batch_size, seed=seed, hidden=self.hidden, stop=task.abort,
        )
        metrics = {
            "accuracy": accuracy(state, test, self.hidden),  # the locally trained model
            "global_accuracy": accuracy(dict(received.data), test, self.hidden),
            "loss": loss,
        }
        task.log.info("digits.trained", round=current_round, samples=len(train[1]), **metrics)
        return Dxo(DataKind.WEIGHTS, state,
                   {MetaKey.NUM_STEPS_CURRENT_ROUND: steps, MetaKey.METRICS: metrics})
