"""Operators: parsing a task's operation description, checking a config's `operators`, and
resolving the caller's description against the job's own entries."""

from __future__ import annotations

from typing import Any

import pytest

from fedhive.errors import InvalidArgument
from fedhive.jobs.operators import (
    BCAST,
    RELAY,
    Operation,
    operator_problems,
    parse_operation,
    parse_operators,
    resolve,
)

WHERE = "operators.train"


def refused(desc: Any, where: str = WHERE) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        parse_operation(desc, where)
    return info.value


# parse_operation


def test_bcast_defaults_are_flares() -> None:
    op = parse_operation({"method": "bcast"}, WHERE)
    assert op == Operation(method=BCAST)
    assert op.timeout == 0.0
    assert op.min_targets == 0
    assert op.wait_time_after_min_received == 5.0
    assert op.targets is None
    assert op.aggregator == ""


def test_method_defaults_to_bcast() -> None:
    assert parse_operation({}, WHERE).method == BCAST
    assert parse_operation({"timeout": 10}, WHERE) == Operation(method=BCAST, timeout=10.0)


def test_full_bcast_and_relay_descriptions_are_kept() -> None:
    bcast = parse_operation({"method": "bcast", "aggregator": "agg", "timeout": 600,
                             "min_targets": 1, "wait_time_after_min_received": 30,
                             "targets": ["a", "b"], "op_id": "x"}, WHERE)
    assert bcast == Operation(method=BCAST, timeout=600.0, targets=("a", "b"), aggregator="agg",
                              min_targets=1, wait_time_after_min_received=30.0)
    assert isinstance(bcast.timeout, float)
    relay = parse_operation({"method": "relay", "shareable_generator": "gen",
                             "persistor": "p", "task_assignment_timeout": 2.5}, WHERE)
    assert relay == Operation(method=RELAY, shareable_generator="gen", persistor="p",
                              task_assignment_timeout=2.5)


def test_not_an_object_is_refused_naming_where() -> None:
    err = refused(["bcast"])
    assert err.field == WHERE
    assert "must be an object" in err.message


def test_unknown_method_is_refused_naming_the_field_and_method() -> None:
    err = refused({"method": "scatter"})
    assert err.field is not None
    assert err.field.endswith(".method")
    assert err.field == f"{WHERE}.method"
    assert "'scatter'" in err.message
    assert "bcast" in err.message and "relay" in err.message


@pytest.mark.parametrize(("desc", "name"), [
    ({"method": "relay", "aggregator": "agg"}, "aggregator"),
    ({"method": "relay", "min_targets": 1}, "min_targets"),
    ({"method": "bcast", "shareable_generator": "gen"}, "shareable_generator"),
    ({"method": "bcast", "task_assignment_timeout": 1}, "task_assignment_timeout"),
    ({"agregator": "agg"}, "agregator"),
])
def test_a_field_unknown_for_the_method_is_refused(desc: dict[str, Any], name: str) -> None:
    err = refused(desc)
    assert err.field == f"{WHERE}.{name}"
    assert f"unknown field {name!r}" in err.message
    assert f"for method {desc.get('method', 'bcast')}" in err.message


@pytest.mark.parametrize(("desc", "field"), [
    ({"timeout": -1}, "timeout"),
    ({"timeout": "600"}, "timeout"),
    ({"timeout": True}, "timeout"),
    ({"timeout": 10**9}, "timeout"),
    ({"wait_time_after_min_received": -0.5}, "wait_time_after_min_received"),
    ({"method": "relay", "task_assignment_timeout": None}, "task_assignment_timeout"),
    ({"min_targets": True}, "min_targets"),
    ({"min_targets": 1.5}, "min_targets"),
    ({"min_targets": -1}, "min_targets"),
    ({"aggregator": 3}, "aggregator"),
    ({"method": "relay", "persistor": None}, "persistor"),
    ({"targets": "site-1"}, "targets"),
    ({"targets": ["site-1", 2]}, "targets"),
    ({"targets": ["site-1", ""]}, "targets"),
])
def test_bad_types_are_refused_naming_the_field(desc: dict[str, Any], field: str) -> None:
    err = refused(desc)
    assert err.field == f"{WHERE}.{field}"


def test_targets_none_means_the_default() -> None:
    assert parse_operation({"targets": None}, WHERE).targets is None


# parse_operators


def test_none_operators_is_empty() -> None:
    assert parse_operators(None) == {}


@pytest.mark.parametrize("raw", [["train"], "train", 3])
def test_non_mapping_operators_are_refused(raw: Any) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_operators(raw)
    assert info.value.field == "operators"


def test_operators_entries_are_kept_as_written() -> None:
    raw = {"train": {"method": "bcast", "aggregator": "agg", "timeout": 600},
           "BC.train": {"method": "relay"},
           "validate": {"min_targets": 2}}
    parsed = parse_operators(raw)
    assert parsed == raw
    assert parsed["BC.train"] == {"method": "relay"}  # no defaults filled in
    assert parsed["validate"] == {"min_targets": 2}
    assert parsed["train"] is not raw["train"]


def test_a_bad_entry_is_refused_naming_its_task() -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_operators({"train": {"method": "relay", "aggregator": "agg"}})
    assert info.value.field == "operators.train.aggregator"


def test_an_empty_task_name_is_refused() -> None:
    with pytest.raises(InvalidArgument):
        parse_operators({"": {"method": "bcast"}})


# operator_problems


COMPONENTS = [{"id": "agg", "path": "x.Agg"}, {"id": "gen", "path": "x.Gen"},
              {"id": "persistor", "path": "x.P"}]


