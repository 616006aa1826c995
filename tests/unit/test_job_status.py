"""The job status state machine as data."""

from fedhive.jobs.status import INITIAL, TRANSITIONS, JobStatus, is_allowed


def test_final_statuses_have_no_way_out() -> None:
    for current, _new in TRANSITIONS:
        assert not current.is_final


def test_every_status_is_reachable_from_submitted() -> None:
    reached, frontier = {INITIAL}, [INITIAL]
    while frontier:
        current = frontier.pop()
        for source, target in TRANSITIONS:
            if source == current and target not in reached:
                reached.add(target)
                frontier.append(target)
    assert reached == set(JobStatus)


def test_flare_status_strings() -> None:
    assert JobStatus.FINISHED_CANT_SCHEDULE == "FINISHED:CAN_NOT_SCHEDULE"
    assert JobStatus.FINISHED_COMPLETED == "FINISHED:COMPLETED"
    assert all(s.is_final == s.value.startswith("FINISHED:") for s in JobStatus)


def test_abort_allowed_from_every_live_status() -> None:
    for status in (JobStatus.SUBMITTED, JobStatus.DISPATCHED, JobStatus.RUNNING):
        assert is_allowed(status, JobStatus.FINISHED_ABORTED)
    assert not is_allowed(JobStatus.SUBMITTED, JobStatus.RUNNING)
