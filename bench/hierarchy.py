"""Benchmark: hierarchical federation (seed 004) against the same sites flat.

Two real systems on a namespace (and bucket) each, as the hierarchy tests run them
(tests/fixtures/e2e.py): tier 2 with sites b1 and b2, tier 1 with a1, a hub site for tier 2,
and f1, f2 (the flat stand-ins for b1, b2). Every site runs the same trainer (adds an offset,
reports a weight), so both jobs compute the same FedAvg.

1. Round time, `--small-mib` model: a ScatterAndGather job over a1, f1, f2 (flat) and one over
   a1 and the hub (tiered: b1, b2 below), alternating, `--pairs` times, `--rounds` rounds each;
   a job's round time = (last round report - first) / (rounds - 1), from its metrics; what
   the tier costs = tiered - flat, a fixed time per round whatever the sites' training takes
   (`--train-ms`: each trainer waits that long per task, 0 by default).
2. A `--large-mib` model (tensors of `--tensor-mib`), `--large-rounds` rounds, flat then
   tiered (round time of each), and of the tiered job: the peak
   RSS of the hub's client job and agent and of tier 2's server job, and the bytes through
   the hub site per round: what its client job's and agent's TCP sockets sent and received
   (`ss -tip`: gRPC to tier 2, AMQP to tier 1) from the first round's report to the last.

    .venv/bin/python bench/hierarchy.py [--pairs 2] [--rounds 6] [--large-mib 512]
                                        [--train-ms 0]

Prints JSON and writes bench/results/hierarchy.json (keys `tiered_round_ratio`,
`tier_cost_ms`, `hub_cj_peak_mb`, `t2_sj_peak_mb`, `hub_bytes_per_round`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.fixtures (the systems, SeaweedFS)

import psutil  # noqa: E402
from support import bench_settings, high_water_mb, load_average, write_results  # noqa: E402

from fedhive.jobs.status import JobStatus  # noqa: E402
from fedhive.logging import configure  # noqa: E402
from tests.fixtures.e2e import running_system  # noqa: E402
from tests.fixtures.tiers import Tier, configure_hub, site_app, start_gateway  # noqa: E402

MiB = 1024 * 1024
PERSISTOR = '''
import numpy as np

from fedhive.fl.persistors import NumpyModelPersistor


class ZerosPersistor(NumpyModelPersistor):
    """`tensors` float32 arrays of `floats` zeros (too large for a JSON `initial`)."""

    def __init__(self, tensors, floats):
        super().__init__()
        self.tensors, self.floats = tensors, floats

    def _initial_items(self):
        for index in range(self.tensors):
            yield f"w{index}", np.zeros(self.floats, np.float32)
'''


def job(root: Path, app: Path, sites: list[str], *, model_mib: float, tensor_mib: float,
        rounds: int) -> Path:
    """A ScatterAndGather job of the trainer app over `sites` (its server app: a zeros model
    of `model_mib` in tensors of `tensor_mib`, the weighted average)."""
    tensors = max(1, round(model_mib / tensor_mib))
    folder = root / f"job-{'-'.join(sites)}-{model_mib:g}"
    for sub in ("server/config", "server/custom", "site"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    (folder / "server" / "custom" / "zeros_persistor.py").write_text(PERSISTOR)
    server = {"format_version": 2, "components": [
        {"id": "persistor", "path": "zeros_persistor.ZerosPersistor",
         "args": {"tensors": tensors, "floats": int(model_mib * MiB / tensors) // 4}},
        {"id": "aggregator", "path": "fedhive.fl.aggregators.InTimeAccumulateWeightedAggregator",
         "args": {}},
        {"id": "shareable_generator",
         "path": "fedhive.fl.shareables.FullModelShareableGenerator", "args": {}}],
        "workflows": [{"id": "sag", "path": "fedhive.fl.workflows.ScatterAndGather", "args": {
            "min_clients": len(sites), "num_rounds": rounds, "persistor_id": "persistor",
            "wait_time_after_min_received": 0, "snapshot_every_n_rounds": 0}}],
        "operators": {"train": {"method": "bcast", "min_targets": 0}}}
    (folder / "server" / "config" / "config_fed_server.json").write_text(json.dumps(server))
    for path in app.rglob("*"):
        if path.is_file():
            target = folder / "site" / path.relative_to(app)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    meta = {"name": folder.name, "deploy_map": {"server": ["server"], "site": sites},
            "min_clients": len(sites)}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def socket_bytes() -> dict[int, int]:
    """pid -> bytes sent + received over its open TCP sockets (`ss -tinp`)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=False).stdout
    totals: dict[int, int] = {}
    pids: list[int] = []
    for line in out.splitlines():
        if not line.startswith(("\t", " ")):
            pids = [int(pid) for pid in re.findall(r"pid=(\d+)", line)]
            continue
        moved = sum(int(n) for n in re.findall(r"bytes_(?:sent|received):(\d+)", line))
        for pid in pids:
            totals[pid] = totals.get(pid, 0) + moved
    return totals


