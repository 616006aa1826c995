"""Aggregators: what a workflow feeds each site's result to, and asks for the round's result.

    ok, reason = aggregator.accept("site-1", result_dxo)   # materialized; (False, why) = rejected
    aggregate = aggregator.aggregate()                      # the round's Dxo
    aggregator.reset()                                       # before the next round

`accept` is called as results arrive (from the task manager's callbacks, so on several threads)
and folds each result in at once: the server holds one running sum, not every site's model.
"""

from __future__ import annotations

import abc
import math
import re
import threading
from typing import Any

from fedhive.blobs.dtypes import is_torch_tensor
from fedhive.errors import InvalidArgument
from fedhive.fl.dxo import DataKind, Dxo, MetaKey


class Aggregator(abc.ABC):
    @abc.abstractmethod
    def accept(self, site: str, dxo: Dxo) -> tuple[bool, str]:
        """Fold `site`'s result in; (False, the reason) when it is rejected."""

    @abc.abstractmethod
    def aggregate(self) -> Dxo:
        """The result of what was accepted since the last reset."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget what was accepted (a new round)."""


class InTimeAccumulateWeightedAggregator(Aggregator):
    """Weighted average of the accepted results, accumulated as they arrive (FLARE's).

    A site's weight is `aggregation_weights[site]` (1.0 when not listed) times, with
    `weigh_by_local_iter`, its meta NUM_STEPS_CURRENT_ROUND (1.0 when missing). Each array is
    averaged over the sites that sent it; names matching `exclude_vars` (a regex) are left out.
    The aggregate has the expected kind: a WEIGHT_DIFF average stays a diff (the shareable
    generator adds it to the model) and each array keeps the dtype it arrived with.
    """

    def __init__(self, expected_data_kind: str = "WEIGHTS",
                 aggregation_weights: dict[str, float] | None = None,
                 exclude_vars: str | None = None, weigh_by_local_iter: bool = True) -> None:
        self.expected_data_kind = check_kind(
            expected_data_kind, "expected_data_kind",
            (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF, DataKind.METRICS))
        self.aggregation_weights = check_weights(aggregation_weights, "aggregation_weights")
        if exclude_vars is not None and not isinstance(exclude_vars, str):
            raise InvalidArgument(f"exclude_vars must be a regex string, not {exclude_vars!r}",
                                  field="exclude_vars")
        try:
            self._exclude = re.compile(exclude_vars) if exclude_vars else None
        except re.error as err:
            raise InvalidArgument(f"exclude_vars is not a valid regex: {err}",
                                  field="exclude_vars") from None
        if not isinstance(weigh_by_local_iter, bool):
            raise InvalidArgument("weigh_by_local_iter must be true or false",
                                  field="weigh_by_local_iter")
        self.weigh_by_local_iter = weigh_by_local_iter
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._sums: dict[str, Any] = {}
            self._totals: dict[str, float] = {}
            self._dtypes: dict[str, Any] = {}
            self._shapes: dict[str, tuple[int, ...]] = {}
            self._sites: list[str] = []

    def weight(self, site: str, dxo: Dxo) -> float:
        """`site`'s weight for `dxo`; InvalidArgument for a step count that is no number."""
        weight = float(self.aggregation_weights.get(site, 1.0))
        if not self.weigh_by_local_iter:
            return weight
        steps = dxo.meta.get(MetaKey.NUM_STEPS_CURRENT_ROUND, 1.0)
        if isinstance(steps, bool) or not isinstance(steps, int | float) or not math.isfinite(
                steps) or steps < 0:
            raise InvalidArgument(f"{MetaKey.NUM_STEPS_CURRENT_ROUND} must be a number >= 0, "
                                  f"not {steps!r}", field=MetaKey.NUM_STEPS_CURRENT_ROUND)
        return weight * float(steps)

    def accept(self, site: str, dxo: Dxo) -> tuple[bool, str]:
        if dxo.is_lazy:
            raise InvalidArgument(f"the result of {site} must be materialized before it is "
                                  "aggregated", field="data")
        if dxo.data_kind is not self.expected_data_kind:
            return False, (f"data kind {dxo.data_kind.value}, expected "
                           f"{self.expected_data_kind.value}")
        try:
            weight = self.weight(site, dxo)
        except InvalidArgument as err:
            return False, err.message
        if weight <= 0:
            return False, f"aggregation weight {weight} (must be > 0)"
        arrays = {name: value for name, value in dxo.data.items()
                  if not (self._exclude and self._exclude.search(name))}
        with self._lock:
            if site in self._sites:
                return False, "this round already has a result from the site"
            for name, value in arrays.items():
                shape = tuple(value.shape)
                if self._shapes.setdefault(name, shape) != shape:
                    return False, f"{name!r} has shape {shape}, others sent {self._shapes[name]}"
            for name, value in arrays.items():
                weighted = value * weight
                if name in self._sums:
                    self._sums[name] = self._sums[name] + weighted
                else:
                    self._sums[name], self._dtypes[name] = weighted, value.dtype
                self._totals[name] = self._totals.get(name, 0.0) + weight
            self._sites.append(site)
        return True, ""

    @property
    def sites(self) -> list[str]:
        """The sites accepted since the last reset, in order."""
        with self._lock:
            return list(self._sites)

    def aggregate(self) -> Dxo:
        with self._lock:
            data = {name: _cast(total / self._totals[name], self._dtypes[name])
                    for name, total in self._sums.items()}
            return Dxo(self.expected_data_kind, data, {"aggregated_sites": list(self._sites)})


