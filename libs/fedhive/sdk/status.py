"""fedhive errors on gRPC: the one table both edges use.

The gateway turns a `FedhiveError` into a gRPC status (code from `GRPC_CODES`, the one-line
message as details) and adds the fedhive code and field as trailing metadata; the SDK turns it
back into the same typed error. Generic gRPC clients still see a meaningful status code.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from fedhive.errors import FedhiveError, Unavailable, from_code

CODE_KEY = "fedhive-code"
FIELD_KEY = "fedhive-field"

S = grpc.StatusCode
GRPC_CODES: dict[str, grpc.StatusCode] = {
    "INVALID_ARGUMENT": S.INVALID_ARGUMENT,
    "MALFORMED_MESSAGE": S.INVALID_ARGUMENT,
    "CONFIG_INVALID": S.INVALID_ARGUMENT,
    "NOT_FOUND": S.NOT_FOUND,
    "BLOB_NOT_FOUND": S.NOT_FOUND,
    "ALREADY_EXISTS": S.ALREADY_EXISTS,
    "PERMISSION_DENIED": S.PERMISSION_DENIED,
    "BLOB_ACCESS_DENIED": S.PERMISSION_DENIED,
    "UNAUTHENTICATED": S.UNAUTHENTICATED,
    "ILLEGAL_TRANSITION": S.FAILED_PRECONDITION,
    "FAILED_PRECONDITION": S.FAILED_PRECONDITION,
    "STALE_FENCING_TOKEN": S.FAILED_PRECONDITION,
    "LEASE_NOT_HELD": S.FAILED_PRECONDITION,
    "DEADLINE_EXCEEDED": S.DEADLINE_EXCEEDED,
    "UNAVAILABLE": S.UNAVAILABLE,
    "UNROUTABLE": S.UNAVAILABLE,
    "CHECKSUM_MISMATCH": S.DATA_LOSS,
}
# A status without fedhive metadata (raised by gRPC itself, or by another server): its code.
_FALLBACK: dict[grpc.StatusCode, str] = {
    S.INVALID_ARGUMENT: "INVALID_ARGUMENT",
    S.NOT_FOUND: "NOT_FOUND",
    S.ALREADY_EXISTS: "ALREADY_EXISTS",
    S.PERMISSION_DENIED: "PERMISSION_DENIED",
    S.UNAUTHENTICATED: "UNAUTHENTICATED",
    S.FAILED_PRECONDITION: "FAILED_PRECONDITION",
    S.DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
    S.UNAVAILABLE: "UNAVAILABLE",
    S.RESOURCE_EXHAUSTED: "INVALID_ARGUMENT",
}


def to_grpc(err: FedhiveError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """Status code, details and trailing metadata for `err`."""
    trailers = ((CODE_KEY, err.code), (FIELD_KEY, err.field or ""))
    return GRPC_CODES.get(err.code, S.INTERNAL), err.message, trailers


def from_grpc(err: grpc.RpcError, *, target: str) -> FedhiveError:
    """The typed error a failed call stands for; `target` (the gateway address) names where."""
    code: grpc.StatusCode = err.code()
    details: str = err.details() or code.name.lower()
    trailers: Sequence[tuple[str, str | bytes]] = err.trailing_metadata() or ()
    meta = {key: value for key, value in trailers if isinstance(value, str)}
    if CODE_KEY in meta:
        return from_code(meta[CODE_KEY], details, meta.get(FIELD_KEY) or None)
    if code is S.UNAVAILABLE:
        return Unavailable(f"gateway {target} is unavailable: {details}", field="gateway")
    return from_code(_FALLBACK.get(code, "INTERNAL"), f"gateway {target}: {details}")
