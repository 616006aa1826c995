"""The parts a streaming weighted aggregation is made of (`fedhive.fl.aggregators`): per-tensor
jobs, each site's part of a tensor, running sums, and a byte budget bounding what is held at
once."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedhive.fl.model_store import Array, TensorSpec, compute_dtype


@dataclass
class Sum:
    """A running in-time sum of weighted arrays (compute dtype) and of their weights."""

    values: Array
    weight: float


@dataclass(frozen=True)
class Part:
    """A site's contribution to one tensor, kept to be read while streaming."""

    site: str
    value: Any  # a TensorRef, or an array of a result that came materialized
    weight: float


@dataclass
class Job:
    name: str
    spec: TensorSpec
    folded: Sum | None
    parts: list[Part] = field(default_factory=list)

    @property
    def weight(self) -> float:
        return (self.folded.weight if self.folded else 0.0) + sum(p.weight for p in self.parts)

    @property
    def need(self) -> int:
        """Bytes this tensor's accumulation holds at once: the sum, one site's tensor and,
        when the stored dtype is not the compute one, its stored form."""
        count = int(np.prod(self.spec.shape, dtype=np.int64))
        compute = count * compute_dtype(self.spec.dtype).itemsize
        stored = self.spec.nbytes
        return 2 * compute + (stored if compute != stored else 0)


class SiteFailed(Exception):
    def __init__(self, site: str, reason: str) -> None:
        super().__init__(reason)
        self.site, self.reason = site, reason


class Stopped(Exception):
    pass


class Budget:
    """At most `limit` bytes held at once; one holder may exceed it alone."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, amount: int) -> Iterator[None]:
        with self._cond:
            while self._used and self._used + amount > self._limit:
                self._cond.wait()
            self._used += amount
        try:
            yield
        finally:
            with self._cond:
                self._used -= amount
                self._cond.notify_all()
