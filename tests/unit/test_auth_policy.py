"""The authorisation matrix: role x action x whose job (own / same org / other org)."""

from __future__ import annotations

import pytest

from fedhive.auth import Action, Admin, Role, decide, denial
from fedhive.errors import PermissionDenied
from fedhive.jobs.record import Submitter

# The caller is always "me" of org "a"; the job was submitted by:
JOB_OWNERS = {
    "own": Submitter("me", "a", "lead"),
    "org": Submitter("colleague", "a", "lead"),
    "other": Submitter("stranger", "b", "lead"),
}
JOB_ACTIONS = (Action.CLONE, Action.RESUME, Action.ABORT, Action.DELETE, Action.DOWNLOAD)
VIEW_ACTIONS = (Action.LIST, Action.GET, Action.WATCH, Action.METRICS, Action.LOGS,
                Action.SITES)

# Written out by hand from FLARE's default policy (not derived from POLICY), as
# "action: own org other" with Y = allowed; resume (fedhive's) is authorised as clone.
EXPECTED_JOB = {
    Role.PROJECT_ADMIN: {"clone": "YYY", "resume": "YYY",
                         "abort": "YYY", "delete": "YYY", "download": "YYY"},
    Role.ORG_ADMIN: {"clone": "NNN", "resume": "NNN",
                     "abort": "YYN", "delete": "YYN", "download": "YYN"},
    Role.LEAD: {"clone": "YNN", "resume": "YNN",
                "abort": "YNN", "delete": "YNN", "download": "YNN"},
    Role.MEMBER: {"clone": "NNN", "resume": "NNN",
                  "abort": "NNN", "delete": "NNN", "download": "NNN"},
}
EXPECTED_SUBMIT = {Role.PROJECT_ADMIN: True, Role.ORG_ADMIN: False, Role.LEAD: True,
                   Role.MEMBER: False}


def _me(role: Role) -> Admin:
    return Admin(name="me", org="a", role=role)


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("action", JOB_ACTIONS)
@pytest.mark.parametrize("owner", list(JOB_OWNERS))
def test_job_actions(role: Role, action: Action, owner: str) -> None:
    column = list(JOB_OWNERS).index(owner)
    expected = EXPECTED_JOB[role][action.value][column] == "Y"
    assert decide(_me(role), action, JOB_OWNERS[owner]).allowed is expected


@pytest.mark.parametrize("role", list(Role))
def test_submit(role: Role) -> None:
    assert decide(_me(role), Action.SUBMIT).allowed is EXPECTED_SUBMIT[role]


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("action", VIEW_ACTIONS)
@pytest.mark.parametrize("owner", [None, *JOB_OWNERS])
def test_everyone_views_everything(role: Role, action: Action, owner: str | None) -> None:
    assert decide(_me(role), action, JOB_OWNERS[owner] if owner else None).allowed


def test_job_scoped_rights_need_the_job() -> None:
    assert not decide(_me(Role.LEAD), Action.ABORT, None).allowed
    assert not decide(_me(Role.ORG_ADMIN), Action.DELETE, None).allowed


def test_names_and_orgs_compare_in_lower_case() -> None:
    assert decide(_me(Role.LEAD), Action.ABORT, Submitter(" ME ", "x")).allowed
    assert decide(_me(Role.ORG_ADMIN), Action.ABORT, Submitter("x", "A")).allowed


def test_an_admin_without_org_manages_no_org_less_jobs() -> None:
    admin = Admin(name="boss", org="", role=Role.ORG_ADMIN)
    assert not decide(admin, Action.ABORT, Submitter("x", "")).allowed


def test_denial_names_user_action_job_and_why() -> None:
    decision = decide(_me(Role.LEAD), Action.DELETE, JOB_OWNERS["other"])
    err = denial(_me(Role.LEAD), decision, "job-42")
    assert isinstance(err, PermissionDenied) and err.code == "PERMISSION_DENIED"
    assert str(err) == ("user 'me' (lead) is not authorized to delete job job-42: role lead has "
                        "manage_job only for jobs it submitted itself")
    decision = decide(_me(Role.MEMBER), Action.SUBMIT)
    assert str(denial(_me(Role.MEMBER), decision)) == (
        "user 'me' (member) is not authorized to submit: role member has no submit_job"
    )
