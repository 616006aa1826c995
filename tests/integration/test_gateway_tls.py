"""The gateway with TLS and mutual TLS (certificates made with openssl for the test)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from fedhive.config import Settings
from fedhive.errors import Unauthenticated
from fedhive.sdk import Session
from tests.fixtures.gateway import GatewayProcess, health_status, write_admins

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _issue(cwd: Path, name: str, extensions: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=cwd)
    (cwd / f"{name}.ext").write_text(extensions + "\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext",
             cwd=cwd)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca",
             cwd=cwd)
    _issue(cwd, "server", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                          "extendedKeyUsage=serverAuth")
    _issue(cwd, "client", "extendedKeyUsage=clientAuth")
    return cwd


@pytest.fixture
def mtls_gateway(settings: Settings, certs: Path, tmp_path: Path) -> Iterator[GatewayProcess]:
    admins = write_admins(tmp_path / "admins.json")
    service = GatewayProcess(settings, admins, tmp_path / "gateway.log", extra_args=(
        "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
        "--tls-client-ca", str(certs / "ca.pem"),
    ))
    service.start()
    try:
        service.wait_ready(credentials=_credentials(certs, client=True))
        yield service
    finally:
        service.stop()


def _credentials(certs: Path, *, client: bool) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=(certs / "ca.pem").read_bytes(),
        private_key=(certs / "client.key").read_bytes() if client else None,
        certificate_chain=(certs / "client.pem").read_bytes() if client else None,
    )


def test_mutual_tls(mtls_gateway: GatewayProcess, certs: Path) -> None:
    address = mtls_gateway.address
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health_status(address, "", _credentials(certs, client=True)) == serving
    for refused in (_credentials(certs, client=False), None):  # no client cert; plaintext
        with pytest.raises(grpc.RpcError) as caught:
            health_status(address, "", refused)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE

    # The SDK over mutual TLS reaches the servicer: the bad token is what it refuses.
    with Session(address, "fh_wrong", root_certificates=certs / "ca.pem",
                 client_cert=certs / "client.pem", client_key=certs / "client.key") as session, \
            pytest.raises(Unauthenticated):
        session.sites()


def test_unreadable_certificate_stops_the_start_in_one_line(settings: Settings,
                                                             tmp_path: Path) -> None:
    admins = write_admins(tmp_path / "admins.json")
    service = GatewayProcess(settings, admins, tmp_path / "gateway.log", extra_args=(
        "--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(tmp_path / "missing.key"),
    ))
    service.start()
    assert service.proc is not None
    assert service.proc.wait(timeout=60) == 2
    assert service.log_tail(1) == f"gateway: TLS key {tmp_path / 'missing.key'}: No such file " \
                                  "or directory"
