"""Stream an object from a presigned GET URL in chunks, without holding it in memory.

The job-store hands out presigned URLs (it owns the job's objects); the gateway relays the
bytes to the admin as they arrive. S3 error documents become fedhive's typed blob errors.
"""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from urllib.parse import urlsplit

from fedhive.blobs.failures import parse_error_document, s3_failure
from fedhive.errors import InvalidArgument, Unavailable

_ERROR_BODY_LIMIT = 64 * 1024


def stream_url(url: str, what: str, *, chunk_size: int, timeout: float) -> Iterator[bytes]:
    """Yield the object's bytes; `what` names it in errors (e.g. "job <id> definition")."""
    parts = urlsplit(url)
    if parts.scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            parts.hostname or "", parts.port, timeout=timeout
        )
    elif parts.scheme == "http":
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    else:
        raise InvalidArgument(f"{what}: URL scheme {parts.scheme!r} is not http(s)", field="url")
    try:
        try:
            conn.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""))
            response = conn.getresponse()
            if response.status >= 300:
                code, message = parse_error_document(response.read(_ERROR_BODY_LIMIT))
                raise s3_failure(response.status, code, message, what, "reading")
            while chunk := response.read(chunk_size):
                yield chunk
        except (OSError, http.client.HTTPException) as err:
            raise Unavailable(f"reading {what}: {err!r}", field=what) from err
    finally:
        conn.close()
