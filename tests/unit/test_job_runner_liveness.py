"""The monitor's verdicts on a started site (`liveness.judge`): a client job's end acts at once,
a heartbeat that stops listing the job stands for a lost notice, and absences count only while
the judge trusts its view."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fedhive.sites.heartbeat import JobHeartbeat, SiteHeartbeat
from fedhive.state.runs import RunEntry, SiteState
from fedhive_services.job_runner.liveness import (
    NOT_RUNNING,
    OFFLINE,
    SILENT,
    View,
    ended,
    judge,
    only_beats_moved,
)

JOB = "job-1"
STARTED = SiteState(started=True, started_at_ms=10_000)
SEEN = replace(STARTED, reported=True, seen_online=True, last_heartbeat_ms=11_000)


def view(*, online: bool = True, site_at: int | None = 12_000, listed: bool = True,
         job_beat: JobHeartbeat | None = None, trust: bool = True) -> View:
    site_beat = None if site_at is None else SiteHeartbeat(
        site="a", running_job_ids=[JOB] if listed else [], sent_at_ms=site_at)
    return View(online=online, site_beat=site_beat, job_beat=job_beat, trust_sites=trust,
                trust_jobs=trust)


def beat(sent_at_ms: int = 11_500, *, exit_code: int | None = None, reason: str = "",
         ) -> JobHeartbeat:
    """A client job's beat; with `exit_code`, its site agent's notice that it ended."""
    return JobHeartbeat(job_id=JOB, site="a", sent_at_ms=sent_at_ms,
                        ended=exit_code is not None, exit_code=exit_code or 0, reason=reason)


def test_first_sight_is_recorded_and_nothing_is_gone() -> None:
    state, why = judge(JOB, STARTED, view(job_beat=beat()))
    assert why == ""
    assert (state.reported, state.seen_online, state.last_heartbeat_ms) == (True, True, 11_500)


def test_a_client_job_that_ended_before_its_first_beat_is_gone_at_once() -> None:
    end = beat(exit_code=1, reason="cannot log in to the broker")
    state, why = judge(JOB, STARTED, view(job_beat=end, trust=False))
    assert why == "client job exited with code 1: cannot log in to the broker"
    assert state.ended == why


def test_exit_code_zero_after_end_run_is_the_normal_end() -> None:
    end = beat(exit_code=0, reason="the server job ended the run")
    state, why = judge(JOB, SEEN, view(job_beat=end, listed=False))
    assert why == ""
    assert state.ended == "client job exited with code 0: the server job ended the run"
    assert judge(JOB, state, view(online=False, listed=False)) == (state, "")  # judged already


@pytest.mark.parametrize(("code", "reason", "expected"), [
    (-9, "killed by signal 9 (SIGKILL: the OOM killer, or killed by hand?)",
     "client job killed by signal 9 (SIGKILL: the OOM killer, or killed by hand?)"),
    (-9, "", "client job killed by signal 9 (SIGKILL)"),
    (1, "exited with code 1: Traceback  (most recent\ncall last)",
     "client job exited with code 1: Traceback (most recent call last)"),
    (-15, "stopped by SIGTERM (aborted by its site agent)",
     "client job killed by signal 15 (SIGTERM): stopped by SIGTERM (aborted by its site agent)"),
])
def test_the_reason_says_how_the_client_job_ended(code: int, reason: str, expected: str) -> None:
    assert ended(beat(exit_code=code, reason=reason)) == expected


def test_a_long_reason_is_cut() -> None:
    assert len(ended(beat(exit_code=1, reason="x" * 5000))) < 600


def test_a_heartbeat_that_no_longer_lists_the_job_is_a_lost_notice() -> None:
    assert judge(JOB, SEEN, view(listed=False, trust=False))[1] == NOT_RUNNING
    # a beat stamped right after the start may have been listed before it
    assert judge(JOB, SEEN, view(site_at=10_500, listed=False, trust=False))[1] == ""
    # no start time known (an entry from before it was kept): not judged this way
    assert judge(JOB, replace(SEEN, started_at_ms=0), view(listed=False, trust=False))[1] == ""
    assert judge(JOB, SEEN, view(site_at=None, trust=False))[1] == ""


def test_absences_are_judged_only_on_a_trusted_view() -> None:
    assert judge(JOB, SEEN, view(online=False, site_at=None, trust=False))[1] == ""
    assert judge(JOB, SEEN, view(online=False, site_at=None))[1] == OFFLINE
    assert judge(JOB, SEEN, view(trust=False))[1] == ""
    assert judge(JOB, SEEN, view())[1] == SILENT
    # never seen online, never reported: nothing went missing
    assert judge(JOB, STARTED, view(online=False, site_at=None))[1] == ""


@pytest.mark.parametrize("state", [
    SiteState(started=False),
    replace(SEEN, excluded="no reply (start timeout)"),
    replace(SEEN, gone=OFFLINE),
])
def test_sites_out_of_the_job_are_not_judged(state: SiteState) -> None:
    end = beat(exit_code=1)
    assert judge(JOB, state, view(job_beat=end, online=False)) == (state, "")


def test_a_new_beat_alone_is_told_apart_from_a_change_a_verdict_reads() -> None:
    # The monitor writes the former at most every few seconds, the latter at once.
    entry = RunEntry(JOB, "runner-1", 1, "running", sites={"a": SEEN, "b": SEEN})
    newer, _ = judge(JOB, SEEN, view(job_beat=beat(12_500)))
    assert newer.last_heartbeat_ms == 12_500
    assert only_beats_moved(entry, replace(entry, sites={**entry.sites, "a": newer}))
    first, _ = judge(JOB, STARTED, view(job_beat=beat(12_500)))  # reported, seen online: news
    assert not only_beats_moved(replace(entry, sites={**entry.sites, "a": STARTED}),
                                replace(entry, sites={**entry.sites, "a": first}))
    assert not only_beats_moved(entry, replace(entry, sites={**entry.sites, "a": replace(
        newer, gone=OFFLINE)}))
    assert not only_beats_moved(entry, replace(entry, pid=42))
