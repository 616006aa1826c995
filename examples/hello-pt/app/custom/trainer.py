"""The training itself: a few local epochs of SGD on a site's digits shard (`train_round`),
and a model's accuracy on held-out digits (`accuracy`). Plain functions of a state dict, so the
same training runs outside fedhive (tests/unit/test_examples.py checks that FedAvg over them
reaches the goal); custom/train.py runs them under fedhive's client API.
"""

from __future__ import annotations

from typing import Any

import torch
from digits import Arrays
from net import Net
from torch import nn

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
