"""`FLModel`: the model-controller view of what a task carries (FLARE's FLModel).

    FLModel(params={"w": array}, params_type=ParamsType.FULL, current_round=2, total_rounds=5,
            metrics={"accuracy": 0.9}, meta={"NUM_STEPS_CURRENT_ROUND": 32})

It is another face of the `Dxo`, converted field for field: params <-> data, FULL <-> WEIGHTS,
DIFF <-> WEIGHT_DIFF, no params type <-> METRICS, metrics <-> meta["metrics"], the rounds <->
meta["current_round"] / meta["total_rounds"]; the rest of `meta` travels unchanged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from fedhive.errors import InvalidArgument
from fedhive.fl.dxo import DataKind, Dxo, MetaKey


class ParamsType(enum.StrEnum):
    FULL = "FULL"
    DIFF = "DIFF"


_KIND_OF = {ParamsType.FULL: DataKind.WEIGHTS, ParamsType.DIFF: DataKind.WEIGHT_DIFF}
_TYPE_OF = {kind: params_type for params_type, kind in _KIND_OF.items()}


@dataclass
class FLModel:
    params: dict[str, Any] = field(default_factory=dict)
    params_type: ParamsType | None = ParamsType.FULL  # None: the model carries metrics only
    current_round: int | None = None
    total_rounds: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dxo(self) -> Dxo:
        if self.params_type is None:
            if self.params:
                raise InvalidArgument("an FLModel with params needs a params_type",
                                      field="params_type")
            kind = DataKind.METRICS
        else:
            kind = _KIND_OF[ParamsType(self.params_type)]
        meta = dict(self.meta)
        if self.current_round is not None:
            meta[MetaKey.CURRENT_ROUND] = self.current_round
        if self.total_rounds is not None:
            meta[MetaKey.TOTAL_ROUNDS] = self.total_rounds
        if self.metrics:
            meta[MetaKey.METRICS] = dict(self.metrics)
        return Dxo(kind, dict(self.params), meta)

    @classmethod
    def from_dxo(cls, dxo: Dxo) -> FLModel:
        """InvalidArgument for a COLLECTION, which has no model form."""
        if dxo.data_kind is DataKind.COLLECTION:
            raise InvalidArgument("a COLLECTION DXO has no FLModel form", field="data_kind")
        meta = dict(dxo.meta)
        current_round = meta.pop(MetaKey.CURRENT_ROUND, None)
        total_rounds = meta.pop(MetaKey.TOTAL_ROUNDS, None)
        metrics = meta.pop(MetaKey.METRICS, None) or {}
        if not isinstance(metrics, dict):
            raise InvalidArgument(f"meta 'metrics' must be an object, not {metrics!r}",
                                  field=MetaKey.METRICS)
        return cls(
            params=dict(dxo.data),
            params_type=_TYPE_OF.get(dxo.data_kind),
            current_round=_round(current_round, MetaKey.CURRENT_ROUND),
            total_rounds=_round(total_rounds, MetaKey.TOTAL_ROUNDS),
            metrics=dict(metrics),
            meta=meta,
        )


def _round(value: Any, name: str) -> int | None:
    """Round numbers that crossed the wire come back as floats (protobuf Struct)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise InvalidArgument(f"meta {name!r} must be a whole number, not {value!r}", field=name)
    return int(value)
