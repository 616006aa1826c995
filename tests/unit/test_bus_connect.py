"""`fedhive.bus.connection.connect`: which failures of pika's connect are retried."""

import ssl
from typing import Any

import pika
import pytest

from fedhive.bus import connection
from fedhive.errors import ConfigError
from fedhive.retry import Backoff

PARAMS = pika.URLParameters("amqp://guest:guest@127.0.0.1:5672/%2F")
FAST = Backoff(base=0.001, cap=0.001, max_attempts=3)


def failing_then_connected(monkeypatch: pytest.MonkeyPatch, *errors: BaseException) -> list[int]:
    """pika.BlockingConnection raises `errors` in turn, then returns a stand-in."""
    calls: list[int] = []
    pending = list(errors)

    def fake(params: Any) -> str:
        calls.append(1)
        if pending:
            raise pending.pop(0)
        return "connected"

    monkeypatch.setattr(connection.pika, "BlockingConnection", fake)
    return calls


def test_a_socket_reset_while_connecting_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    # what pika raises when a restarting broker closes the socket under its connector
    reset = ValueError("Expected connected socket, but getpeername() failed: "
                       "error=OSError(107, 'Transport endpoint is not connected'); <socket>")
    calls = failing_then_connected(monkeypatch, reset, ConnectionRefusedError(111, "refused"))
    assert connection.connect(PARAMS, FAST) == "connected"
    assert len(calls) == 3


def test_any_other_value_error_is_not_a_connection_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = failing_then_connected(monkeypatch, ValueError("bad frame_max"))
    with pytest.raises(ValueError, match="bad frame_max"):
        connection.connect(PARAMS, FAST)
    assert len(calls) == 1


def test_a_certificate_that_does_not_verify_is_refused_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # ssl's verification error is a ValueError too: it must still reach the TLS refusal
    refused = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate "
                                              "verify failed: self-signed certificate")
    refused.verify_message = "self-signed certificate"
    calls = failing_then_connected(monkeypatch, refused)
    with pytest.raises(ConfigError, match="its TLS certificate is refused"):
        connection.connect(PARAMS, FAST)
    assert len(calls) == 1
