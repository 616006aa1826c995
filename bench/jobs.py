"""Benchmark: job submit latency (1 MiB and 50 MiB archives) and listing with 10,000 jobs.

Runs the real job-store and gateway as subprocesses on a namespace of its own and measures
through the SDK (`fedhive.sdk.Session`), as an admin would see it:

* `submit_<size>_*`: `Session.submit(zip bytes)`: local validation and normalisation, the
  streamed upload, staging in S3, the job-store's validation, storage and record; and
  `upload_<size>_*`: the same without the client's local validation (the archive is already
  normalised and sent as is), i.e. the service side alone.
* `list_10k_first_page_ms`: `Session.list()` (the default page, newest first) with 10,000 jobs
  in the store (seeded directly through the state store: submitting 10,000 jobs would only
  measure submit again).

    .venv/bin/python bench/jobs.py [--repeat 20] [--jobs 10000]

RabbitMQ and Redis from the environment (`Settings.from_env()`, default local); S3 too when
FEDHIVE_S3_ENDPOINT_URL is set, otherwise a SeaweedFS started here. Prints JSON and writes
bench/results/jobs.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.fixtures (the service launchers, SeaweedFS)

from support import bench_settings, load_average, write_results  # noqa: E402  (bench/support.py, beside this script)

from fedhive.blobs import S3BlobStore  # noqa: E402
from fedhive.config import Settings  # noqa: E402
from fedhive.jobs.definition import load_job  # noqa: E402
from fedhive.jobs.record import JobMeta, Submitter  # noqa: E402
from fedhive.logging import configure  # noqa: E402
from fedhive.proto.v1 import admin_pb2  # noqa: E402
from fedhive.sdk import Session  # noqa: E402
from fedhive.state import RedisStateStore  # noqa: E402
from tests.fixtures.gateway import clean_namespace, running_stack  # noqa: E402
from tests.fixtures.job_store import job_zip  # noqa: E402

MiB = 1024 * 1024
USER = "lead@a"


def archive_of(size: int) -> bytes:
    """A valid job whose archive is about `size` bytes (an incompressible data file)."""
    data = {"srv/custom/data.bin": os.urandom(size)}
    return job_zip("bench", files=data)


def timings(fn: Callable[[], Any], repeat: int) -> dict[str, float]:
    fn()  # warm-up: connections, caches
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    samples.sort()
    return {
        "median_ms": round(statistics.median(samples), 2),
        "p95_ms": round(samples[min(len(samples) - 1, round(0.95 * (len(samples) - 1)))], 2),
    }


def raw_upload(session: Session, archive: bytes) -> None:
    """SubmitJob with an already normalised archive, skipping the SDK's local validation."""
    chunks = (admin_pb2.SubmitJobChunk(data=archive[i:i + MiB])
              for i in range(0, len(archive), MiB))
    session._call(lambda: session._stub.SubmitJob(chunks, metadata=session._metadata))


def seed(settings: Settings, count: int) -> None:
    state = RedisStateStore.from_settings(settings)
    try:
        submitter = Submitter(USER, "a", "lead")
        for i in range(count):
            state.create_job(str(uuid.uuid4()), JobMeta(name=f"seeded-{i:05d}",
                             deploy_map={"srv": ["server"], "cli": ["site-1"]}), submitter)
    finally:
        state.close()


def clean(settings: Settings) -> None:
    state = RedisStateStore.from_settings(settings)
    try:
        for record in state.list_jobs():
            state.delete_job(record.job_id)
    finally:
        state.close()
    blobs = S3BlobStore.from_settings(settings)
    try:
        blobs.delete_prefix(f"{settings.namespace}/")
    finally:
        blobs.close()


def run(repeat: int, jobs: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    namespace = f"bench-jobs-{secrets.token_hex(3)}"
    with bench_settings(namespace) as (settings, s3), tempfile.TemporaryDirectory() as tmp:
        try:
            with running_stack(settings, Path(tmp)) as stack, \
                    stack.gateway.session(USER) as session:
                for label, size in (("1mib", MiB), ("50mib", 50 * MiB)):
                    archive = archive_of(size)
                    normalised = load_job(archive).to_zip()
                    assert normalised is not None
                    submit = timings(lambda a=archive: session.submit(a), repeat)
                    upload = timings(lambda n=normalised: raw_upload(session, n), repeat)
                    results[f"submit_{label}_median_ms"] = submit["median_ms"]
                    results[f"submit_{label}_p95_ms"] = submit["p95_ms"]
                    results[f"upload_{label}_median_ms"] = upload["median_ms"]
                    results[f"upload_{label}_p95_ms"] = upload["p95_ms"]
                    results[f"archive_{label}_bytes"] = len(normalised)
                clean(settings)
                seed(settings, jobs)
                listing = timings(lambda: session.list(), repeat)
                assert len(session.list()) > 0
                results["list_10k_first_page_ms"] = listing["median_ms"]
                results["list_10k_first_page_p95_ms"] = listing["p95_ms"]
                results["list_page_size"] = len(session.list())
        finally:
            clean_namespace(settings)
    results.update(jobs_in_store=jobs, repeat=repeat, s3=s3, python=platform.python_version(),
                   cpus=os.cpu_count(), machine=platform.machine(),
                   loadavg_1_5_15_at_end=load_average())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20, help="runs per measurement")
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs in the store for listing")
    parser.add_argument("--output", type=Path, default=ROOT / "bench/results/jobs.json")
    args = parser.parse_args()
    configure("bench-jobs", level="WARNING")  # logs to stderr: stdout is the JSON result
    results = run(args.repeat, args.jobs)
    write_results(results, args.output)


if __name__ == "__main__":
    main()
