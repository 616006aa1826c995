"""The gateway's composition: gRPC server (optionally TLS / mutual TLS), health service, ports.

`build(settings, options, log)` starts everything and returns the running `GatewayServer`;
`fedhive.service.run` closes it on SIGTERM/SIGINT. Health (for "" and for
`fedhive.v1.AdminService`) follows readiness (`ready_checks`: the broker and S3, run by
`fedhive.service.run`): SERVING while ready, NOT_SERVING before the first check, while not
ready and from the start of shutdown.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import (
    health,
    health_pb2,
    health_pb2_grpc,
)

from fedhive.auth import AdminDirectory
from fedhive.blobs import S3BlobStore
from fedhive.bus import RabbitBus
from fedhive.config import Settings
from fedhive.errors import ConfigError
from fedhive.names import Names
from fedhive.proto.v1 import admin_pb2, admin_pb2_grpc
from fedhive.readiness import Check
from fedhive.readiness_checks import broker_link, bucket_answers

from .handlers import Gateway, GatewayConfig
from .servicer import AdminServicer

SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
_MAX_MESSAGE = 8 * 1024 * 1024  # uploads arrive in 1 MiB chunks; records are small


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    client_ca: Path | None = None  # set: mutual TLS, clients must present a cert it signed


@dataclass(frozen=True)
class GatewayOptions:
    listen: str
    admins: Path
    tls: TlsFiles | None = None
    workers: int = 32  # concurrent RPCs (each WatchJob holds one while it runs)
    config: GatewayConfig = field(default_factory=GatewayConfig)


class GatewayServer:
    def __init__(self, server: grpc.Server, port: int, health_servicer: health.HealthServicer,
                 gateway: Gateway, ports: list[Any], settings: Settings) -> None:
        self.server = server
        self.port = port
        self._health = health_servicer
        self._gateway = gateway
        self._ports = ports
        self._settings = settings

    def ready_checks(self) -> list[Check]:
        """The broker (RPC to the job-store; the gateway consumes nothing, so a connection of
        the check's own) and S3 (uploads are staged there)."""
        name = f"{self._settings.namespace}.gateway.readiness"
        return [broker_link(self._settings, name), bucket_answers(self._settings)]

    def readiness_changed(self, ready: bool) -> None:
        _serving(self._health, ready)  # ignored once shutdown has begun

    def close(self, grace: float = 5.0) -> None:
        """NOT_SERVING, end watches, let running calls finish (up to `grace` seconds), then
        close the bus and S3 clients they use."""
        self._health.enter_graceful_shutdown()
        self._gateway.close()
        self.server.stop(grace).wait()
        for port in self._ports:
            port.close()


def _serving(health_servicer: health.HealthServicer, serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, status)


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    def read(path: Path, what: str) -> bytes:
        try:
            return path.read_bytes()
        except OSError as err:
            raise ConfigError(f"TLS {what} {path}: {err.strerror}", field=what) from None

    ca = read(tls.client_ca, "client CA") if tls.client_ca else None
    return grpc.ssl_server_credentials(
        [(read(tls.key, "key"), read(tls.cert, "certificate"))],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def build(settings: Settings, options: GatewayOptions, log: Any) -> GatewayServer:
    admins = AdminDirectory.load(options.admins)
    credentials = server_credentials(options.tls) if options.tls else None
    blobs = S3BlobStore.from_settings(settings)
    blobs.ensure_bucket()
    bus = RabbitBus(settings, name="gateway")
    gateway = Gateway(bus, blobs, Names(settings.namespace), options.config, log)
    server = grpc.server(
        ThreadPoolExecutor(max_workers=options.workers, thread_name_prefix="grpc"),
        options=[("grpc.max_receive_message_length", _MAX_MESSAGE),
                 ("grpc.max_send_message_length", _MAX_MESSAGE)],
    )
    admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(gateway, admins, log), server)
    health_servicer = health.HealthServicer()
    _serving(health_servicer, False)  # until the first readiness round
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        if credentials is None:
            port = server.add_insecure_port(options.listen)
        else:
            port = server.add_secure_port(options.listen, credentials)
    except RuntimeError as err:
        raise ConfigError(f"cannot listen on {options.listen}: {err}", field="listen") from None
    server.start()
    log.info("gateway.listening", listen=options.listen, port=port, tls=credentials is not None,
             mutual_tls=bool(options.tls and options.tls.client_ca), admins=len(admins))
    return GatewayServer(server, port, health_servicer, gateway, [bus, blobs], settings)
