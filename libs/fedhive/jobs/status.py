"""The job status state machine, declared once as data.

`TRANSITIONS` is the only statement of which status changes are legal: the Redis
compare-and-set script (`fedhive.state`) is generated from it, and nothing writes a status
any other way. Status strings are FLARE's exact ones (`FINISHED:CAN_NOT_SCHEDULE`, not
`CANT_SCHEDULE`), so scripts written against FLARE read fedhive's statuses unchanged.
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    SUBMITTED = "SUBMITTED"
    DISPATCHED = "DISPATCHED"
    RUNNING = "RUNNING"
    FINISHED_COMPLETED = "FINISHED:COMPLETED"
    FINISHED_EXECUTION_EXCEPTION = "FINISHED:EXECUTION_EXCEPTION"
    FINISHED_ABORTED = "FINISHED:ABORTED"
    FINISHED_ABNORMAL = "FINISHED:ABNORMAL"  # the server job died without reporting
    FINISHED_CANT_SCHEDULE = "FINISHED:CAN_NOT_SCHEDULE"
    FINISHED_FAILED_TO_RUN = "FINISHED:FAILED_TO_RUN"  # deploy or start failed below minimums

    @property
    def is_final(self) -> bool:
        return self.value.startswith("FINISHED:")


S = JobStatus
TRANSITIONS: frozenset[tuple[JobStatus, JobStatus]] = frozenset(
    {
        (S.SUBMITTED, S.DISPATCHED),
        (S.SUBMITTED, S.FINISHED_CANT_SCHEDULE),
        (S.SUBMITTED, S.FINISHED_ABORTED),
        (S.DISPATCHED, S.RUNNING),
        (S.DISPATCHED, S.FINISHED_FAILED_TO_RUN),
        (S.DISPATCHED, S.FINISHED_ABORTED),
        (S.RUNNING, S.FINISHED_COMPLETED),
        (S.RUNNING, S.FINISHED_EXECUTION_EXCEPTION),
        (S.RUNNING, S.FINISHED_ABORTED),
        (S.RUNNING, S.FINISHED_ABNORMAL),
    }
)
INITIAL = S.SUBMITTED


def is_allowed(current: JobStatus, new: JobStatus) -> bool:
    return (current, new) in TRANSITIONS
