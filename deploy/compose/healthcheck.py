"""Health probe of the fedhive containers in docker-compose.yml (exit 0 healthy, 1 not, with
one line saying what was seen).

    python healthcheck.py ready SERVICE      SERVICE's readiness file says ready and is fresh
    python healthcheck.py ready --file PATH  the same for the file at PATH

Every fedhive service checks what it really uses every few seconds (its consumers consuming,
Redis answering PING, the S3 bucket answering, a site's heartbeats reaching the broker) and
writes the result to its readiness file (`fedhive.readiness`): FEDHIVE_READY_FILE, else
`<tmp>/fedhive-SERVICE.ready`. The probe only reads that file, so it opens no connection of its
own; a file not rewritten for three intervals means a dead or wedged process, not a ready one.
The unhealthy line names the failing check.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from fedhive.config import Settings
from fedhive.errors import FedhiveError
from fedhive.readiness import ReadyConfig, read_report, verdict

SERVICES = ("job-store", "scheduler", "job-runner", "gateway", "site-agent")


def check(argv: Sequence[str] | None = None) -> tuple[bool, str]:
    args = parse_args(argv)
    path = args.file or ReadyConfig.for_service(args.service, Settings.from_env()).path
    try:
        report = read_report(path)
    except FileNotFoundError:
        return False, f"no readiness file {path} (the service has not started, or has stopped)"
    return verdict(report, time.time())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="healthcheck.py", description=__doc__.splitlines()[0])
    probes = parser.add_subparsers(dest="probe", required=True)
    ready = probes.add_parser("ready", help="the service's readiness file says ready, and is "
                                            "fresh")
    ready.add_argument("service", nargs="?", choices=SERVICES)
    ready.add_argument("--file", type=Path, help="the readiness file to read (default: the "
                                                  "service's)")
    args = parser.parse_args(argv)
    if (args.service is None) == (args.file is None):
        parser.error("ready takes a SERVICE or --file PATH")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        healthy, said = check(argv)
    except (FedhiveError, ValueError, OSError) as err:
        healthy, said = False, str(err)
    print(f"{'healthy' if healthy else 'unhealthy'}: {said}", file=sys.stdout if healthy
          else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
