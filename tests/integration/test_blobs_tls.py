"""The S3 store's own reads over HTTPS trust what its boto3 client trusts: a private CA named by
`AWS_CA_BUNDLE`, nothing else; a refused certificate is a one-line ConfigError at once. Against
a real TLS server on loopback (a certificate from a CA the test makes), answering a ranged GET
as S3 does."""

from __future__ import annotations

import http.server
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedhive.blobs import PresignedFetcher
from fedhive.blobs.port import BlobLocation
from fedhive.blobs.s3 import _verify_as_boto3
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
        https_url: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    url, ca = https_url
    where = BlobLocation("bucket/key", url)
    monkeypatch.setenv("AWS_CA_BUNDLE", str(ca))
    trusting = PresignedFetcher(ssl_context=_verify_as_boto3())
    dest = bytearray(4)
    trusting.fetch_range(where, 3, [memoryview(dest)])
    assert bytes(dest) == b"3456" and trusting.length(where) == len(BODY)
    trusting.close()

    monkeypatch.delenv("AWS_CA_BUNDLE")
    system_only = PresignedFetcher(ssl_context=_verify_as_boto3())
    with pytest.raises(ConfigError, match=r"reading blob bucket/key: the TLS certificate of "
                                          r"127\.0\.0\.1 is refused \(.+\): trust its CA"):
        system_only.length(where)  # not Unavailable: nothing retries it
    system_only.close()
