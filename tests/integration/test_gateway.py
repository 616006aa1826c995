"""The real gateway in front of the real job-store, through the SDK: every AdminService call,
token authentication, a few cells of the authorisation matrix, error mapping, health."""

from __future__ import annotations

import io
import zipfile

import grpc
import pytest
from grpc_health.v1 import health_pb2

from fedhive.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import admin_pb2, admin_pb2_grpc
from fedhive.sdk import Session
from tests.fixtures.gateway import GatewayProcess, health_status
from tests.fixtures.job_store import invalid_job_zip, job_zip


def test_health_serves_both_names(gateway: GatewayProcess) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health_status(gateway.address) == serving
    assert health_status(gateway.address, "fedhive.v1.AdminService") == serving


def test_missing_or_bad_token_is_unauthenticated(gateway: GatewayProcess) -> None:
    with Session(gateway.address, "fh_not-a-token") as session, \
            pytest.raises(Unauthenticated, match="invalid bearer token"):
        session.list()
    channel = grpc.insecure_channel(gateway.address)
    stub = admin_pb2_grpc.AdminServiceStub(channel)
    with pytest.raises(grpc.RpcError) as caught:
        stub.ListJobs(admin_pb2.ListJobsRequest(), timeout=10)
    channel.close()
    assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "no bearer token" in caught.value.details()


def test_job_lifecycle_through_the_sdk(gateway: GatewayProcess) -> None:
    with gateway.session("lead@a") as lead:
        submitted = lead.submit(job_zip("hello"), submission_id="s-1")
        assert not submitted.existed
        again = lead.submit(job_zip("hello"), submission_id="s-1")
        assert again.job_id == submitted.job_id and again.existed

        record = lead.get(submitted.job_id)
        assert record.status is JobStatus.SUBMITTED and record.meta.name == "hello"
        assert (record.submitter.name, record.submitter.org, record.submitter.role) == \
            ("lead@a", "a", "lead")
        assert [j.job_id for j in lead.list(name="hell")] == [submitted.job_id]

        clone = lead.clone(submitted.job_id)
        assert clone.job_id != submitted.job_id
        assert lead.get(clone.job_id).meta.extra["cloned_from"] == submitted.job_id

        with pytest.raises(FailedPrecondition, match="not done"):
            lead.download(submitted.job_id, io.BytesIO())
        aborted = lead.abort(submitted.job_id, "test over")
        assert aborted.status is JobStatus.FINISHED_ABORTED
        assert aborted.status_reason == "test over"

        out = io.BytesIO()
        assert lead.download(submitted.job_id, out) == len(out.getvalue()) > 0
        with zipfile.ZipFile(out) as archive:
            assert "srv/config/config_fed_server.json" in archive.namelist()
        with pytest.raises(NotFound, match="result"):
            lead.download(submitted.job_id, io.BytesIO(), result=True)

        with pytest.raises(FailedPrecondition, match="could not be deleted"):
            lead.delete(clone.job_id)
        lead.delete(submitted.job_id)
        with pytest.raises(NotFound):
            lead.get(submitted.job_id)
        assert lead.sites() == []


def test_invalid_job_lists_every_violation(gateway: GatewayProcess) -> None:
    with gateway.session("admin@a") as admin:
        # Raw bytes skip the SDK's local validation: the gateway's job-store must refuse it.
        chunks = iter([admin_pb2.SubmitJobChunk(data=invalid_job_zip())])
        with pytest.raises(grpc.RpcError) as caught:
            admin._stub.SubmitJob(chunks, metadata=admin._metadata, timeout=30)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        message = caught.value.details()
        for violation in ("min_clients", "site-9", "ghost"):
            assert violation in message
        with pytest.raises(InvalidArgument, match="empty"):
            admin._call(lambda: admin._stub.SubmitJob(iter([]), metadata=admin._metadata))


