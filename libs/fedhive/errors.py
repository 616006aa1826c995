"""The one error hierarchy of fedhive.

Every error a user or an operator can cause is a `FedhiveError` subclass with a stable `code`
(what crosses the wire) and, where there is one, the offending `field` (a setting, a meta.json
field, a queue, a key). Transports translate these once, at their edge: the bus puts them in an
`Error` reply, the gateway maps them to gRPC status codes, the CLI prints `str(err)`.
"""

from __future__ import annotations

from typing import ClassVar


class FedhiveError(Exception):
    """Root of every fedhive error. `str(err)` is one line, fit to show a user."""

    code: ClassVar[str] = "INTERNAL"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = " ".join(message.split())  # one line, always
        self.field = field

    def __str__(self) -> str:
        return self.message


class ConfigError(FedhiveError):
    """A setting is missing or invalid; `field` names the environment variable or file key."""

    code = "CONFIG_INVALID"


class InvalidArgument(FedhiveError):
    """Input that can never be accepted as given (bad job, bad request field)."""

    code = "INVALID_ARGUMENT"


class NotFound(FedhiveError):
    code = "NOT_FOUND"


class AlreadyExists(FedhiveError):
    code = "ALREADY_EXISTS"


class PermissionDenied(FedhiveError):
    code = "PERMISSION_DENIED"


class Unauthenticated(FedhiveError):
    code = "UNAUTHENTICATED"


class FailedPrecondition(FedhiveError):
    """The request is valid but the object is not in a state that allows it now (deleting a
    running job, downloading a job that is not done)."""

    code = "FAILED_PRECONDITION"


class IllegalTransition(FedhiveError):
    """A job status change the state machine does not allow, or whose expected status is stale."""

    code = "ILLEGAL_TRANSITION"


class StaleFencingToken(FedhiveError):
    """A lease holder acted with a token older than the lease's current one."""

    code = "STALE_FENCING_TOKEN"


class LeaseNotHeld(FedhiveError):
    code = "LEASE_NOT_HELD"


class Unavailable(FedhiveError):
    """A transient infrastructure failure; the caller may retry."""

    code = "UNAVAILABLE"


class RpcTimeout(FedhiveError):
    code = "DEADLINE_EXCEEDED"


class Unroutable(FedhiveError):
    """The broker returned a mandatory message: no queue is bound for its routing key."""

    code = "UNROUTABLE"


class MalformedMessage(FedhiveError):
    """A message body that does not decode as the protobuf type it claims to be."""

    code = "MALFORMED_MESSAGE"


class BlobNotFound(FedhiveError):
    code = "BLOB_NOT_FOUND"


class BlobAccessDenied(FedhiveError):
    """A presigned URL that has expired, was tampered with, or was signed for something else."""

    code = "BLOB_ACCESS_DENIED"


class ChecksumMismatch(FedhiveError):
    code = "CHECKSUM_MISMATCH"


class WorkflowFailed(FedhiveError):
    """A job's workflow cannot go on (a site's error it may not ignore, too few sites left)."""

    code = "WORKFLOW_FAILED"


class PocFailed(FedhiveError):
    """`fedhive poc` / `fedhive demo` cannot bring the local system up (or down): the message
    names what is missing and the command that fixes it."""

    code = "POC_FAILED"


_BY_CODE: dict[str, type[FedhiveError]] = {}


def _register(cls: type[FedhiveError]) -> None:
    _BY_CODE[cls.code] = cls
    for sub in cls.__subclasses__():
        _register(sub)


_register(FedhiveError)


def from_code(code: str, message: str, field: str | None = None) -> FedhiveError:
    """Rebuild a typed error from what crossed the wire; unknown codes become the root type."""
    return _BY_CODE.get(code, FedhiveError)(message, field=field or None)
