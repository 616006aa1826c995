"""The model: a small MLP over the 64 pixels of a digit image, 10 classes."""

from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, hidden: int = 64, seed: int = 0) -> None:
        super().__init__()
        # Seeded without touching the process's global generator: every process that builds
        # the model (the server's persistor, a test) starts from the same weights.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layers = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
