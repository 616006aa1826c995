"""How a POC start tells that each piece is up: the S3 server answers HTTP, a service logged
`service.started` (fedhive.service logs it once it serves), the gateway's gRPC health says
SERVING, and the gateway lists every site online."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedhive.errors import FedhiveError
from fedhive.sdk import Session

STARTED = b'"service.started"'


def http_answers(url: str) -> bool:
    """Any HTTP answer counts (an S3 server answers an anonymous GET with an error document)."""
    try:
        urllib.request.urlopen(url, timeout=1)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def logged_started(log: Path) -> bool:
    try:
        return STARTED in log.read_bytes()
    except OSError:
        return False


def last_words(log: Path, lines: int = 1) -> str:
    """The last line(s) of a log, the `event`/`error` of a JSON line when it is one."""
    try:
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    words = []
    for line in tail[-lines:]:
        try:
            entry = json.loads(line)
        except ValueError:
            words.append(line.strip())
            continue
        if isinstance(entry, dict):
            parts = [str(entry.get(key)) for key in ("event", "error", "exception")
                     if entry.get(key)]
            words.append(": ".join(parts)[:300] if parts else line.strip())
        else:
            words.append(line.strip())
    return " | ".join(words)


def gateway_serving(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2.0)
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def online_sites(address: str, token: str) -> set[str]:
    """The sites the gateway lists online (empty while it cannot say)."""
    try:
        with Session(address, token, timeout=5) as session:
            return {site.name for site in session.sites() if site.online}
    except FedhiveError:
        return set()
