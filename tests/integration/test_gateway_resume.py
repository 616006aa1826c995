"""`Session.resume` through the real gateway and job-store: the new job names its source, the
refusals arrive as typed one-line errors, and resuming is authorised like cloning."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from fedhive.blobs import S3BlobStore
from fedhive.errors import FailedPrecondition, NotFound, PermissionDenied
from fedhive.jobs.status import JobStatus
from fedhive.names import Names
from fedhive.sdk import Session
from tests.fixtures.gateway import GatewayStack
from tests.fixtures.job_store import job_zip

Checkpoint = Callable[[str], None]


@pytest.fixture
def checkpoint(gateway_stack: GatewayStack) -> Iterator[Checkpoint]:
    """`checkpoint(job_id)` puts the object a workflow writes after a completed round."""
    blobs = S3BlobStore.from_settings(gateway_stack.settings)
    names = Names(gateway_stack.settings.namespace)
    yield lambda job_id: blobs.put(names.job_checkpoint_key(job_id), b"round 2 of 4")
    blobs.close()


def _aborted(session: Session, name: str) -> str:
    job_id = session.submit(job_zip(name)).job_id
    session.abort(job_id, "a site crashed")
    return job_id


def test_resume_an_aborted_job(gateway_stack: GatewayStack, checkpoint: Checkpoint) -> None:
    with gateway_stack.gateway.session("lead@a") as lead:
        source = _aborted(lead, "resume-me")
        with pytest.raises(FailedPrecondition) as refused:
            lead.resume(source)
        assert str(refused.value) == f"job {source} completed no round: nothing to resume from"

        checkpoint(source)
        resumed = lead.resume(source)
        record = lead.get(resumed.job_id)
        assert record.resumed_from == source and record.status is JobStatus.SUBMITTED
        assert record.meta.name == "resume-me" and record.submitter.name == "lead@a"
        assert record.status_reason == f"resumed from job {source}"
        assert lead.get(source).resumed_from == ""


def test_resume_refuses_a_job_that_did_not_fail(gateway_stack: GatewayStack) -> None:
    with gateway_stack.gateway.session("lead@a") as lead:
        waiting = lead.submit(job_zip("still-waiting")).job_id
        with pytest.raises(FailedPrecondition) as refused:
            lead.resume(waiting)
        assert str(refused.value) == (
            f"job {waiting} is SUBMITTED; only ABORTED, EXECUTION_EXCEPTION or ABNORMAL jobs "
            "can be resumed"
        )
        with pytest.raises(NotFound, match="job no-such-job not found"):
            lead.resume("no-such-job")


@pytest.mark.parametrize(
    ("user", "allowed"),
    [("admin@a", True), ("lead@a", True), ("lead2@a", False), ("orgadmin@a", False),
     ("member@a", False)],
)
def test_resume_is_authorised_like_clone(gateway_stack: GatewayStack, checkpoint: Checkpoint,
                                         user: str, allowed: bool) -> None:
    with gateway_stack.gateway.session("lead@a") as owner:
        source = _aborted(owner, "owned-resume")
    checkpoint(source)
    with gateway_stack.gateway.session(user) as session:
        if allowed:
            resumed = session.resume(source)
            assert session.get(resumed.job_id).submitter.name == user
        else:
            with pytest.raises(PermissionDenied) as denied:
                session.resume(source)
            assert f"user {user!r}" in str(denied.value)
            assert f"resume job {source}" in str(denied.value)
