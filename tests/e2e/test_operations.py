"""Operation-driven jobs end to end (seed 004's operation process engine): a test process keeps
the training loop and runs each round as an operation on a real system's sites, through the
gateway (tests/fixtures/e2e.py: real RabbitMQ, Redis, S3, services and site agents)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedhive.blobs import TensorRef, checksum
from fedhive.errors import BlobNotFound, FailedPrecondition, InvalidArgument, NotFound
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import operation_pb2
from fedhive.sdk import Session
from fedhive.sdk.operations import operation_job, request_for, run_until_done, to_dxo
from tests.fixtures.e2e import System
from tests.fixtures.tiers import ADMIN, fedavg, sag_job, site_app, start_gateway

S = JobStatus


@pytest.fixture(scope="module")
def session(e2e_system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    gateway = start_gateway(e2e_system, tmp_path_factory.mktemp("operations"))
    try:
        with gateway.session(ADMIN) as admin:
            yield admin
    finally:
        gateway.stop()


def test_three_rounds_of_fedavg_driven_from_a_test_process(
        session: Session, e2e_system: System, tmp_path: Path) -> None:
    sites = e2e_system.sites[:2]
    offsets, weights = {sites[0]: 1.0, sites[1]: 4.0}, {sites[0]: 1.0, sites[1]: 3.0}
    app = site_app(tmp_path / "app", offsets, weights)
    job_id = session.start_operation_job(app, sites=sites, min_clients=2).job_id
    model = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    expected = {"w": model["w"].astype(np.float64)}
    for number in range(3):
        result = session.call_operation(job_id, "train", model, meta={"current_round": number},
                                        read_wait=60)
        model = result.data
        expected = fedavg(expected, sites, offsets, weights)
        np.testing.assert_allclose(model["w"], expected["w"], rtol=1e-6)
        assert result.weight == 4.0
        assert set(result.contributions) == set(sites)
        assert result.contributions[sites[1]]["weight"] == 3.0
    # A manager of the job cannot make its server job send a result anywhere but an S3 URL.
    bad = operation_pb2.ExportRequest(job_id=job_id, op_id=result.op_id)
    bad.targets.add(name="w", url="http://169.254.169.254/latest/api/token")
    with pytest.raises(InvalidArgument, match="not an http"):
        session.export_operation(bad)
    session.end_operation_job(job_id)
    record = e2e_system.wait_final(job_id)
    assert record.status is S.FINISHED_COMPLETED, record.status_reason
    rounds = session.metrics(job_id)
    assert [r.round for r in rounds] == [0, 1, 2]
    assert set(rounds[0].metrics["sites"]) == set(sites)
    with pytest.raises(FailedPrecondition, match="takes no more operations"):
        session.call_operation(job_id, "train", model)


def test_an_export_operation_keeps_its_result_off_the_store_until_it_is_copied_up(
        session: Session, e2e_system: System, tmp_path: Path) -> None:
    """A hub site's kind of operation: its aggregate (over the inline threshold) is kept in the
    server job's files, never in this system's store, and `ExportOperationResult` copies it to
    the caller's presigned target; once the next operation ended it is gone."""
    sites = e2e_system.sites[:2]
    app = site_app(tmp_path / "app", {sites[0]: 1.0, sites[1]: 3.0}, dict.fromkeys(sites, 1.0))
    job_id = session.start_operation_job(app, sites=sites, min_clients=2).job_id
    model = {"w": np.zeros(e2e_system.settings.inline_threshold // 4 + 1, np.float32)}

    def run(op_id: str) -> TensorRef:
        request = request_for(job_id, "train", to_dxo(model), op_id=op_id)
        request.export = True
        ref = run_until_done(session.run_operation, request, read_wait=60).dxo.data["w"]
        assert isinstance(ref, TensorRef)
        return ref

    ref = run("first")
    assert ref.key and not ref.url  # a key for the grant's checksum; nothing to read here
    with pytest.raises(BlobNotFound):
        e2e_system.blobs.size(ref.key)
    target = f"{e2e_system.settings.namespace}/upper/{job_id}/w"
    export = operation_pb2.ExportRequest(job_id=job_id, op_id="first")
    export.targets.add(name="w", write_once=True,
                       url=e2e_system.blobs.presign_put(target, 600, write_once=True).url)
    session.export_operation(export)
    body = np.frombuffer(e2e_system.blobs.get(target), np.float32)
    np.testing.assert_array_equal(body, np.full_like(model["w"], 2.0))  # (0+1 + 0+3) / 2
    assert checksum.digest(body) == ref.checksum

    run("second")
    with pytest.raises(NotFound, match="no longer kept"):
        session.export_operation(export)
    session.end_operation_job(job_id)
    assert e2e_system.wait_final(job_id).status is S.FINISHED_COMPLETED


def test_a_relay_operation_passes_each_result_to_the_next_site(
        session: Session, e2e_system: System, tmp_path: Path) -> None:
    sites = e2e_system.sites[:2]
    offsets, weights = {sites[0]: 1.0, sites[1]: 10.0}, {sites[0]: 1.0, sites[1]: 1.0}
    job_id = session.start_operation_job(site_app(tmp_path / "app", offsets, weights),
                                         sites=sites, min_clients=2).job_id
    try:
        result = session.call_operation(job_id, "train", {"w": np.zeros(3, np.float32)},
                                        method="relay", args={"targets": sites}, read_wait=60)
        np.testing.assert_allclose(result.data["w"], np.full(3, 11.0))  # both, in turn
    finally:
        session.end_operation_job(job_id)
    assert e2e_system.wait_final(job_id).status is S.FINISHED_COMPLETED


def test_operations_on_a_job_that_is_not_operation_driven_are_refused(
        session: Session, e2e_system: System, tmp_path: Path) -> None:
    # Rounds enough to outlive the refusal (hello-numpy's three can end before it: then the
    # refusal is, rightly, that the job has ended).
    offsets, weights = dict.fromkeys(e2e_system.sites, 0.0), dict.fromkeys(e2e_system.sites, 1.0)
    job = sag_job(tmp_path / "job", site_app(tmp_path / "app", offsets, weights), min_clients=2,
                  num_rounds=100_000, initial={"w": np.zeros(1, np.float32)})
    job_id = session.submit(job).job_id
    e2e_system.wait_status(job_id, S.RUNNING, timeout=60)
    with pytest.raises(FailedPrecondition, match="not operation-driven"):
        session.call_operation(job_id, "train", {"w": np.zeros(1, np.float32)}, read_wait=30)
    session.abort(job_id)
    assert e2e_system.wait_final(job_id, timeout=60).status is S.FINISHED_ABORTED


def test_an_unknown_operator_method_is_refused_at_submit(session: Session,
                                                         tmp_path: Path) -> None:
    archive = operation_job(site_app(tmp_path / "app", {}, {}), sites=["x"],
                            operators={"train": {"method": "gossip"}})
    with pytest.raises(InvalidArgument, match=r"operators.train.*gossip"):
        session.submit(archive)
    archive = operation_job(site_app(tmp_path / "app", {}, {}), sites=["x"],
                            operators={"train": {"method": "bcast", "aggregator": "agg"}})
    with pytest.raises(InvalidArgument, match="aggregator names component 'agg'"):
        session.submit(archive)