class Watch:
    """Peak RSS (samples and VmHWM) and socket bytes (`socket_bytes`) of the processes `pick`
    picks, every 0.1 s."""

    def __init__(self, pick: Any) -> None:
        self._pick = pick
        self.peak_mb: dict[int, float] = {}
        self.io_bytes: dict[int, list[tuple[float, int]]] = {}  # (time, bytes so far)
        self.roles: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            now, moved = time.time(), socket_bytes()
            for proc in psutil.process_iter():
                try:
                    role = self._pick(proc)
                    if role is None:
                        continue
                    rss = proc.memory_info().rss / MiB
                except (psutil.Error, OSError):
                    continue
                self.roles[proc.pid] = role
                self.peak_mb[proc.pid] = max(self.peak_mb.get(proc.pid, 0.0), rss,
                                             high_water_mb(proc.pid))
                self.io_bytes.setdefault(proc.pid, []).append((now, moved.get(proc.pid, 0)))

    def by_role(self, start: float, end: float) -> dict[str, dict[str, float]]:
        """Per role: peak RSS, and the socket bytes moved between `start` and `end`."""
        out: dict[str, dict[str, float]] = {}
        for pid, role in self.roles.items():
            entry = out.setdefault(role, {"peak_mb": 0.0, "io_bytes": 0})
            entry["peak_mb"] = round(max(entry["peak_mb"], self.peak_mb[pid]), 1)
            inside = [count for at, count in self.io_bytes[pid] if start <= at <= end]
            if inside:
                entry["io_bytes"] += inside[-1] - inside[0]
        return out


def run_job(tier: Tier, folder: Path, timeout: float) -> list[float]:
    """Submit, wait; when each round was reported (unix seconds)."""
    with tier.session() as session:
        job_id = session.submit(folder).job_id
        deadline = time.monotonic() + timeout
        while not (record := session.get(job_id)).status.is_final:
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} did not end within {timeout:g} s")
            time.sleep(0.5)
        if record.status is not JobStatus.FINISHED_COMPLETED:
            raise RuntimeError(f"job {job_id}: {record.status.value} {record.status_reason}")
        return [entry.at_ms / 1000 for entry in session.metrics(job_id)]


