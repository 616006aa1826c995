"""What the benchmarks share: settings pointing at an S3 server (the configured one, or a
SeaweedFS started for the run)."""

from __future__ import annotations

import dataclasses
import json
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
