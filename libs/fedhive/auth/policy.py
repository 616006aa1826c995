"""The authorisation policy as data, after FLARE's default (provisioned) policy.

Each gateway action needs one right; each role grants each right under one condition:

| role          | submit_job | clone_job   | manage_job  | download_job | view |
|---------------|------------|-------------|-------------|--------------|------|
| project_admin | any        | any         | any         | any          | any  |
| org_admin     | none       | none        | o:submitter | o:submitter  | any  |
| lead          | any        | n:submitter | n:submitter | n:submitter  | any  |
| member        | none       | none        | none        | none         | any  |

`o:submitter`: the caller's org is the job submitter's org; `n:submitter`: the caller is the
job's submitter. A right a role does not list is denied. Resuming a job makes a new one from
it, as cloning does: it needs clone_job. Running operations on an operation-driven job manages
it: manage_job. `decide` is the only place that reads the table; the
gateway logs every decision it makes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from fedhive.errors import PermissionDenied
from fedhive.jobs.record import Submitter

if TYPE_CHECKING:
    from fedhive.auth.tokens import Admin


class Role(StrEnum):
    PROJECT_ADMIN = "project_admin"
    ORG_ADMIN = "org_admin"
    LEAD = "lead"
    MEMBER = "member"


class Right(StrEnum):
    SUBMIT_JOB = "submit_job"
    CLONE_JOB = "clone_job"
    MANAGE_JOB = "manage_job"
    DOWNLOAD_JOB = "download_job"
    VIEW = "view"


class Action(StrEnum):
    """What a gateway caller asks to do (one per AdminService method)."""

    SUBMIT = "submit"
    CLONE = "clone"
    RESUME = "resume"
    ABORT = "abort"
    DELETE = "delete"
    DOWNLOAD = "download"
    LIST = "list"
    GET = "get"
    WATCH = "watch"
    METRICS = "metrics"  # a job's per-round metrics: viewed like the job itself
    LOGS = "logs"  # a job's log lines (server and sites): viewed like the job itself
    SITES = "sites"
    OPERATE = "operate"  # run an operation on an operation-driven job (and export its result)


class Condition(StrEnum):
    ANY = "any"
    NONE = "none"
    OWN_ORG = "o:submitter"
    OWN_JOB = "n:submitter"


RIGHT_OF: dict[Action, Right] = {
    Action.SUBMIT: Right.SUBMIT_JOB,
    Action.CLONE: Right.CLONE_JOB,
    Action.RESUME: Right.CLONE_JOB,
    Action.ABORT: Right.MANAGE_JOB,
    Action.DELETE: Right.MANAGE_JOB,
    Action.OPERATE: Right.MANAGE_JOB,
    Action.DOWNLOAD: Right.DOWNLOAD_JOB,
    Action.LIST: Right.VIEW,
    Action.GET: Right.VIEW,
    Action.WATCH: Right.VIEW,
    Action.METRICS: Right.VIEW,
    Action.LOGS: Right.VIEW,
    Action.SITES: Right.VIEW,
}

_C = Condition
POLICY: dict[Role, dict[Right, Condition]] = {
    Role.PROJECT_ADMIN: {right: _C.ANY for right in Right},
    Role.ORG_ADMIN: {
        Right.SUBMIT_JOB: _C.NONE,
        Right.CLONE_JOB: _C.NONE,
        Right.MANAGE_JOB: _C.OWN_ORG,
        Right.DOWNLOAD_JOB: _C.OWN_ORG,
        Right.VIEW: _C.ANY,
    },
    Role.LEAD: {
        Right.SUBMIT_JOB: _C.ANY,
        Right.CLONE_JOB: _C.OWN_JOB,
        Right.MANAGE_JOB: _C.OWN_JOB,
        Right.DOWNLOAD_JOB: _C.OWN_JOB,
        Right.VIEW: _C.ANY,
    },
    Role.MEMBER: {Right.VIEW: _C.ANY},
}

_SCOPE: dict[Condition, str] = {
    Condition.OWN_ORG: "only for jobs submitted by its own org",
    Condition.OWN_JOB: "only for jobs it submitted itself",
}


@dataclass(frozen=True)
class Decision:
    allowed: bool
    action: Action
    right: Right
    condition: Condition
    reason: str  # why, in a few words: fit for the log and for the denial message


def decide(admin: Admin, action: Action, job_submitter: Submitter | None = None) -> Decision:
    """May `admin` do `action` (on a job submitted by `job_submitter`, for job actions)?"""
    right = RIGHT_OF[action]
    condition = POLICY[admin.role].get(right, Condition.NONE)
    if condition is Condition.ANY:
        return Decision(True, action, right, condition, f"role {admin.role} has {right}")
    if condition is Condition.NONE:
        return Decision(False, action, right, condition, f"role {admin.role} has no {right}")
    reason = f"role {admin.role} has {right} {_SCOPE[condition]}"
    if job_submitter is None:
        allowed = False
    elif condition is Condition.OWN_ORG:
        allowed = bool(admin.org) and admin.org == job_submitter.org.strip().lower()
    else:
        allowed = admin.name == job_submitter.name.strip().lower()
    return Decision(allowed, action, right, condition, reason)


def denial(admin: Admin, decision: Decision, job_id: str | None = None) -> PermissionDenied:
    """The one-line error for a denied decision, naming the user, the action and the job."""
    target = f" job {job_id}" if job_id else ""
    return PermissionDenied(
        f"user {admin.name!r} ({admin.role}) is not authorized to {decision.action}{target}: "
        f"{decision.reason}",
        field=decision.right.value,
    )