def per_round(stamps: list[float]) -> float:
    """Seconds per round after the first (which holds the client jobs' start-up)."""
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    configure("bench", level="WARNING")
    results: dict[str, Any] = {"command": " ".join(["bench/hierarchy.py", *sys.argv[1:]]),
                               "loadavg_1_5_15_at_start": load_average()}
    with bench_settings("bench-hier-t1") as (settings, s3), \
            tempfile.TemporaryDirectory(prefix="fedhive-bench-hier-") as tmp_dir:
        tmp = args.logs or Path(tmp_dir)
        results["s3"] = s3
        settings2 = dataclasses.replace(settings, namespace="bench-hier-t2",
                                        s3_bucket=f"{settings.s3_bucket}-t2")
        for name in ("t1", "t2"):
            (tmp / name).mkdir(parents=True)
        lower_sites, upper_sites = ["b1", "b2"], ["a1", "f1", "f2", "hub"]
        with running_system(settings2, tmp / "t2", lower_sites, schedulers=1) as s2, \
                running_system(settings, tmp / "t1", upper_sites, launched=3,
                               schedulers=1) as s1:
            t2 = Tier(s2, start_gateway(s2, tmp / "t2"))
            t1 = Tier(s1, start_gateway(s1, tmp / "t1"))
            try:
                hub = s1.agents[3]
                configure_hub(hub, s1, t2, sites=lower_sites)
                trainers = ["a1", "f1", "f2", "b1", "b2"]
                app = site_app(tmp / "app", dict.fromkeys(trainers, 1.0),
                               dict.fromkeys(trainers, 1.0), seconds=args.train_ms / 1000)
                flat, tiered = [], []
                for pair in range(args.pairs):
                    for sites, times in ((["a1", "f1", "f2"], flat), (["a1", "hub"], tiered)):
                        folder = job(tmp / f"p{pair}", app, sites, model_mib=args.small_mib,
                                     tensor_mib=args.small_mib, rounds=args.rounds)
                        times.append(per_round(run_job(t1, folder, 300)))
                results.update(
                    small_model_mib=args.small_mib, rounds=args.rounds, pairs=args.pairs,
                    train_ms=args.train_ms,
                    round_s_flat=[round(t, 4) for t in flat],
                    round_s_tiered=[round(t, 4) for t in tiered],
                    tiered_round_ratio=round(statistics.median(
                        t / f for t, f in zip(tiered, flat, strict=True)), 3),
                    tier_cost_ms=round(statistics.median(
                        (t - f) * 1000 for t, f in zip(tiered, flat, strict=True)), 1))
                if args.large_mib > 0:
                    assert hub.proc is not None
                    results.update(large(args, tmp, t1, hub.proc.pid, app))
            finally:
                t1.gateway.stop()
                t2.gateway.stop()
    results["loadavg_1_5_15_at_end"] = load_average()
    return results


def large(args: argparse.Namespace, tmp: Path, t1: Tier, hub_agent: int | None,
          app: Path) -> dict[str, Any]:
    lower_work = str(tmp / "t2" / "runner-work")

    def pick(proc: psutil.Process) -> str | None:
        if proc.pid == hub_agent:
            return "hub_agent"
        cwd = proc.cwd()
        if "/t1/hub/" in cwd and "client_job" in " ".join(proc.cmdline()):
            return "hub_cj"
        if cwd.startswith(lower_work):
            return "t2_sj"
        return None

    flat = per_round(run_job(t1, job(tmp / "large-flat", app, ["a1", "f1", "f2"],
                                     model_mib=args.large_mib, tensor_mib=args.tensor_mib,
                                     rounds=args.large_rounds), 1800))
    folder = job(tmp / "large", app, ["a1", "hub"], model_mib=args.large_mib,
                 tensor_mib=args.tensor_mib, rounds=args.large_rounds)
    watch = Watch(pick)
    try:
        stamps = run_job(t1, folder, 1800)
    finally:
        watch.stop()
    roles = watch.by_role(stamps[0], stamps[-1])
    hub_bytes = roles.get("hub_cj", {}).get("io_bytes", 0) + \
        roles.get("hub_agent", {}).get("io_bytes", 0)
    rounds = len(stamps)
    return {"large_model_mib": args.large_mib, "tensor_mib": args.tensor_mib,
            "large_rounds": rounds, "large_round_s_flat": round(flat, 2),
            "large_round_s_tiered": round(per_round(stamps), 2),
            "large_tiered_round_ratio": round(per_round(stamps) / flat, 3) if flat else None,
            "hub_cj_peak_mb": roles.get("hub_cj", {}).get("peak_mb"),
            "hub_agent_peak_mb": roles.get("hub_agent", {}).get("peak_mb"),
            "t2_sj_peak_mb": roles.get("t2_sj", {}).get("peak_mb"),
            "hub_bytes_per_round": int(hub_bytes / max(1, rounds - 1)),
            "hub_bytes_note": "sent + received over the TCP sockets of the hub's client job "
                              "and agent from the first round's report to the last, per round"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--small-mib", type=float, default=1.0)
    parser.add_argument("--large-mib", type=float, default=512.0, help="0: skip")
    parser.add_argument("--tensor-mib", type=float, default=64.0)
    parser.add_argument("--large-rounds", type=int, default=3)
    parser.add_argument("--train-ms", type=float, default=0.0,
                        help="how long each site's trainer takes per task")
    parser.add_argument("--output", type=Path, default=ROOT / "bench/results/hierarchy.json")
    parser.add_argument("--logs", type=Path, default=None,
                        help="an empty folder to keep the systems' logs in")
    args = parser.parse_args()
    write_results(run(args), args.output)


if __name__ == "__main__":
    main()
