"""S3 with no static keys anywhere: boto3's default chain finds a role's temporary credentials at
a credentials endpoint (ECS/EKS container endpoint, or EC2 IMDSv2), as on a cloud; the S3 server
(SeaweedFS with its STS service) issued them and checks their session token on every request,
presigned ones included. See tests/fixtures/credentials_endpoint.py."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest

from fedhive.blobs import WRITE_ONCE_HEADERS, PresignedUploader, PresignedUrl, S3BlobStore
from fedhive.bus import RabbitBus
from fedhive.config import Settings, child_environment
from fedhive.errors import BlobAccessDenied, ConfigError, Unavailable
from fedhive.names import Names
from fedhive.proto.v1 import admin_pb2, job_pb2, jobstore_pb2
from fedhive.retry import Backoff
from tests.fixtures.credentials_endpoint import (
    CREDENTIAL_VARIABLES,
    CredentialsEndpoint,
    chain_env,
    chain_kind,
    chain_settings,
    credentials_endpoint,
    sts_s3,
)
from tests.fixtures.job_store import JobStoreProcess, job_zip, service_env, stage

__all__ = ["chain_env", "chain_kind", "chain_settings", "credentials_endpoint", "sts_s3"]

MiB = 1024 * 1024
QUICK = Backoff(base=0.01, cap=0.05, max_attempts=2)
SOON = 12 * 60  # an advertised lifetime inside botocore's 15-minute advisory refresh window


def _signer(url: PresignedUrl) -> str:
    """The access key a presigned URL was signed with."""
    return parse_qs(urlsplit(url.url).query)["X-Amz-Credential"][0].split("/")[0]


def _fetch(url: PresignedUrl) -> bytes:
    with urllib.request.urlopen(url.url, timeout=10) as response:
        return bytes(response.read())


def _store(settings: Settings) -> S3BlobStore:
    store = S3BlobStore.from_settings(settings, part_size=5 * MiB, multipart_threshold=5 * MiB)
    store.ensure_bucket()
    return store


def test_blob_store_works_on_role_credentials_alone(
    chain_settings: Settings, credentials_endpoint: CredentialsEndpoint, namespace: str
) -> None:
    assert chain_settings.aws_access_key_id is None
    assert not any(os.environ.get(name) for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))
    store = _store(chain_settings)
    try:
        assert credentials_endpoint.vends >= 1
        role_key = credentials_endpoint.vended[-1].access_key
        assert role_key.startswith("ASIA")  # temporary credentials, with a session token

        store.put(f"{namespace}/small", b"hello")
        assert store.get(f"{namespace}/small") == b"hello"
        data = np.random.default_rng(1).integers(0, 256, 11 * MiB + 7, dtype=np.uint8)
        store.put(f"{namespace}/large", data.data)  # multipart: 3 parts
        back = np.empty_like(data)
        store.read_into(f"{namespace}/large", back.data)
        assert np.array_equal(back, data)

        got = store.presign_get(f"{namespace}/small", 300)
        assert "X-Amz-Security-Token=" in got.url and _signer(got) == role_key
        assert _fetch(got) == b"hello"

        uploader = PresignedUploader(backoff=QUICK, workers=3)
        try:
            put = store.presign_put(f"{namespace}/put", 300, write_once=True)
            assert "X-Amz-Security-Token=" in put.url
            uploader.put(put.url, f"{namespace}/put", b"by url", headers=WRITE_ONCE_HEADERS)
            assert store.get(f"{namespace}/put") == b"by url"

            grant = store.presign_multipart(f"{namespace}/parts", data.nbytes, 5 * MiB, 300)
            assert all("X-Amz-Security-Token=" in url.url for url in grant.urls)
            etags = uploader.put_parts(grant, f"{namespace}/parts", data.data)
            store.complete_multipart(f"{namespace}/parts", grant.upload_id, etags)
        finally:
            uploader.close()
        store.read_into(f"{namespace}/parts", back.data)
        assert np.array_equal(back, data)
    finally:
        store.close()


@pytest.mark.parametrize("chain_kind", ["container"], indirect=True)
def test_a_long_lived_store_refreshes_its_role_credentials(
    chain_settings: Settings, credentials_endpoint: CredentialsEndpoint, namespace: str
) -> None:
    """Credentials said to expire soon are replaced at the store's next request, from the same
    endpoint, and the new ones sign from then on. (Only the container protocol: for IMDS,
    botocore stretches a near expiry by 17-25 minutes before it would refresh.)"""
    _store(chain_settings).close()  # the bucket, beforehand
    credentials_endpoint.lifetimes = [SOON, SOON]  # the next two vends expire "soon"
    store = S3BlobStore.from_settings(chain_settings)
    try:
        first = credentials_endpoint.vends
        url = store.presign_get(f"{namespace}/rotated", 3600)  # signing refreshes
        assert credentials_endpoint.vends == first + 1
        second = credentials_endpoint.vended[-1]
        assert _signer(url) == second.access_key
        # the URL dies with the credentials that signed it, not 3600 s from now
        dies_s = int(second.expiration.replace(microsecond=0).timestamp())
        assert url.expires_at_ms == dies_s * 1000

        store.put(f"{namespace}/rotated", b"v1")  # refreshes once more, to a long-lived set
        assert credentials_endpoint.vends == first + 2
        for _ in range(3):
            assert store.get(f"{namespace}/rotated") == b"v1"
        later = store.presign_get(f"{namespace}/rotated", 300)
        assert credentials_endpoint.vends == first + 2  # fresh enough: no more refreshes
        keys = [vended.access_key for vended in credentials_endpoint.vended]
        assert len(set(keys)) == len(keys) and _signer(later) == keys[-1]
        assert _fetch(url) == b"v1" and _fetch(later) == b"v1"  # both sets are valid
    finally:
        store.close()


CHILD = """
from fedhive.blobs import S3BlobStore
from fedhive.config import Settings
store = S3BlobStore.from_settings(Settings.from_env())
store.put(NAMESPACE + "/from-child", b"child")
store.close()
"""


def test_a_child_process_resolves_its_own_credentials(
    chain_settings: Settings, credentials_endpoint: CredentialsEndpoint, namespace: str
) -> None:
    """What the job-runner hands a server job (`child_environment()`): the chain's variables,
    never the credentials this process resolved."""
    store = _store(chain_settings)
    try:
        store.put(f"{namespace}/parent", b"parent")  # this process holds live credentials now
        env = child_environment({
            "FEDHIVE_S3_ENDPOINT_URL": chain_settings.s3_endpoint_url or "",
            "FEDHIVE_S3_BUCKET": chain_settings.s3_bucket})
        assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"} & set(env)
        before = credentials_endpoint.vends
        subprocess.run([sys.executable, "-c", CHILD.replace("NAMESPACE", repr(namespace))],
                       env=env, check=True, timeout=60)
        assert credentials_endpoint.vends == before + 1  # it asked the endpoint itself
        assert store.get(f"{namespace}/from-child") == b"child"
    finally:
        store.close()


class ChainJobStore(JobStoreProcess):
    """The job-store with `service_env`'s settings (no keys) plus the chain's variables."""

    def __init__(self, settings: Settings, log_path: Path, chain: dict[str, str]) -> None:
        super().__init__(settings, log_path)
        self.env = service_env(settings) | chain

    def start(self) -> None:
        assert not set(self.env) & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fedhive_services.job_store.main"], env=self.env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_the_job_store_stores_a_job_on_role_credentials(
    chain_settings: Settings, chain_env: dict[str, str],
    credentials_endpoint: CredentialsEndpoint, make_bus: Callable[..., RabbitBus],
    tmp_path: Path,
) -> None:
    bus = make_bus(name="chain-client")
    names = Names(chain_settings.namespace)
    store = _store(chain_settings)
    ours = credentials_endpoint.vends
    service = ChainJobStore(chain_settings, tmp_path / "job-store.log", chain_env)
    service.start()
    try:
        service.wait_ready(bus)
        assert credentials_endpoint.vends > ours  # the service resolved its own credentials
        staging = stage(store, names, job_zip("chain"))
        submitted = bus.call(service.queue, jobstore_pb2.StoreSubmitJob(
            staging_key=staging, submitter=job_pb2.Submitter(name="alice", org="a", role="lead")),
            admin_pb2.SubmitJobReply, timeout=30.0)
        assert isinstance(submitted, admin_pb2.SubmitJobReply)
        assert store.exists(names.job_definition_key(submitted.job_id))
        assert not store.exists(staging)
    finally:
        service.stop()
        store.delete_prefix(f"{chain_settings.namespace}/")
        store.close()


@pytest.mark.parametrize("chain_kind", ["container"], indirect=True)
def test_credentials_s3_never_issued_fail_in_one_line(
    chain_settings: Settings, chain_env: dict[str, str],
    credentials_endpoint: CredentialsEndpoint, tmp_path: Path,
) -> None:
    credentials_endpoint.foreign = True
    store = S3BlobStore.from_settings(chain_settings)
    try:
        with pytest.raises(BlobAccessDenied) as denied:
            store.put(f"{chain_settings.namespace}/x", b"x")
        assert "InvalidAccessKeyId" in str(denied.value) and "\n" not in str(denied.value)
    finally:
        store.close()

    service = ChainJobStore(chain_settings, tmp_path / "job-store.log", chain_env)
    service.start()
    assert service.proc is not None
    assert service.proc.wait(timeout=60) == 2
    lines = service.log_path.read_text().strip().splitlines()
    assert lines[-1].startswith("fedhive-job-store: checking blob ")
    assert "InvalidAccessKeyId" in lines[-1]


@pytest.mark.parametrize("chain_kind", ["container"], indirect=True)
def test_an_endpoint_that_refuses_is_one_line(
    chain_settings: Settings, credentials_endpoint: CredentialsEndpoint,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN", "not-the-token")
    with pytest.raises(Unavailable) as refused:
        S3BlobStore.from_settings(chain_settings)
    message = str(refused.value)
    assert message.startswith("S3 credentials: ") and "container-role" in message
    assert "\n" not in message and credentials_endpoint.vends == 0


@pytest.mark.parametrize("chain_kind", ["imds"], indirect=True)
def test_no_credentials_at_all_is_one_line(
    chain_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_EC2_METADATA_SERVICE_ENDPOINT")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role either
    store = S3BlobStore.from_settings(chain_settings)
    try:
        with pytest.raises(ConfigError, match=r"^checking blob .*: no S3 credentials: set "
                                              r"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "):
            store.ensure_bucket()
    finally:
        store.close()


def test_no_credentials_variable_reaches_this_process(chain_env: dict[str, str]) -> None:
    """The chain fixtures leave only the endpoint's variables (a guard on the guard)."""
    present = {name for name in CREDENTIAL_VARIABLES if os.environ.get(name)}
    assert present == set(chain_env) - {"AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"}
