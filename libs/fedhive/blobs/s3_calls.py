"""How the S3 store talks to S3 through boto3: the clients built from `Settings`, and one
request run with typed errors and the one retry policy.

Retries: botocore's own retries are switched off so that every transient failure (connection
reset, 5xx, throttling) goes through the one policy, `fedhive.retry.Backoff`, per request (one
part, one range), not per whole transfer.

Checksums: botocore's CRC32 request/response checksums are off ("when_required"). Tensor
bytes carry a BLAKE3 checksum verified end to end by the codec (S3's whole-object checksums
cannot cover a ranged read anyway), and on plain-HTTP endpoints SigV4 still hashes each
payload.

Credentials: static keys from `Settings` when set, else boto3's default chain (profile, web
identity, ECS/EKS container endpoint, EC2 instance metadata). Chain credentials are temporary:
botocore refreshes them before they expire, in this process, from the same source; nothing here
copies them anywhere (a child process resolves them through the chain itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import boto3
import structlog
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionError,
    CredentialRetrievalError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    ResponseStreamingError,
)

from fedhive.blobs.failures import s3_failure
from fedhive.config import Settings
from fedhive.errors import ConfigError, FedhiveError, Unavailable
from fedhive.retry import Backoff

if TYPE_CHECKING:
    from botocore.credentials import Credentials
    from mypy_boto3_s3 import S3Client

T = TypeVar("T")
log = structlog.get_logger()

TRANSIENT = (
    ConnectionError, HTTPClientError, ResponseStreamingError, IncompleteReadError, OSError
)


@dataclass(frozen=True)
class S3Clients:
    client: S3Client  # every request
    presigner: S3Client | None  # signs URLs for the public endpoint, when there is one
    credentials: Credentials | None  # what both sign with (for its expiry)


def connect(settings: Settings, *, workers: int) -> S3Clients:
    """`s3_endpoint_url` None means AWS (virtual-hosted addressing); a custom endpoint
    (SeaweedFS, MinIO) gets path-style addressing. Credentials: the explicit ones in `settings`
    when set, else boto3's default chain. `s3_public_endpoint_url`, when set, is the endpoint
    presigned URLs are signed for: a second client, used only to sign (signing is local, it
    never opens a connection). A credentials source that fails (a container endpoint refusing)
    is `Unavailable`, in one line."""
    session = boto3.session.Session(
        aws_access_key_id=settings.aws_access_key_id,
        aws_secret_access_key=settings.aws_secret_access_key,
        aws_session_token=settings.aws_session_token,
        region_name=settings.s3_region,
    )
    config = Config(
        signature_version="s3v4",
        s3={"addressing_style": "path" if settings.s3_endpoint_url else "auto"},
        retries={"total_max_attempts": 1},
        max_pool_connections=max(10, 2 * workers),
        connect_timeout=10,
        read_timeout=60,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    try:  # the chain is resolved here, once per session; clients share what it found
        credentials = session.get_credentials()
    except CredentialRetrievalError as err:
        raise credentials_failed(err) from err
    client = session.client("s3", endpoint_url=settings.s3_endpoint_url, config=config,
                            verify=settings.s3_ca_file)
    presigner = None
    if settings.s3_public_endpoint_url:
        presigner = session.client(
            "s3",
            endpoint_url=settings.s3_public_endpoint_url,
            config=config.merge(Config(s3={"addressing_style": "path"})),
        )
    return S3Clients(client, presigner, credentials)


def call(backoff: Backoff, action: str, key: str, fn: Callable[[], T]) -> T:
    """Run one S3 request with typed errors, retrying transient ones with `backoff`."""

    def once() -> T:
        try:
            return fn()
        except ClientError as err:
            raise translate(err, action, key) from err
        except NoCredentialsError as err:
            raise ConfigError(f"{action} blob {key}: no S3 credentials: set "
                              "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or give the "
                              "process a role (instance profile, ECS/EKS task role, "
                              "AWS_PROFILE)", field="AWS_ACCESS_KEY_ID") from err
        except CredentialRetrievalError as err:  # a refresh failed: maybe a blip, retried
            raise credentials_failed(err) from err
        except TRANSIENT as err:
            raise Unavailable(f"{action} blob {key}: {err!r}", field=key) from err

    def on_retry(err: BaseException, wait: float) -> None:
        log.warning("s3 request retried", key=key, action=action, error=str(err), wait=wait)

    return backoff.call(once, retry_on=(Unavailable,), on_retry=on_retry)


def translate(err: ClientError, action: str, key: str) -> FedhiveError:
    error = err.response.get("Error", {})
    status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
    return s3_failure(status, error.get("Code", ""), error.get("Message", ""), key, action)


def credentials_failed(err: CredentialRetrievalError) -> Unavailable:
    """botocore names the source (container-role, sso, ...); its error body may span lines."""
    return Unavailable(f"S3 credentials: {' '.join(str(err).split())}", field="credentials")
