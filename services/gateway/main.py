"""`fedhive-gateway`: the gRPC admin gateway (AdminService + gRPC health).

Infrastructure settings come from the environment (`fedhive.config.Settings`); the gateway's
own options are command-line flags:

    fedhive-gateway --admins /etc/fedhive/admins.json [--listen 0.0.0.0:50051]
                    [--tls-cert server.pem --tls-key server.key [--tls-client-ca ca.pem]]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedhive.jobs.archive import MiB
from fedhive.service import run

from .handlers import GatewayConfig
from .server import GatewayOptions, TlsFiles, build

DEFAULT_LISTEN = "0.0.0.0:50051"


def parse_options(argv: list[str] | None = None) -> GatewayOptions:
    parser = argparse.ArgumentParser(prog="fedhive-gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--admins", type=Path, required=True,
                        help="admins JSON file: name, org, role and token_sha256 per admin")
    parser.add_argument("--listen", default=DEFAULT_LISTEN, help="host:port to serve gRPC on")
    parser.add_argument("--tls-cert", type=Path, help="server certificate (PEM): enables TLS")
    parser.add_argument("--tls-key", type=Path, help="server private key (PEM)")
    parser.add_argument("--tls-client-ca", type=Path,
                        help="CA (PEM) that signs client certificates: enables mutual TLS")
    parser.add_argument("--max-archive-mib", type=int, default=256,
                        help="largest job archive accepted, in MiB (default 256)")
    parser.add_argument("--rpc-timeout", type=float, default=30.0,
                        help="seconds to wait for the job-store (default 30)")
    parser.add_argument("--watch-interval", type=float, default=0.5,
                        help="seconds between WatchJob status reads (default 0.5)")
    parser.add_argument("--workers", type=int, default=32, help="concurrent RPCs (default 32)")
    args = parser.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        parser.error("--tls-client-ca needs --tls-cert and --tls-key")
    for name in ("max_archive_mib", "rpc_timeout", "watch_interval", "workers"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    config = GatewayConfig(max_archive_bytes=args.max_archive_mib * MiB,
                           rpc_timeout=args.rpc_timeout, watch_interval=args.watch_interval)
    return GatewayOptions(listen=args.listen, admins=args.admins, tls=tls, workers=args.workers,
                          config=config)


def main(argv: list[str] | None = None) -> None:
    options = parse_options(argv)
    run("gateway", lambda settings, log: build(settings, options, log))


if __name__ == "__main__":
    main()
