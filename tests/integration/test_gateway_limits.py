"""The upload size limit is enforced while the archive arrives: nothing is staged."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from fedhive.blobs import BlobStore
from fedhive.config import Settings
from fedhive.jobs.archive import MiB
from fedhive.names import Names
from fedhive.proto.v1 import admin_pb2
from tests.fixtures.gateway import GatewayProcess, write_admins


@pytest.fixture
def small_gateway(settings: Settings, tmp_path: Path) -> Iterator[GatewayProcess]:
    admins = write_admins(tmp_path / "admins.json")
    service = GatewayProcess(settings, admins, tmp_path / "gateway.log",
                             extra_args=("--max-archive-mib", "1"))
    service.start()
    try:
        service.wait_ready()
        yield service
    finally:
        service.stop()


def test_oversized_upload_is_refused_before_staging(
    small_gateway: GatewayProcess, blob_store: BlobStore, settings: Settings
) -> None:
    sent: list[int] = []
    block = os.urandom(MiB)

    def chunks() -> Iterator[admin_pb2.SubmitJobChunk]:
        for _ in range(64):  # 64 MiB offered; the gateway stops reading after the second MiB
            sent.append(1)
            yield admin_pb2.SubmitJobChunk(data=block)

    with small_gateway.session("admin@a") as session, pytest.raises(grpc.RpcError) as caught:
        session._stub.SubmitJob(chunks(), metadata=session._metadata, timeout=30)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "job archive is larger than the limit of 1 MiB"
    assert len(sent) < 64  # the client stopped sending: the upload was cut short
    staging = Names(settings.namespace).staging_key("x").rsplit("/", 1)[0] + "/"
    assert blob_store.delete_prefix(staging) == 0
