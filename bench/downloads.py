"""Benchmark: a trainer's download against plain boto3, on the same objects (issue 8).

`compare_downloads` reads a list of stored tensors three ways, each in a fresh process through
the given endpoint: fedhive's presigned-URL reader (`fedhive.blobs.unpack` with a
`PresignedFetcher`, what a trainer runs: parallel ranged GETs, every byte's BLAKE3 checked),
boto3 `get_object().read()` and boto3 `download_fileobj` (neither checks anything). The readers
alternate, `repeat` times. Per repetition, fedhive's rate over the faster boto3 reader's of the
same repetition; the headline is the median of those ratios (`ratio_median_of_repeats`): the
readers of one repetition run within seconds of each other, so a load spike on this shared
machine moves one ratio, not the median. The ratio of the best times is kept beside it.
bench/large_model.py runs it on a finished job's final model.

Run alone, it stores a model of `--size` MiB of random float32 tensors (`--tensor-mib` each)
in the S3 server (FEDHIVE_S3_ENDPOINT_URL when set, else a SeaweedFS started here), compares,
deletes the model, and writes bench/results/large_model_download.json:

    .venv/bin/python bench/downloads.py [--size 512] [--tensor-mib 16] [--repeat 5]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.fixtures (SeaweedFS)

import numpy as np  # noqa: E402
from s3_proxy import CountingProxy  # noqa: E402  (beside this script)
from support import (  # noqa: E402
    bench_settings,
    high_water_mb,
    load_average,
    s3_client,
    write_results,
)

from fedhive.blobs import S3BlobStore, TensorCodec  # noqa: E402
from fedhive.config import Settings  # noqa: E402
from fedhive.logging import configure  # noqa: E402
from fedhive.names import Names  # noqa: E402

MiB = 1024 * 1024
READERS = ("fedhive", "boto3_get", "boto3_transfer")


def compare_downloads(settings: Settings, endpoint_url: str, refs: Sequence[Any],
                      repeat: int) -> dict[str, Any]:
    """`refs`' objects read by each of `READERS` in a fresh process through `endpoint_url`,
    the readers alternating, `repeat` times."""
    presigner = s3_client(settings, endpoint_url)
    spec = {"endpoint": endpoint_url, "bucket": settings.s3_bucket,
            "region": settings.s3_region,
            "access_key": settings.aws_access_key_id,
            "secret_key": settings.aws_secret_access_key,
            "refs": [{"name": r.name, "key": r.key, "dtype": r.dtype,
                      "shape": list(r.shape), "offset": r.offset, "length": r.length,
                      "checksum": r.checksum,
                      "url": presigner.generate_presigned_url(
                          "get_object", Params={"Bucket": settings.s3_bucket,
                                                "Key": r.key}, ExpiresIn=3600)}
                     for r in refs]}
    tries: dict[str, list[dict[str, Any]]] = {mode: [] for mode in READERS}
    load_before = load_average()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(spec, handle)
    try:
        for _ in range(repeat):
            for mode in READERS:
                tries[mode].append(_probe(mode, handle.name))
    finally:
        os.unlink(handle.name)
    total = sum(r.length for r in refs)
    seconds = {mode: [m["seconds"] for m in found] for mode, found in tries.items()}
    best = {mode: min(found, key=lambda m: m["seconds"]) for mode, found in tries.items()}
    rates = {mode: round(total / MiB / m["seconds"], 1) for mode, m in best.items()}
    per_repeat = [min(get, transfer) / ours for ours, get, transfer
                  in zip(seconds["fedhive"], seconds["boto3_get"], seconds["boto3_transfer"],
                         strict=True)]
    return {"objects": len(refs), "bytes": total, "mib_per_s": rates,
            "seconds_each_try": {mode: [round(s, 3) for s in found]
                                 for mode, found in seconds.items()},
            "loadavg_1_5_15_before": load_before, "loadavg_1_5_15_after": load_average(),
            "peak_rss_mb": {mode: m["peak_rss_mb"] for mode, m in best.items()},
            "cpu_s_reading": {mode: m["cpu_s_reading"] for mode, m in best.items()},
            "cpu_s_whole_process": {mode: m["cpu_s_whole_process"] for mode, m in best.items()},
            "ratio_each_repeat": [round(r, 3) for r in per_repeat],
            "ratio_median_of_repeats": round(statistics.median(per_repeat), 3),
            "ratio_of_best": round(rates["fedhive"]
                                   / max(rates["boto3_get"], rates["boto3_transfer"]), 3)}


def _probe(mode: str, spec_path: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, "--probe", mode, spec_path],
                          capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"download probe {mode} failed: {done.stderr[-2000:]}")
    measured: dict[str, Any] = json.loads(done.stdout)
    return measured


def probe(mode: str, spec_path: str) -> dict[str, Any]:
    """One reader's download of the spec's objects, kept in memory; runs in a fresh process."""
    spec = json.loads(Path(spec_path).read_text())
    refs = spec["refs"]
    if mode == "fedhive":
        from fedhive.blobs import PresignedFetcher, TensorKind, TensorRef, unpack

        tensors = [TensorRef(name=r["name"], dtype=r["dtype"], shape=tuple(r["shape"]),
                             kind=TensorKind.NUMPY, key=r["key"], url=r["url"],
                             url_expires_at_ms=int(time.time() * 1000) + 3_600_000,
                             offset=r["offset"], length=r["length"], checksum=r["checksum"])
                   for r in refs]
        fetcher = PresignedFetcher()
        cpu, start = time.process_time(), time.perf_counter()
        arrays = unpack(tensors, fetcher)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        moved = sum(int(a.nbytes) for a in arrays.values())
    else:
        client = s3_client(Settings(aws_access_key_id=spec["access_key"],
                                    aws_secret_access_key=spec["secret_key"],
                                    s3_region=spec["region"]), spec["endpoint"])
        kept = []
        cpu, start = time.process_time(), time.perf_counter()
        for ref in refs:
            if mode == "boto3_get":
                body = client.get_object(Bucket=spec["bucket"], Key=ref["key"])["Body"].read()
            else:
                sink = io.BytesIO()
                client.download_fileobj(spec["bucket"], ref["key"], sink)
                body = sink.getbuffer()
            kept.append(body)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        moved = sum(len(body) for body in kept)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"mode": mode, "seconds": seconds, "bytes": moved,
            "cpu_s_reading": round(cpu, 2),
            "cpu_s_whole_process": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_rss_mb": round(high_water_mb(os.getpid()), 1)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The comparison on a model of random tensors stored here, read through a byte-counting
    proxy as a site reads (the same path as bench/large_model.py's comparison)."""
    namespace = f"bench-download-{secrets.token_hex(3)}"
    with ExitStack() as stack:
        settings, s3 = stack.enter_context(bench_settings(namespace))
        upstream = urlsplit(settings.s3_endpoint_url or "")
        proxy = stack.enter_context(CountingProxy((upstream.hostname or "127.0.0.1",
                                                   upstream.port or 80)))
        store = S3BlobStore.from_settings(settings)
        stack.callback(store.close)
        store.ensure_bucket()
        prefix = Names(namespace).tensor_prefix("download")
        stack.callback(store.delete_prefix, prefix)
        tensors = max(1, round(args.size / args.tensor_mib))
        length = int(args.size * MiB) // tensors // 4
        rng = np.random.default_rng()
        codec = TensorCodec(store, settings, inline_threshold=0)
        stack.callback(codec.close)
        refs = []
        for index in range(tensors):  # one at a time: the script holds one tensor, not the model
            tensor = {f"layer{index:04d}": rng.random(length, dtype=np.float32)}
            refs += codec.pack(tensor, prefix)
        compared = compare_downloads(settings, proxy.endpoint_url, refs, args.repeat)
    return {"download_vs_boto3": compared, "size_mib": args.size,
            "tensor_mib": args.tensor_mib, "s3": s3,
            "s3_for_readers": "a byte-counting TCP proxy in front of it (bench/s3_proxy.py)",
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "command": " ".join(["bench/downloads.py", *sys.argv[1:]])}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--probe":
        print(json.dumps(probe(sys.argv[2], sys.argv[3])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=512, help="model size in MiB")
    parser.add_argument("--tensor-mib", type=float, default=16)
    parser.add_argument("--repeat", type=int, default=5,
                        help="how many times each reader runs (alternating)")
    parser.add_argument("--output", type=Path,
                        default=ROOT / "bench/results/large_model_download.json")
    args = parser.parse_args()
    configure("bench-downloads", level="WARNING")  # logs to stderr: stdout is the JSON result
    write_results(run(args), args.output)


if __name__ == "__main__":
    main()
