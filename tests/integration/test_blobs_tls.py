"""The S3 store's reads over HTTPS trust the CA its settings name (`AWS_CA_BUNDLE`, as its boto3
client does), nothing else; a refused certificate is a one-line ConfigError at once. Against a
real TLS server on loopback (a certificate from a CA the test makes) standing in for S3's
endpoint, answering a ranged GET as S3 does."""

from __future__ import annotations

import http.server
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedhive.blobs import S3BlobStore
from fedhive.blobs.port import BlobLocation
from fedhive.config import Settings
from fedhive.errors import ConfigError
from tests.fixtures.certs import CertAuthority

BODY = b"0123456789"


class _Ranged(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        first, _, last = self.headers["Range"].removeprefix("bytes=").partition("-")
        part = BODY[int(first):int(last) + 1]
        self.send_response(206)
        self.send_header("Content-Length", str(len(part)))
        self.send_header("Content-Range", f"bytes {first}-{last}/{len(BODY)}")
        self.end_headers()
        self.wfile.write(part)


@pytest.fixture
def https_url(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    ca = CertAuthority.create(tmp_path / "ca")
    cert = ca.issue("s3", ips=("127.0.0.1",))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ranged)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert.cert, cert.key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{server.server_address[1]}/bucket/key", ca.pem
    server.shutdown()
    server.server_close()


def test_the_stores_reads_trust_the_ca_in_aws_ca_bundle_only(
        https_url: tuple[str, Path]) -> None:
    url, ca = https_url
    endpoint = url.removesuffix("/bucket/key")
    env = {"FEDHIVE_S3_ENDPOINT_URL": endpoint, "FEDHIVE_S3_BUCKET": "bucket",
           "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    trusting = S3BlobStore.from_settings(Settings.from_env({**env, "AWS_CA_BUNDLE": str(ca)}))
    dest = bytearray(4)
    trusting.fetch_range(BlobLocation("key"), 3, [memoryview(dest)])
    assert bytes(dest) == b"3456" and trusting.size("key") == len(BODY)
    trusting.close()

    system_only = S3BlobStore.from_settings(Settings.from_env(env))
    with pytest.raises(ConfigError, match=r"reading blob key: the TLS certificate of "
                                          r"127\.0\.0\.1 is refused \(.+\): trust its CA"):
        system_only.size("key")  # not Unavailable: nothing retries it
    system_only.close()