def test_a_good_config_has_no_problems() -> None:
    config = {"components": COMPONENTS,
              "operators": {"train": {"method": "bcast", "aggregator": "agg"},
                            "BC.train": {"method": "relay", "shareable_generator": "gen",
                                         "persistor": "persistor"},
                            "validate": {"aggregator": ""}}}
    assert operator_problems(config, "config_fed_server.json") == []


def test_a_config_without_operators_has_no_problems() -> None:
    assert operator_problems({"components": COMPONENTS}, "f.json") == []


@pytest.mark.parametrize(("task", "desc", "field"), [
    ("train", {"method": "bcast", "aggregator": "nope"}, "aggregator"),
    ("BC.train", {"method": "relay", "shareable_generator": "nope"}, "shareable_generator"),
    ("train", {"method": "relay", "persistor": "nope"}, "persistor"),
])
def test_an_undefined_component_is_a_problem_naming_the_field(
        task: str, desc: dict[str, Any], field: str) -> None:
    config = {"components": COMPONENTS, "operators": {task: desc}}
    problems = operator_problems(config, "config_fed_server.json")
    assert len(problems) == 1
    where, message = problems[0]
    assert where == f"config_fed_server.json operators.{task}.{field}"
    assert "'nope'" in message
    assert f"operators.{task}" in message


def test_components_missing_or_malformed_define_nothing() -> None:
    operators = {"train": {"aggregator": "agg"}}
    assert len(operator_problems({"operators": operators}, "f.json")) == 1
    assert len(operator_problems({"operators": operators, "components": "agg"}, "f.json")) == 1
    assert len(operator_problems({"operators": operators, "components": ["agg"]}, "f.json")) == 1


def test_a_bad_method_is_one_problem() -> None:
    config = {"components": COMPONENTS,
              "operators": {"train": {"method": "gather", "aggregator": "nope"}}}
    problems = operator_problems(config, "f.json")
    assert len(problems) == 1
    where, message = problems[0]
    assert where == "f.json operators.train.method"
    assert "'gather'" in message


def test_non_mapping_operators_is_one_problem() -> None:
    problems = operator_problems({"operators": ["train"]}, "f.json")
    assert problems == [("f.json operators", problems[0][1])]


# resolve


def test_the_jobs_entry_overrides_the_callers_field_by_field() -> None:
    requested = {"method": "bcast", "timeout": 60, "min_targets": 2, "targets": ["a", "b"]}
    operators = {"train": {"timeout": 600, "aggregator": "agg"}}
    op = resolve("train", requested, operators)
    assert op == Operation(method=BCAST, timeout=600.0, targets=("a", "b"), aggregator="agg",
                           min_targets=2)


def test_the_projects_entry_wins_over_the_tasks() -> None:
    operators = {"train": {"method": "bcast", "timeout": 600},
                 "BC.train": {"method": "bcast", "timeout": 30}}
    assert resolve("train", {}, operators, project="BC").timeout == 30.0
    assert resolve("train", {}, operators, project="AB").timeout == 600.0
    assert resolve("train", {}, operators).timeout == 600.0


def test_another_projects_entry_is_ignored() -> None:
    operators = {"BC.train": {"method": "relay"}}
    assert resolve("train", {"timeout": 5}, operators, project="AB") == \
        Operation(method=BCAST, timeout=5.0)
    assert resolve("train", {"timeout": 5}, operators) == Operation(method=BCAST, timeout=5.0)


def test_a_configured_entry_with_another_method_drops_the_callers_fields() -> None:
    requested = {"method": "bcast", "aggregator": "agg", "min_targets": 2, "timeout": 60}
    operators = {"BC.train": {"method": "relay", "task_assignment_timeout": 10}}
    op = resolve("train", requested, operators, project="BC")
    assert op == Operation(method=RELAY, task_assignment_timeout=10.0)


def test_a_configured_entry_without_method_is_a_bcast_entry() -> None:
    """It is checked as bcast at submit, so it is applied as bcast: a relay caller's fields go."""
    requested = {"method": "relay", "shareable_generator": "gen"}
    op = resolve("train", requested, {"train": {"timeout": 9, "aggregator": "agg"}})
    assert op == Operation(method=BCAST, timeout=9.0, aggregator="agg")
    op = resolve("train", {"min_targets": 2}, {"train": {"timeout": 9}})
    assert op == Operation(method=BCAST, timeout=9.0, min_targets=2)


def test_a_caller_without_method_is_bcast_against_a_relay_entry() -> None:
    op = resolve("train", {"min_targets": 3}, {"train": {"method": "relay"}})
    assert op == Operation(method=RELAY)


def test_no_entry_gives_the_callers_description() -> None:
    requested = {"method": "relay", "targets": ["b", "a"], "timeout": 7,
                 "task_assignment_timeout": 1}
    op = resolve("train", requested, {"validate": {"method": "bcast"}})
    assert op == Operation(method=RELAY, timeout=7.0, targets=("b", "a"),
                           task_assignment_timeout=1.0)


def test_empty_and_none_caller_values_are_ignored() -> None:
    requested = {"method": "", "aggregator": "", "targets": None, "timeout": None,
                 "min_targets": 0}
    op = resolve("train", requested, {})
    assert op == Operation(method=BCAST)
    # a method left empty is not "another method": the entry's fields are still merged
    op = resolve("train", {"method": "", "timeout": 4}, {"train": {"method": "bcast"}})
    assert op == Operation(method=BCAST, timeout=4.0)


def test_a_bad_merged_description_is_refused_naming_the_operation() -> None:
    with pytest.raises(InvalidArgument) as info:
        resolve("train", {"method": "bcast", "timeout": -1}, {})
    assert info.value.field == "operation train.timeout"
