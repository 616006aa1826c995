"""Benchmark: what one ScatterAndGather round costs beyond the training itself.

Runs the real services as subprocesses on a namespace of its own (job-store, scheduler,
job-runner, and one site agent per site, each its own broker user: see bench/scheduling.py)
and, for 2 and then 8 sites, one job: ScatterAndGather over a 1 MiB float32 model (one array),
`--rounds` rounds, min_clients = every site, no wait after the minimum, a trainer that adds 1
to the weights and reports how long that took. Every round is a real round trip: broadcast
(task data through the task queue), each client job's executor, results back, aggregation,
checkpoint of the global model to S3, round report.

Per-round overhead = (time of the last round's report - time of the first round's report) /
(rounds - 1) - the mean over those rounds of the slowest site's training time. The first round
is left out: it also holds the client jobs' start-up.

    .venv/bin/python bench/rounds.py [--rounds 5] [--sites 2 8]

Prints JSON and writes bench/results/rounds.json (keys `round_overhead_ms_<n>_sites`).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import secrets
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.fixtures (the service launchers, SeaweedFS)

from scheduling import running_services, submit, wait_final  # noqa: E402  (beside this script)
from support import bench_settings, load_average, write_results  # noqa: E402

from fedhive.blobs import S3BlobStore  # noqa: E402
from fedhive.jobs.status import JobStatus  # noqa: E402
from fedhive.logging import configure  # noqa: E402
from fedhive.names import Names  # noqa: E402
from tests.fixtures.gateway import clean_namespace  # noqa: E402
from tests.fixtures.job_store import stage  # noqa: E402

MODEL_FLOATS = 256 * 1024  # 1 MiB of float32
HEARTBEAT_S = 5.0  # fedhive-site-agent's default
TRAINER = '''
import time

from fedhive.fl.dxo import DataKind, Dxo, MetaKey


class Trainer:
    def execute(self, task):
        model = task.load()
        start = time.perf_counter()
        updated = {name: value + 1 for name, value in model.data.items()}
        return Dxo(DataKind.WEIGHTS, updated, {
            MetaKey.NUM_STEPS_CURRENT_ROUND: 1,
            MetaKey.METRICS: {"train_s": time.perf_counter() - start}})
'''


def job_archive(sites: list[str], rounds: int) -> bytes:
    server = {
        "components": [
            {"id": "persistor", "path": "fedhive.fl.persistors.NumpyModelPersistor",
             "args": {"initial": {"w": [0.0] * MODEL_FLOATS}}},
            {"id": "aggregator",
             "path": "fedhive.fl.aggregators.InTimeAccumulateWeightedAggregator"},
            {"id": "shareable_generator",
             "path": "fedhive.fl.shareables.FullModelShareableGenerator"},
        ],
        "workflows": [{"id": "sag", "path": "fedhive.fl.workflows.ScatterAndGather", "args": {
            "min_clients": len(sites), "num_rounds": rounds,
            "wait_time_after_min_received": 0, "persistor_id": "persistor"}}],
    }
    client = {"executors": [{"tasks": ["train"],
                             "executor": {"path": "trainer.Trainer", "args": {}}}]}
    files = {
        "rounds/meta.json": json.dumps({"name": "rounds", "min_clients": len(sites),
                                        "deploy_map": {"app": ["server", *sites]}}),
        "rounds/app/config/config_fed_server.json": json.dumps(server),
        "rounds/app/config/config_fed_client.json": json.dumps(client),
        "rounds/app/custom/trainer.py": TRAINER,
    }
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return buffer.getvalue()


def round_overhead(reports: list[dict[str, Any]]) -> dict[str, float]:
    times = [r["time"] for r in reports]
    train = [max(site["train_s"] for site in r["metrics"]["sites"].values())
             for r in reports[1:]]
    per_round = (times[-1] - times[0]) / (len(times) - 1)
    return {"round_ms": round(per_round * 1000, 1),
            "train_ms": round(1000 * sum(train) / len(train), 2),
            "overhead_ms": round((per_round - sum(train) / len(train)) * 1000, 1)}


def run_sites(count: int, rounds: int) -> dict[str, Any]:
    namespace = f"bench-rounds-{secrets.token_hex(3)}"
    sites = [f"{namespace}-s{n}" for n in range(1, count + 1)]
    with bench_settings(namespace) as (settings, s3), tempfile.TemporaryDirectory() as tmp:
        names = Names(namespace)
        blobs = S3BlobStore.from_settings(settings)
        try:
            # the product's heartbeat interval (the test fixtures' 0.5 s would add 16 to 32
            # heartbeats a second to what the 2 cores do during rounds)
            with running_services(settings, Path(tmp), sites, max_jobs=1,
                                  runner_args=("--site-ttl", str(3 * HEARTBEAT_S)),
                                  heartbeat_interval_s=HEARTBEAT_S) as (bus, state):
                staged = stage(blobs, names, job_archive(sites, rounds))
                (record,) = wait_final(state, [submit(bus, names, staged)], 300)
                assert record.status == JobStatus.FINISHED_COMPLETED, record.status_reason
                with zipfile.ZipFile(io.BytesIO(blobs.get(record.result_key))) as result:
                    reports = json.loads(result.read("metrics.json"))["rounds"]
        finally:
            blobs.close()
            clean_namespace(settings)
    return {**round_overhead(reports), "s3": s3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sites", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--output", type=Path, default=ROOT / "bench/results/rounds.json")
    args = parser.parse_args()
    configure("bench-rounds", level="WARNING")  # logs to stderr: stdout is the JSON result
    load_before = load_average()
    results: dict[str, Any] = {}
    for count in args.sites:
        measured = run_sites(count, args.rounds)
        results[f"round_overhead_ms_{count}_sites"] = measured["overhead_ms"]
        results[f"details_{count}_sites"] = measured
    results.update(goal_round_overhead_ms=100, rounds=args.rounds, model_mib=1,
                   python=platform.python_version(), cpus=os.cpu_count(),
                   loadavg_1_5_15_at_start=load_before,
                   loadavg_1_5_15_at_end=load_average(),
                   command=" ".join(["bench/rounds.py", *sys.argv[1:]]))
    write_results(results, args.output)


if __name__ == "__main__":
    main()
