"""A job's per-round metrics: the dataclass, and to and from the round log's dicts
(`fedhive.state.rounds`) and the wire (`fedhive.v1.RoundMetrics`).

`metrics` is what the workflow reported, normally `{"sites": {site: {name: value}},
"aggregate": {name: value}}` (`fedhive.fl.workflows.base.BaseWorkflow.report`); `aggregate`
and `sites` read those parts and are empty when a workflow reported something else.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedhive.proto.v1 import admin_pb2
from fedhive.structs import dict_to_struct, struct_to_dict


@dataclass(frozen=True)
class RoundMetrics:
    workflow: str  # the workflow's id in the server config
    round: int  # 0-based
    num_rounds: int
    metrics: dict[str, Any] = field(default_factory=dict)
    at_ms: int = 0  # when the server job recorded the round (unix epoch milliseconds)

    @property
    def aggregate(self) -> dict[str, Any]:
        """{metric name: value} over the sites (sample-weighted mean), {} if none."""
        values = self.metrics.get("aggregate")
        return dict(values) if isinstance(values, dict) else {}

    @property
    def sites(self) -> dict[str, dict[str, Any]]:
        """{site: {metric name: value}} for the sites whose result the round used."""
        values = self.metrics.get("sites")
        if not isinstance(values, dict):
            return {}
        return {str(site): dict(m) if isinstance(m, dict) else {} for site, m in values.items()}


def round_to_dict(entry: RoundMetrics) -> dict[str, Any]:
    """The round log's JSON object."""
    return {"workflow": entry.workflow, "round": entry.round, "num_rounds": entry.num_rounds,
            "metrics": entry.metrics, "at_ms": entry.at_ms}


def round_from_dict(values: Mapping[str, Any]) -> RoundMetrics:
    """A round log entry; missing or mistyped fields read as empty (a log is never refused)."""
    metrics = values.get("metrics")
    return RoundMetrics(
        workflow=str(values.get("workflow") or ""),
        round=_int(values.get("round")),
        num_rounds=_int(values.get("num_rounds")),
        metrics=dict(metrics) if isinstance(metrics, dict) else {},
        at_ms=_int(values.get("at_ms")),
    )


def round_to_proto(entry: RoundMetrics) -> admin_pb2.RoundMetrics:
    return admin_pb2.RoundMetrics(
        workflow=entry.workflow, round=entry.round, num_rounds=entry.num_rounds,
        metrics=dict_to_struct(entry.metrics), at_ms=entry.at_ms,
    )


def round_from_proto(message: admin_pb2.RoundMetrics) -> RoundMetrics:
    return RoundMetrics(
        workflow=message.workflow, round=message.round, num_rounds=message.num_rounds,
        metrics=struct_to_dict(message.metrics), at_ms=message.at_ms,
    )


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0
    return int(value)