@pytest.mark.parametrize(
    ("user", "action", "allowed"),
    [
        ("member@a", "submit", False),
        ("orgadmin@a", "submit", False),
        ("lead2@a", "abort", False),  # same org, not the submitter
        ("orgadmin@b", "abort", False),  # other org
        ("lead@b", "clone", False),
        ("orgadmin@a", "abort", True),  # own org
        ("admin@a", "delete", True),
        ("member@a", "get", True),
    ],
)
def test_authorisation_cells(gateway: GatewayProcess, user: str, action: str,
                             allowed: bool) -> None:
    with gateway.session("lead@a") as owner:
        job_id = owner.submit(job_zip("owned")).job_id
        if action == "delete":
            owner.abort(job_id)
    with gateway.session(user) as session:
        calls = {
            "submit": lambda: session.submit(job_zip("mine")),
            "abort": lambda: session.abort(job_id),
            "clone": lambda: session.clone(job_id),
            "delete": lambda: session.delete(job_id),
            "get": lambda: session.get(job_id),
        }
        if allowed:
            calls[action]()
        else:
            with pytest.raises(PermissionDenied) as denied:
                calls[action]()
            assert f"user {user!r}" in str(denied.value) and action in str(denied.value)


def test_watch_streams_until_final(gateway: GatewayProcess) -> None:
    with gateway.session("lead@a") as lead:
        job_id = lead.submit(job_zip("watched")).job_id
        stream = lead.watch(job_id)
        first = next(stream)
        assert first.status is JobStatus.SUBMITTED
        lead.abort(job_id, "enough")
        rest = list(stream)  # ends by itself at the final status
        assert [r.status for r in rest] == [JobStatus.FINISHED_ABORTED]


def test_listing_is_newest_first_with_filters(gateway: GatewayProcess) -> None:
    with gateway.session("lead@a") as lead, gateway.session("lead@b") as other:
        ids = [lead.submit(job_zip(f"order-{i}")).job_id for i in range(5)]
        theirs = other.submit(job_zip("order-theirs")).job_id
        assert [j.job_id for j in lead.list(name="order-")] == [theirs, *reversed(ids)]
        mine = lead.list(name="order-", submitter="lead@a", limit=2)
        assert [j.job_id for j in mine] == ids[:-3:-1]
        lead.abort(ids[0])
        aborted = lead.list(name="order-", status=JobStatus.FINISHED_ABORTED)
        assert [j.job_id for j in aborted] == [ids[0]]


def test_a_unique_job_id_prefix_works_through_the_sdk(gateway: GatewayProcess) -> None:
    """The job-store resolves a prefix (any case) for every job call; a watch resolves it once,
    so a second job with the same prefix submitted meanwhile does not break it. The prefix is
    long enough that no random id of the module's other jobs shares it (a 3-digit one did, one
    run in a few hundred)."""
    first, second = "9a1b2c3d-0000-4000-8000-000000000001", "9a1b2c3e-0000-4000-8000-000000000002"
    with gateway.session("lead@a") as lead:
        lead.submit(job_zip("prefix-sdk"), job_id=first)
        assert lead.get("9A1B2C3").job_id == first
        assert lead.metrics("9a1b2c3d") == []
        stream = lead.watch("9A1B2C3")
        assert next(stream).job_id == first
        lead.submit(job_zip("prefix-sdk"), job_id=second)
        with pytest.raises(InvalidArgument, match=f"job id prefix 9a1b2c3 is ambiguous: "
                                                  f"it matches {first}, {second}; give more"):
            lead.get("9a1b2c3")
        with pytest.raises(NotFound, match="job 9a1b2c3f not found"):
            lead.abort("9a1b2c3f")
        assert lead.abort("9A1B2C3D", "by prefix").job_id == first
        assert [(r.job_id, r.status) for r in stream] == [(first, JobStatus.FINISHED_ABORTED)]
        assert lead.clone("9a1b2c3d").job_id not in (first, second)
        lead.delete("9a1b2c3d")
        assert lead.get("9a1b2c3").job_id == second
