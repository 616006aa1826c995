"""Deploying an app bundle: check that its presigned URL names the job's bundle at the
deployment's own object store, download it (plain HTTP(S), no credentials) within a size limit,
and unpack it safely, all or nothing.

S3 failures are translated by `fedhive.blobs.failures` (an expired URL is `BlobAccessDenied`);
the archive checks and the atomic extraction are `fedhive.jobs.archive`'s.
"""

from __future__ import annotations

import http.client
import shutil
import ssl
from pathlib import Path
from urllib.parse import unquote, urlsplit

from fedhive.blobs.failures import parse_error_document, s3_failure
from fedhive.errors import BlobAccessDenied, InvalidArgument, PermissionDenied, Unavailable
from fedhive.jobs.archive import ArchiveLimits, UnsafeArchive, extract_archive
from fedhive.retry import Backoff

_ERROR_BODY_LIMIT = 64 * 1024
_CHUNK = 1024 * 1024
DOWNLOAD_RETRY = Backoff(base=0.2, cap=2.0, max_attempts=4)


_DEFAULT_PORTS = {"http": 80, "https": 443}


def check_url(url: str, storage_url: str, key: str, job_id: str) -> None:
    """`url` must name the object `key` at `storage_url` (same scheme, host and port, the
    storage URL's path then the key): PermissionDenied otherwise, naming the expected object."""
    got, base = urlsplit(url), urlsplit(storage_url)
    try:
        origin = (got.scheme, got.hostname, got.port or _DEFAULT_PORTS.get(got.scheme))
    except ValueError:  # a port that is not a number
        origin = None
    expected = (base.scheme, base.hostname, base.port or _DEFAULT_PORTS.get(base.scheme))
    if origin != expected or got.username or got.password or got.fragment \
            or unquote(got.path) != f"{base.path.rstrip('/')}/{key}":
        raise PermissionDenied(f"deploy of job {job_id} refused: the bundle URL is not the "
                               f"deployment's object {key} at {storage_url}", field="bundle_url")


def download(
    url: str,
    *,
    what: str,
    limit: int,
    timeout: float = 60.0,
    backoff: Backoff = DOWNLOAD_RETRY,
) -> bytes:
    """GET `url`; `what` names the object in errors. Refuses bodies over `limit` bytes (checked
    on Content-Length before reading, and while reading). Transient failures are retried."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(f"{what}: bundle URL must be an http(s) URL", field="bundle_url")

    def once() -> bytes:
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(
                parts.hostname or "", parts.port, timeout=timeout,
                context=ssl.create_default_context(),
            )
        else:
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
        try:
            target = parts.path + (f"?{parts.query}" if parts.query else "")
            conn.request("GET", target)
            response = conn.getresponse()
            if response.status >= 300:
                code, message = parse_error_document(response.read(_ERROR_BODY_LIMIT))
                failure = s3_failure(response.status, code, message, what, "downloading")
                failure.field = "bundle_url"
                raise failure
            declared = response.getheader("Content-Length")
            if declared is not None and int(declared) > limit:
                raise _too_big(what, int(declared), limit)
            body = bytearray()
            while chunk := response.read(_CHUNK):
                body += chunk
                if len(body) > limit:
                    raise _too_big(what, len(body), limit)
            return bytes(body)
        except (OSError, http.client.HTTPException) as err:
            raise Unavailable(f"downloading {what}: {err!r}", field="bundle_url") from err
        finally:
            conn.close()

    return backoff.call(once, retry_on=(Unavailable,))


def _too_big(what: str, size: int, limit: int) -> UnsafeArchive:
    return UnsafeArchive(
        [f"{what} is at least {size} bytes, more than the limit of {limit}"], field="archive"
    )


def install(bundle: bytes, dest: Path, limits: ArchiveLimits) -> list[str]:
    """Unpack `bundle` into `dest` all or nothing. A `dest` left from an earlier attempt that
    was never recorded as deployed is replaced."""
    if dest.exists():
        shutil.rmtree(dest)
    return extract_archive(bundle, dest, limits)


def expired(expires_at_ms: int, now_ms: int) -> bool:
    """Whether a URL with this expiry (0: unknown) has expired already."""
    return 0 < expires_at_ms <= now_ms


def expired_error(job_id: str, expires_at_ms: int) -> BlobAccessDenied:
    return BlobAccessDenied(
        f"deploy of job {job_id}: the bundle URL expired at {expires_at_ms} ms (unix epoch); "
        f"ask for a fresh one",
        field="bundle_url",
    )
