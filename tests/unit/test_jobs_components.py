"""Components naming fedhive classes are resolved at validation; custom code is never imported."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from fedhive.jobs.components import check_components
from fedhive.jobs.definition import InvalidJobDefinition, load_job
from tests.unit.test_jobs_validation import BASE_META, write_job

LIMITS = "fedhive.jobs.archive.ArchiveLimits"  # a real fedhive class with keyword arguments
RETRY = "fedhive.retry.Backoff"


def problems(config: dict[str, Any]) -> list[tuple[str, str]]:
    return check_components(config, "app/config/config_fed_server.json")


def test_fitting_fedhive_components_and_custom_paths_pass() -> None:
    config = {
        "components": [
            {"id": "limits", "path": LIMITS, "args": {"max_files": 10}},
            {"id": "mine", "path": "my_custom.Trainer", "args": {"anything": 1}},
        ],
        "workflows": [
            {
                "id": "wf",
                "path": "my_custom.Workflow",
                "args": {"backoff": {"path": RETRY, "args": {"base": 0.5}}},
            },
        ],
        "executors": [{"tasks": ["train"], "executor": {"path": LIMITS, "args": {}}}],
    }
    assert problems(config) == []
    assert "my_custom" not in sys.modules  # custom code is never imported


@pytest.mark.parametrize(
    ("component", "expected"),
    [
        (
            {"id": "c", "path": "fedhive.jobs.archive.Nope"},
            "unknown fedhive class 'fedhive.jobs.archive.Nope'",
        ),
        ({"id": "c", "path": "fedhive.nothing_here.Thing"}, "no module 'fedhive.nothing_here'"),
        ({"id": "c", "path": "fedhive.jobs.archive.MiB"}, "unknown fedhive class"),
        ({"id": "c", "path": LIMITS, "args": {"max_file": 3}}, "takes no argument(s) max_file"),
        (
            {"id": "c", "path": "fedhive.jobs.archive.ArchiveMember", "args": {"name": "x"}},
            "needs argument(s) is_dir, size",
        ),
        ({"id": "c", "path": "not a path"}, "path must be a dotted Python class path"),
        ({"id": "c", "path": LIMITS, "args": [1]}, "args must be an object"),
        ({"id": 3, "path": LIMITS}, "id must be a non-empty string"),
    ],
)
def test_bad_components_are_named(component: dict[str, Any], expected: str) -> None:
    found = problems({"components": [component]})
    assert len(found) == 1
    field, message = found[0]
    assert field.startswith("app/config/config_fed_server.json component")
    assert expected in message


def test_nested_and_executor_components_are_checked() -> None:
    config = {
        "workflows": [
            {
                "id": "wf",
                "path": "my.Flow",
                "args": {"inner": {"id": "in", "path": RETRY, "args": {"bogus": 1}}},
            }
        ],
        "executors": [{"tasks": ["t"], "executor": {"path": LIMITS, "args": {"x": 1}}}],
        "components": "not a list",
    }
    found = problems(config)
    assert ("app/config/config_fed_server.json components", "must be a list") in found
    assert any(f.endswith("component 'in'") and "bogus" in m for f, m in found)
    assert any(f.endswith("component at executors[0].executor") for f, _ in found)


def test_duplicate_ids_are_rejected() -> None:
    config = {"components": [{"id": "a", "path": "x.A"}], "workflows": [{"id": "a", "path": "x.B"}]}
    assert problems(config) == [
        ("app/config/config_fed_server.json component 'a'", "id used by 2 components")
    ]


def test_component_errors_reach_the_job_violations(tmp_path: Path) -> None:
    root = write_job(tmp_path / "j1", BASE_META)
    config = {"workflows": [{"id": "sag", "path": LIMITS, "args": {"rounds": 3}}]}
    (root / "srv" / "config" / "config_fed_server.json").write_text(json.dumps(config))
    with pytest.raises(InvalidJobDefinition) as caught:
        load_job(root)
    assert caught.value.violations == [
        "job 'j1': srv/config/config_fed_server.json component 'sag': "
        f"{LIMITS} takes no argument(s) rounds"
    ]
