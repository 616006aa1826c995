"""The status compare-and-set script is generated from `TRANSITIONS`, not written by hand."""

from __future__ import annotations

import re

from fedhive.jobs.status import TRANSITIONS, JobStatus
from fedhive.state.scripts import CHANGE_STATUS, PAIR_SEPARATOR, render_change_status

S = JobStatus
_PAIR = re.compile(r'^\s*\["([^"]+)' + re.escape(PAIR_SEPARATOR) + r'([^"]+)"\] = true,$', re.M)
_FINAL = re.compile(r'^\s*\["(FINISHED:[^"]+)"\] = true,$', re.M)


def allowed_pairs(source: str) -> set[tuple[JobStatus, JobStatus]]:
    return {(JobStatus(old), JobStatus(new)) for old, new in _PAIR.findall(source)}


def test_script_allows_exactly_the_transitions_constant() -> None:
    assert allowed_pairs(CHANGE_STATUS.source) == TRANSITIONS


def test_script_follows_the_table_it_is_rendered_from() -> None:
    table = {(S.SUBMITTED, S.RUNNING), (S.RUNNING, S.FINISHED_ABNORMAL)}
    script = render_change_status(table)
    assert allowed_pairs(script.source) == table
    assert script.sha != CHANGE_STATUS.sha


def test_final_statuses_come_from_the_enum() -> None:
    assert set(_FINAL.findall(CHANGE_STATUS.source)) == {s.value for s in S if s.is_final}


def test_rendering_is_deterministic() -> None:
    assert render_change_status(set(TRANSITIONS)).source == CHANGE_STATUS.source
