"""The gateway's edges without infrastructure: command-line options and the one table that
maps fedhive errors to gRPC status codes and back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from fedhive.errors import (
    FailedPrecondition,
    FedhiveError,
    IllegalTransition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    RpcTimeout,
    Unauthenticated,
    Unavailable,
    Unroutable,
)
from fedhive.jobs.archive import MiB
from fedhive.sdk.status import from_grpc, to_grpc
from fedhive_services.gateway.main import parse_options


class FakeRpcError(grpc.RpcError):
    """What a failed call raises on the client side (status, details, trailers)."""

    def __init__(self, code: grpc.StatusCode, details: str,
                 trailers: tuple[tuple[str, str], ...] = ()) -> None:
        self._code, self._details, self._trailers = code, details, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailers


@pytest.mark.parametrize(("err", "status"), [
    (InvalidArgument("bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound("job x not found"), grpc.StatusCode.NOT_FOUND),
    (PermissionDenied("no"), grpc.StatusCode.PERMISSION_DENIED),
    (Unauthenticated("who"), grpc.StatusCode.UNAUTHENTICATED),
    (IllegalTransition("late"), grpc.StatusCode.FAILED_PRECONDITION),
    (FailedPrecondition("running"), grpc.StatusCode.FAILED_PRECONDITION),
    (RpcTimeout("slow"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (Unroutable("no queue"), grpc.StatusCode.UNAVAILABLE),
    (Unavailable("down"), grpc.StatusCode.UNAVAILABLE),
    (FedhiveError("?"), grpc.StatusCode.INTERNAL),
])
def test_errors_cross_grpc_as_the_same_type(err: FedhiveError, status: grpc.StatusCode) -> None:
    code, message, trailers = to_grpc(err)
    assert code is status and message == err.message
    back = from_grpc(FakeRpcError(code, message, trailers), target="gw:1")
    assert type(back) is type(err) and str(back) == str(err)


def test_statuses_without_fedhive_trailers_still_map() -> None:
    down = from_grpc(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connect failed"), target="gw:1")
    assert isinstance(down, Unavailable) and str(down) == "gateway gw:1 is unavailable: " \
                                                          "connect failed"
    other = from_grpc(FakeRpcError(grpc.StatusCode.NOT_FOUND, "nope"), target="gw:1")
    assert isinstance(other, NotFound)


def test_options(tmp_path: Path) -> None:
    options = parse_options(["--admins", "a.json", "--max-archive-mib", "5"])
    assert options.listen == "0.0.0.0:50051" and options.tls is None
    assert options.config.max_archive_bytes == 5 * MiB
    tls = parse_options(["--admins", "a.json", "--tls-cert", "c", "--tls-key", "k",
                         "--tls-client-ca", "ca"]).tls
    assert tls is not None and tls.client_ca == Path("ca")


@pytest.mark.parametrize("argv", [
    [],  # --admins is required
    ["--admins", "a", "--tls-cert", "c"],
    ["--admins", "a", "--tls-client-ca", "ca"],
    ["--admins", "a", "--workers", "0"],
])
def test_bad_options_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        parse_options(argv)
    assert caught.value.code == 2
