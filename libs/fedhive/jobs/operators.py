"""Operators (seed 004): how an operation-driven job runs one task on its sites.

`operators` in config_fed_server.json maps a task name, or `<project>.<task>` to configure one
tier of a hierarchy only (the project of a tier is its hub's `project`), to a description:

    "operators": {
      "train":    {"method": "bcast", "aggregator": "aggregator", "timeout": 600,
                   "min_targets": 1, "wait_time_after_min_received": 30},
      "BC.train": {"method": "relay"}
    }

* `bcast` (FLARE's BcastOperator): the task goes to every target at once; done when all
  answered, or `min_targets` did and `wait_time_after_min_received` passed, or `timeout`; the
  results are folded into `aggregator` (a component id; "" or absent: the built-in weighted
  average, `InTimeAccumulateWeightedAggregator`) and the aggregate is the operation's result.
* `relay` (FLARE's RelayOperator): the task goes to the targets one after the other, each
  getting the previous one's result (through `shareable_generator` when one is named); the
  last result is the operation's. `task_assignment_timeout`: how long a target may take to
  pick its turn up.
* Both take `targets` (site names; default: the job's sites still in it) and `timeout`
  (seconds, 0: none). `persistor` is accepted for FLARE configs and names a component.

Defaults are FLARE's: timeout 0, min_targets 0 (every target), wait_time_after_min_received 5
(0 when min_targets is more than the targets). A description the caller of an operation gives
is overridden, field by field, by the job's own entry for the task (the project's first),
as FLARE's hub controller does; an entry without `method` is a bcast entry (so it is checked
and applied the same way), and one of another method than the caller's replaces it whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedhive.errors import InvalidArgument
from fedhive.text import clip

BCAST = "bcast"
RELAY = "relay"
METHODS = (BCAST, RELAY)
_COMMON = ("method", "timeout", "targets", "op_id")
_FIELDS = {
    BCAST: (*_COMMON, "aggregator", "min_targets", "wait_time_after_min_received"),
    RELAY: (*_COMMON, "shareable_generator", "persistor", "task_assignment_timeout"),
}
COMPONENT_FIELDS = ("aggregator", "shareable_generator", "persistor")
MAX_TIMEOUT_S = 30 * 24 * 3600.0


@dataclass(frozen=True)
class Operation:
    method: str
    timeout: float = 0.0
    targets: tuple[str, ...] | None = None
    aggregator: str = ""
    min_targets: int = 0
    wait_time_after_min_received: float = 5.0
    shareable_generator: str = ""
    persistor: str = ""
    task_assignment_timeout: float = 0.0


def parse_operation(desc: Any, where: str) -> Operation:
    """A checked description; InvalidArgument naming `where` and the field."""
    if not isinstance(desc, Mapping):
        raise InvalidArgument(f"{where}: must be an object", field=where)
    method = desc.get("method", BCAST)
    if method not in METHODS:
        raise InvalidArgument(f"{where}: method {clip(method)} is not one of "
                              f"{', '.join(METHODS)}", field=f"{where}.method")
    known = _FIELDS[method]
    for name in desc:
        if name not in known:
            raise InvalidArgument(f"{where}: unknown field {clip(name)} for method {method} "
                                  f"(known: {', '.join(known)})", field=f"{where}.{name}")
    values: dict[str, Any] = {"method": method}
    for name in ("timeout", "wait_time_after_min_received", "task_assignment_timeout"):
        if name in desc:
            values[name] = _seconds(desc[name], f"{where}.{name}")
    if "min_targets" in desc:
        values["min_targets"] = _count(desc["min_targets"], f"{where}.min_targets")
    for name in COMPONENT_FIELDS:
        if name in desc:
            values[name] = _text(desc[name], f"{where}.{name}")
    if desc.get("targets") is not None:
        targets = desc["targets"]
        if not isinstance(targets, list) or not all(isinstance(t, str) and t for t in targets):
            raise InvalidArgument(f"{where}.targets: must be a list of site names",
                                  field=f"{where}.targets")
        values["targets"] = tuple(targets)
    return Operation(**values)


def parse_operators(raw: Any, where: str = "operators") -> dict[str, dict[str, Any]]:
    """The `operators` section, checked: task name (maybe project-prefixed) -> its entry as
    written (an override keeps only the fields it sets)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise InvalidArgument(f"{where}: must be an object mapping task names to operators",
                              field=where)
    parsed = {}
    for task, desc in raw.items():
        if not isinstance(task, str) or not task:
            raise InvalidArgument(f"{where}: task names must be non-empty strings", field=where)
        parse_operation(desc, f"{where}.{task}")
        parsed[task] = dict(desc)
    return parsed


def operator_problems(config: Mapping[str, Any], file: str) -> list[tuple[str, str]]:
    """What is wrong with a server config's `operators` (job validation): each entry's
    method and fields, and the component ids it names (they must be the config's)."""
    raw = config.get("operators")
    if raw is None:
        return []
    try:
        operators = parse_operators(raw)
    except InvalidArgument as err:
        return [(f"{file} {err.field}", err.message)]
    components = config.get("components", [])
    ids = {c.get("id") for c in components if isinstance(c, dict)} \
        if isinstance(components, list) else set()
    problems = []
    for task, desc in operators.items():
        for name in COMPONENT_FIELDS:
            cid = desc.get(name)
            if cid and cid not in ids:
                problems.append((f"{file} operators.{task}.{name}",
                                 f"operators.{task}: {name} names component {clip(cid)}, which "
                                 "the server config does not define"))
    return problems


def resolve(task_name: str, requested: Mapping[str, Any],
            operators: Mapping[str, Mapping[str, Any]], project: str = "") -> Operation:
    """The operation to run for `task_name`: the caller's description, overridden field by
    field by the job's entry for `<project>.<task>`, else for `<task>` (FLARE's rule)."""
    merged = {name: value for name, value in requested.items() if value not in (None, "")}
    configured = (operators.get(f"{project}.{task_name}") if project else None) \
        or operators.get(task_name)
    if configured is not None:
        if configured.get("method", BCAST) != merged.get("method", BCAST):
            merged = {}  # another method: the caller's fields may not even apply to it
        merged = {**merged, **configured}
    return parse_operation(merged, f"operation {task_name}")


def _seconds(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not 0 <= value <= MAX_TIMEOUT_S:
        raise InvalidArgument(f"{field}: must be a number of seconds from 0 to "
                              f"{MAX_TIMEOUT_S:g}, not {clip(value)}", field=field)
    return float(value)


def _count(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1_000_000:
        raise InvalidArgument(f"{field}: must be a whole number from 0, not {clip(value)}",
                              field=field)
    return value


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{field}: must be a component id (a string), not {clip(value)}",
                              field=field)
    return value
