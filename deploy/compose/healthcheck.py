"""Health probes of the fedhive containers in docker-compose.yml (exit 0 healthy, 1 not, with
one line saying what was seen).

    python healthcheck.py gateway [ADDRESS]       the gateway's gRPC health service says SERVING
                                                  (default 127.0.0.1:50051)
    python healthcheck.py connected amqp [redis]  this container holds an established TCP
                                                  connection to the broker (and Redis) of its
                                                  FEDHIVE_AMQP_URL / FEDHIVE_REDIS_URL
    python healthcheck.py site --site-dir DIR     the same, to the broker of the site's
                                                  local/site.json

Why connections: a service keeps them open for as long as it works (the job-store's and
job-runner's consumers, a site agent's control-queue consumer and heartbeats, a scheduler's
leader-lease loop on Redis, leader or standby) and loses them when the broker or Redis goes
away. The probe runs in the container's network namespace, so every connection it sees is the
service's (or its children's); it opens none itself.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from fedhive.config import Settings
from fedhive.errors import FedhiveError

DEFAULT_PORTS = {"amqp": 5672, "amqps": 5671, "redis": 6379, "rediss": 6379}


def endpoint(url: str, what: str) -> tuple[str, int]:
    """(host, port) of an amqp(s):// or redis(s):// URL; ValueError for a unix socket."""
    parts = urlsplit(url)
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        raise ValueError(f"{what} is not a TCP URL (scheme {parts.scheme!r})")
    return parts.hostname, parts.port or DEFAULT_PORTS[parts.scheme]


def _normal(ip: str) -> str:
    address = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def addresses(host: str, port: int) -> set[str]:
    """Every address `host` resolves to (empty when it does not resolve)."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    return {_normal(str(info[4][0])) for info in found}


def established_to(host: str, port: int) -> bool:
    """Whether a TCP connection in this network namespace is established to host:port."""
    wanted = addresses(host, port)
    return any(conn.status == psutil.CONN_ESTABLISHED and conn.raddr
               and conn.raddr.port == port and _normal(conn.raddr.ip) in wanted
               for conn in psutil.net_connections(kind="tcp"))


def _connected(targets: Sequence[tuple[str, str]]) -> tuple[bool, str]:
    seen = []
    for what, url in targets:
        host, port = endpoint(url, what)
        if not established_to(host, port):
            return False, f"no established connection to {what} at {host}:{port}"
        seen.append(f"{what} {host}:{port}")
    return True, "connected to " + ", ".join(seen)


def check(argv: Sequence[str] | None = None) -> tuple[bool, str]:
    args = parse_args(argv)
    if args.probe == "gateway":
        from fedhive.poc.probes import gateway_serving  # grpc: only this probe needs it

        serving = gateway_serving(args.address)
        return serving, f"gateway at {args.address} {'' if serving else 'not '}SERVING"
    if args.probe == "site":  # the agent's own file (services/site_agent/config.py)
        config = json.loads((args.site_dir / "local" / "site.json").read_text())
        return _connected([("the site's broker", str(config["broker_url"]))])
    settings = Settings.from_env()
    urls = {"amqp": ("the broker", settings.amqp_url), "redis": ("Redis", settings.redis_url)}
    return _connected([urls[name] for name in dict.fromkeys(args.to)])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="healthcheck.py", description=__doc__.splitlines()[0])
    probes = parser.add_subparsers(dest="probe", required=True)
    gateway = probes.add_parser("gateway", help="the gateway's gRPC health says SERVING")
    gateway.add_argument("address", nargs="?", default="127.0.0.1:50051")
    connected = probes.add_parser("connected", help="connections to the broker / Redis")
    connected.add_argument("to", nargs="+", choices=("amqp", "redis"))
    site = probes.add_parser("site", help="a site agent's connection to its broker")
    site.add_argument("--site-dir", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        healthy, said = check(argv)
    except (FedhiveError, ValueError, OSError, LookupError, TypeError) as err:
        healthy, said = False, str(err)
    print(f"{'healthy' if healthy else 'unhealthy'}: {said}", file=sys.stdout if healthy
          else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