def _cast(value: Any, dtype: Any) -> Any:
    return value.to(dtype) if is_torch_tensor(value) else value.astype(dtype, copy=False)


def check_kind(value: Any, field_name: str, allowed: tuple[DataKind, ...]) -> DataKind:
    if value not in {kind.value for kind in allowed}:
        raise InvalidArgument(f"{field_name} must be one of "
                              f"{', '.join(kind.value for kind in allowed)}, not {value!r}",
                              field=field_name)
    return DataKind(value)


def check_weights(value: Any, field_name: str) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
            isinstance(site, str) and isinstance(weight, int | float)
            and not isinstance(weight, bool) and math.isfinite(weight) and weight >= 0
            for site, weight in value.items()):
        raise InvalidArgument(f"{field_name} must map site names to numbers >= 0, "
                              f"not {value!r}", field=field_name)
    return {site: float(weight) for site, weight in value.items()}


class CollectAggregator(Aggregator):
    """Keeps each site's result as it is. `collected()` gives them per site; `aggregate()`
    gives one COLLECTION Dxo whose arrays are named `<site>/<name>` and whose meta["sites"]
    holds each site's data kind and meta."""

    def __init__(self, expected_data_kind: str | None = None) -> None:
        self.expected_data_kind = None if expected_data_kind is None else check_kind(
            expected_data_kind, "expected_data_kind", tuple(DataKind))
        self._lock = threading.Lock()
        self._results: dict[str, Dxo] = {}

    def accept(self, site: str, dxo: Dxo) -> tuple[bool, str]:
        if self.expected_data_kind is not None and dxo.data_kind is not self.expected_data_kind:
            return False, (f"data kind {dxo.data_kind.value}, expected "
                           f"{self.expected_data_kind.value}")
        with self._lock:
            if site in self._results:
                return False, "this round already has a result from the site"
            self._results[site] = dxo
        return True, ""

    def collected(self) -> dict[str, Dxo]:
        with self._lock:
            return dict(self._results)

    def aggregate(self) -> Dxo:
        with self._lock:
            data = {f"{site}/{name}": value for site, dxo in self._results.items()
                    for name, value in dxo.data.items()}
            sites = {site: {"data_kind": dxo.data_kind.value, "meta": dict(dxo.meta)}
                     for site, dxo in self._results.items()}
        return Dxo(DataKind.COLLECTION, data, {"sites": sites})

    def reset(self) -> None:
        with self._lock:
            self._results = {}
