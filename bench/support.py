"""What the benchmarks share: settings pointing at an S3 server (the configured one, or a
SeaweedFS started for the run), a plain boto3 client for it (the baseline fedhive's transfers
are compared with), the machine's load, a process's peak RSS, writing results."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedhive.config import Settings
from tests.fixtures.infra import start_seaweedfs, stop_process

BUCKET = "fedhive-bench"


@contextmanager
def bench_settings(namespace: str) -> Iterator[tuple[Settings, str]]:
    """Settings from the environment with `namespace` and the bench bucket, and a description
    of the S3 server used: FEDHIVE_S3_ENDPOINT_URL when set, else a SeaweedFS started here."""
    # SIGTERM (a killed benchmark) unwinds like Ctrl-C: the services it started are stopped
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    settings = dataclasses.replace(Settings.from_env(), s3_bucket=BUCKET, namespace=namespace)
    if settings.s3_endpoint_url is not None:
        yield settings, settings.s3_endpoint_url
        return
    with tempfile.TemporaryDirectory(prefix="fedhive-bench-s3-") as tmp:
        proc, server = start_seaweedfs(Path(tmp))
        try:
            yield dataclasses.replace(
                settings, s3_endpoint_url=server.endpoint_url, s3_region=server.region,
                aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key,
            ), "SeaweedFS (started by the benchmark)"
        finally:
            stop_process(proc)


def write_results(results: dict[str, Any], output: Path) -> None:
    """Print the results as JSON (stdout is the benchmark's result) and write them to `output`."""
    text = json.dumps(results, indent=2)
    print(text)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text + "\n")


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (recorded beside every measurement)."""
    return [round(x, 2) for x in os.getloadavg()]


def high_water_mb(pid: int) -> float:
    """The kernel's peak resident set of `pid` (VmHWM) in MiB, 0 when unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def s3_client(settings: Settings, endpoint_url: str | None = None) -> Any:
    """A plain boto3 S3 client with `settings`' credentials, at `endpoint_url` (default: the
    settings' S3 endpoint)."""
    import boto3  # here: the probes that never use boto3 do not pay for importing it
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint_url or settings.s3_endpoint_url,
                        region_name=settings.s3_region,
                        aws_access_key_id=settings.aws_access_key_id,
                        aws_secret_access_key=settings.aws_secret_access_key,
                        config=Config(signature_version="s3v4",
                                      s3={"addressing_style": "path"}))
