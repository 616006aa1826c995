"""Benchmark: TensorRef codec vs plain boto3, upload and download of a model, and peak RSS.

Two model shapes of the same total size: one big tensor, and many 1 MiB tensors (1,000 at the
default 1 GiB). The codec packs with inlining off (inline_threshold=0) so both sides move the
same bytes through S3. Plain boto3 is `put_object` / `get_object()["Body"].read()` of the same
bytes, one object per tensor, with a default client. Each download runs in its own subprocess
so that its peak RSS (ru_maxrss) is clean; `peak_rss_ratio` = that peak / model size.

    .venv/bin/python bench/blobs.py [--size-mib 1024] [--repeat 3]

Starts its own SeaweedFS unless FEDHIVE_S3_ENDPOINT_URL is set (then the endpoint and
credentials come from `Settings.from_env()`). Prints JSON and writes bench/results/blobs.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.fixtures.infra (the SeaweedFS launcher)

import numpy as np  # noqa: E402
from support import BUCKET, bench_settings, high_water_mb, load_average, s3_client, write_results  # noqa: E402  (bench/support.py, beside this script)

from fedhive.blobs import (  # noqa: E402
    PresignedFetcher,
    S3BlobStore,
    TensorCodec,
    bundle_from_proto,
    bundle_to_proto,
    unpack,
)
from fedhive.config import Settings  # noqa: E402
from fedhive.logging import configure  # noqa: E402
from fedhive.proto.v1 import common_pb2  # noqa: E402

MiB = 1024 * 1024


def make_model(case: str, size_mib: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    if case == "one_tensor":
        return {"weight": rng.random(size_mib * MiB // 4, dtype=np.float32)}
    count = round(size_mib * 1000 / 1024)  # 1,000 tensors of 1 MiB for a 1 GiB model
    return {f"layer{i:04d}": rng.random(MiB // 4, dtype=np.float32) for i in range(count)}


# --- download workers: run in a fresh subprocess each -----------------------------------------
def worker(mode: str, job: Path) -> dict[str, Any]:
    spec = json.loads(job.read_text())
    settings = Settings(**spec["settings"])
    start = time.perf_counter()
    if mode == "boto3":
        client = s3_client(settings)
        start = time.perf_counter()
        blobs = [client.get_object(Bucket=BUCKET, Key=key)["Body"].read() for key in spec["keys"]]
        seconds = time.perf_counter() - start
        nbytes = sum(len(b) for b in blobs)
    else:
        bundle = common_pb2.TensorBundle.FromString(Path(spec["bundle"]).read_bytes())
        refs, _ = bundle_from_proto(bundle)
        if mode == "codec_url":  # the trainer's way: presigned URLs, no credentials
            start = time.perf_counter()
            tensors = unpack(refs, PresignedFetcher())
        else:
            codec = TensorCodec(S3BlobStore.from_settings(settings), settings)
            start = time.perf_counter()
            tensors = codec.unpack(refs, via="store")
        seconds = time.perf_counter() - start
        nbytes = sum(int(t.nbytes) for t in tensors.values())
    return {"seconds": seconds, "bytes": nbytes, "peak_rss": int(high_water_mb(os.getpid()) * MiB)}


def run_worker(mode: str, job: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--worker", mode, "--job", str(job)],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{mode} download worker failed: {done.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# --- one case -----------------------------------------------------------------------------------
def bench_case(
    case: str, size_mib: int, repeat: int, settings: Settings, tmp: Path
) -> dict[str, Any]:
    model = make_model(case, size_mib)
    model_bytes = sum(a.nbytes for a in model.values())
    store = S3BlobStore.from_settings(settings)
    codec = TensorCodec(store, settings, inline_threshold=0)
    client = s3_client(settings)
    payloads = {name: array.tobytes() for name, array in model.items()}  # boto3 needs bytes
    runs: dict[str, list[float]] = {"codec_upload": [], "boto3_upload": []}
    downloads: dict[str, list[dict[str, Any]]] = {"codec_url": [], "codec_store": [], "boto3": []}
    for attempt in range(repeat):
        prefix = f"bench/{case}/{attempt}/"
        order = ["codec", "boto3"] if attempt % 2 == 0 else ["boto3", "codec"]
        keys = [f"{prefix}boto3/{name}" for name in model]
        for side in order:
            start = time.perf_counter()
            if side == "codec":
                refs = codec.pack(model, prefix + "codec/")
            else:
                for key, body in zip(keys, payloads.values(), strict=True):
                    client.put_object(Bucket=BUCKET, Key=key, Body=body)
            runs[f"{side}_upload"].append(time.perf_counter() - start)
        bundle = tmp / f"{case}-{attempt}.bundle"
        bundle.write_bytes(bundle_to_proto(refs).SerializeToString())
        job = tmp / f"{case}-{attempt}.json"
        job.write_text(json.dumps({"settings": dataclasses.asdict(settings), "keys": keys,
                                   "bundle": str(bundle)}))
        job.chmod(0o600)
        modes = list(downloads) if attempt % 2 == 0 else list(reversed(downloads))
        for mode in modes:
            result = run_worker(mode, job)
            if result["bytes"] != model_bytes:
                raise RuntimeError(f"{mode} downloaded {result['bytes']} of {model_bytes} bytes")
            downloads[mode].append(result)
        store.delete_prefix(prefix)
    store.close()

    def mib_s(seconds: float) -> float:
        return round(model_bytes / MiB / seconds, 1)

    best = {mode: min(results, key=lambda r: r["seconds"]) for mode, results in downloads.items()}
    rss = {mode: max(r["peak_rss"] for r in results) for mode, results in downloads.items()}
    codec_up, boto_up = min(runs["codec_upload"]), min(runs["boto3_upload"])
    return {
        "model_bytes": model_bytes,
        "tensors": len(model),
        "upload_mib_s": {"codec": mib_s(codec_up), "boto3": mib_s(boto_up)},
        "download_mib_s": {mode: mib_s(r["seconds"]) for mode, r in best.items()},
        "upload_ratio_vs_boto3": round(boto_up / codec_up, 3),
        "download_ratio_vs_boto3": round(
            best["boto3"]["seconds"] / best["codec_url"]["seconds"], 3
        ),
        "download_store_ratio_vs_boto3": round(
            best["boto3"]["seconds"] / best["codec_store"]["seconds"], 3
        ),
        "peak_rss_bytes": rss,
        "peak_rss_ratio": {mode: round(peak / model_bytes, 3) for mode, peak in rss.items()},
        "runs_seconds": {
            **{k: [round(s, 3) for s in v] for k, v in runs.items()},
            **{f"{m}_download": [round(r["seconds"], 3) for r in v] for m, v in downloads.items()},
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="model size (default 1024)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; best kept")
    parser.add_argument("--output", type=Path, default=ROOT / "bench/results/blobs.json")
    parser.add_argument(
        "--worker", choices=["codec_url", "codec_store", "boto3"], help=argparse.SUPPRESS
    )
    parser.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    configure("bench-blobs", level="WARNING")  # logs to stderr: stdout is the JSON result
    if args.worker:
        print(json.dumps(worker(args.worker, args.job)))
        return
    with bench_settings("bench") as (settings, endpoint), tempfile.TemporaryDirectory() as tmp:
        S3BlobStore.from_settings(settings).ensure_bucket()
        cases = {
            case: bench_case(case, args.size_mib, args.repeat, settings, Path(tmp))
            for case in ("one_tensor", "many_small")
        }
    headline = cases["one_tensor"]
    report = {
        "benchmark": "blobs: TensorRef codec vs plain boto3 (one S3 object per tensor)",
        "download_ratio_vs_boto3": headline["download_ratio_vs_boto3"],
        "upload_ratio_vs_boto3": headline["upload_ratio_vs_boto3"],
        "peak_rss_ratio": headline["peak_rss_ratio"]["codec_url"],
        "headline_case": "one_tensor (codec download through presigned URLs)",
        "size_mib": args.size_mib,
        "repeat": args.repeat,
        "s3": endpoint,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_1_5_15_at_end": load_average(),
        },
        "cases": cases,
    }
    write_results(report, args.output)


if __name__ == "__main__":
    main()
