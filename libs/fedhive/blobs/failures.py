"""Translate S3 failures (HTTP status + S3 error code) into fedhive's typed errors, once.

Both readers use it: the boto3 adapter (from `ClientError`) and the plain-HTTP presigned-URL
reader (from S3's XML error document). Transient failures become `Unavailable`, the one error
the blob code retries (with `fedhive.retry.Backoff`).
"""

from __future__ import annotations

from xml.etree import ElementTree

from fedhive.errors import (
    AlreadyExists,
    BlobAccessDenied,
    BlobNotFound,
    FedhiveError,
    InvalidArgument,
    Unavailable,
)

# ConditionalRequestConflict (409): AWS's answer to a conditional write racing another write
# of the key; retried, it answers 412 or succeeds
_THROTTLED = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                        "InternalError", "ServiceUnavailable", "RequestTimeTooSkewed",
                        "ConditionalRequestConflict"})
_BAD_MULTIPART = frozenset({"InvalidPart", "InvalidPartOrder", "EntityTooSmall", "NoSuchUpload",
                            "MalformedXML"})
_AUTH_400 = frozenset({"ExpiredToken", "AuthorizationQueryParametersError", "InvalidToken",
                       "TokenRefreshRequired"})


def parse_error_document(body: bytes) -> tuple[str, str]:
    """(Code, Message) of an S3 XML error document; empty strings when there is none."""
    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError:
        return "", ""
    return (root.findtext("Code") or "").strip(), (root.findtext("Message") or "").strip()


def s3_failure(status: int, code: str, message: str, key: str, action: str) -> FedhiveError:
    """The typed error for a failed S3 request on `key` (`action` is e.g. "reading")."""
    if code in _BAD_MULTIPART:
        detail = "no such multipart upload" if code == "NoSuchUpload" else f"{code}: {message}"
        return InvalidArgument(f"{action} blob {key}: {detail}".strip(), field=key)
    if status == 404 or code in ("NoSuchKey", "NoSuchBucket", "NotFound"):
        what = "bucket" if code == "NoSuchBucket" else "object"
        return BlobNotFound(f"{what} not found {action} blob {key}", field=key)
    if status == 403 or code in _AUTH_400:
        if "expired" in message.lower() or code == "ExpiredToken":
            reason = "the presigned URL or credentials have expired"
        elif code == "SignatureDoesNotMatch":
            reason = "the signature does not match (tampered, forged or mis-signed request)"
        else:
            reason = f"access denied ({code or status}: {message or 'no detail'})"
        return BlobAccessDenied(f"{action} blob {key}: {reason}", field=key)
    if status == 412 or code == "PreconditionFailed":  # a write-once write (`If-None-Match: *`)
        return AlreadyExists(f"{action} blob {key}: the object exists already (a write-once "
                             "write)", field=key)
    if status == 416 or code == "InvalidRange":
        return InvalidArgument(f"{action} blob {key}: byte range outside the object", field=key)
    if status >= 500 or status == 429 or code in _THROTTLED:
        return Unavailable(f"{action} blob {key}: S3 answered {status} {code}".strip(), field=key)
    return FedhiveError(f"{action} blob {key}: S3 answered {status} {code} {message}", field=key)
