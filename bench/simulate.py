"""Benchmark: `fedhive simulate` against NVIDIA FLARE's simulator on the same workload.

Both run, alternately in the same invocation, the same job at 2 and then 8 sites: ScatterAndGather
over a 1 MiB float32 model (one array), `--rounds` rounds, min_clients = every site, no wait
after the minimum, a trainer that adds 1 to the weights, every site running at once (`-t` = the
number of sites). FLARE's side is its own job format and components (ScatterAndGather,
NPModelPersistor, InTimeAccumulateWeightedAggregator), installed on first use into
build/flare-venv (nvflare pinned below; never a dependency of fedhive).

Measured per system and site count, the median of `--repeats` runs:
  * wall time of the whole command, interpreter start-up included;
  * per-round time = (end of the last round - end of the first) / (rounds - 1), from fedhive's
    metrics.json and from the "Round N finished." lines of FLARE's server log;
  * peak memory: the highest sum of the RSS of the command and all its descendants, sampled
    every 0.1 s.
FLARE also runs a second time with `--flare-poll` as its server's task_request_interval
(`flare_fast_poll_*` keys): by default its clients wait 2 s after each task before asking for
the next, which alone sets a floor on its round time.

    .venv/bin/python bench/simulate.py [--rounds 5] [--sites 2 8] [--repeats 3] [--flare-poll 0.1]

Prints JSON and writes bench/results/simulate.json (keys `<system>_round_s_<n>_sites`,
`<system>_peak_mib_<n>_sites`, `<system>_wall_s_<n>_sites`, and
`simulate_round_ratio_vs_flare` = FLARE's per-round time / fedhive's at 8 sites).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.fixtures, which bench/support.py imports

from rounds import MODEL_FLOATS, job_archive  # noqa: E402  (beside this script)
from support import load_average, write_results  # noqa: E402

NVFLARE = "2.9.0"  # the newest release at the time of writing; installs on Python 3.11
FLARE_VENV = ROOT / "build" / "flare-venv"
SAMPLE_S = 0.1
TIMEOUT_S = 600.0

# FLARE's NPTrainer also saves the local model every round and NPModelPersistor's initial model
# is 3x3 (or a JSON list): these are the same trainer and model as fedhive's side.
FLARE_CUSTOM = f'''
import numpy as np

from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.executor import Executor
from nvflare.app_common.np.np_model_persistor import NPModelPersistor


class Trainer(Executor):
    def execute(self, task_name, shareable, fl_ctx, abort_signal):
        incoming = from_shareable(shareable)
        updated = {{name: value + 1 for name, value in incoming.data.items()}}
        return DXO(DataKind.WEIGHTS, updated, {{MetaKey.NUM_STEPS_CURRENT_ROUND: 1}}).to_shareable()


class Persistor(NPModelPersistor):
    def _get_initial_model_as_numpy(self):
        return np.zeros({MODEL_FLOATS}, dtype=np.float32)
'''


def write_files(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


def flare_job(folder: Path, sites: int, rounds: int, poll_s: float | None) -> Path:
    """FLARE's job; `poll_s` replaces the server's `task_request_interval` (2 s), how long a
    client waits before asking again for a task, also after each task it ran."""
    server: dict[str, Any] = {
        "format_version": 2,
        "components": [
            {"id": "persistor", "path": "bench_np.Persistor", "args": {}},
            {"id": "aggregator", "path": "nvflare.app_common.aggregators."
             "intime_accumulate_model_aggregator.InTimeAccumulateWeightedAggregator",
             "args": {"expected_data_kind": "WEIGHTS"}},
            {"id": "shareable_generator", "path": "nvflare.app_common.shareablegenerators."
             "full_model_shareable_generator.FullModelShareableGenerator", "args": {}},
        ],
        "workflows": [{
            "id": "scatter_and_gather",
            "path": "nvflare.app_common.workflows.scatter_and_gather.ScatterAndGather",
            "args": {"min_clients": sites, "num_rounds": rounds, "start_round": 0,
                     "wait_time_after_min_received": 0, "aggregator_id": "aggregator",
                     "persistor_id": "persistor",
                     "shareable_generator_id": "shareable_generator",
                     "train_task_name": "train", "train_timeout": 0}}],
    }
    if poll_s is not None:
        server["server"] = {"task_request_interval": poll_s}
    client = {"format_version": 2, "components": [],
              "executors": [{"tasks": ["train"],
                             "executor": {"path": "bench_np.Trainer", "args": {}}}]}
    return write_files(folder, {
        "meta.json": json.dumps({"name": "simulate-bench", "resource_spec": {},
                                 "min_clients": sites, "deploy_map": {"app": ["@ALL"]}}),
        "app/config/config_fed_server.json": json.dumps(server),
        "app/config/config_fed_client.json": json.dumps(client),
        "app/custom/bench_np.py": FLARE_CUSTOM,
    })


def flare_bin() -> Path:
    """The `nvflare` command of build/flare-venv, installing it there first if needed; exits
    with one line when that fails."""
    python = FLARE_VENV / "bin" / "python"
    check = [str(python), "-c", "import nvflare; print(nvflare.__version__)"]
    if (not python.exists()
            or subprocess.run(check, capture_output=True, text=True).stdout.strip() != NVFLARE):
        steps = [[sys.executable, "-m", "venv", str(FLARE_VENV)],
                 [str(python), "-m", "pip", "install", "-q", f"nvflare=={NVFLARE}"]]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                sys.exit(f"bench/simulate.py: installing nvflare=={NVFLARE} into {FLARE_VENV} "
                         f"failed: {last}")
    return FLARE_VENV / "bin" / "nvflare"


def tree_rss(proc: psutil.Process) -> int:
    """The RSS of `proc` and all its descendants, in bytes (those that end meanwhile count 0)."""
    total = 0
    try:
        members = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for member in members:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += member.memory_info().rss
    return total


def run_measured(command: list[str], cwd: Path) -> tuple[float, float, str]:
    """Run `command` to its end: wall seconds, peak MiB of its process tree, its stdout."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        popen = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=err,
                                 stdin=subprocess.DEVNULL)
        proc, peak = psutil.Process(popen.pid), 0
        while popen.poll() is None:
            peak = max(peak, tree_rss(proc))
            if time.perf_counter() - start > TIMEOUT_S:
                popen.kill()
            time.sleep(SAMPLE_S)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if popen.returncode != 0:
        tail = "\n".join((stdout + stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"{' '.join(command)} exited with {popen.returncode}:\n{tail}")
    return wall, peak / 2**20, stdout


def per_round(ends: list[float], rounds: int) -> float:
    if len(ends) != rounds:
        raise RuntimeError(f"{len(ends)} round ends found, {rounds} expected")
    return (ends[-1] - ends[0]) / (rounds - 1)


def run_fedhive(tmp: Path, sites: int, rounds: int) -> dict[str, float]:
    job = tmp / "fedhive-job.zip"  # bench/rounds.py's job, on sites site-1..N
    job.write_bytes(job_archive([f"site-{n}" for n in range(1, sites + 1)], rounds))
    fedhive = Path(sys.executable).parent / "fedhive"
    wall, peak, stdout = run_measured(
        [str(fedhive), "simulate", str(job), "-n", str(sites), "-t", str(sites),
         "--workspace", str(tmp / "fedhive-ws"), "--json"], tmp)
    with zipfile.ZipFile(Path(json.loads(stdout)["folder"]) / "result.zip") as result:
        reports = json.loads(result.read("metrics.json"))["rounds"]
    return {"wall_s": wall, "round_s": per_round([r["time"] for r in reports], rounds),
            "peak_mib": peak}


FLARE_ROUND_END = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*ScatterAndGather.*Round (\d+) finished\.")


def run_flare(nvflare: Path, tmp: Path, sites: int, rounds: int,
              poll_s: float | None = None) -> dict[str, float]:
    job = flare_job(tmp / "flare-job", sites, rounds, poll_s)
    workspace = tmp / "flare-ws"
    wall, peak, _ = run_measured(
        [str(nvflare), "simulator", str(job), "-w", str(workspace), "-n", str(sites),
         "-t", str(sites)], tmp)
    ends: dict[int, float] = {}
    for line in (workspace / "server" / "log.txt").read_text().splitlines():
        if match := FLARE_ROUND_END.match(line):
            at = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            ends[int(match[2])] = at
    return {"wall_s": wall, "round_s": per_round([ends[r] for r in sorted(ends)], rounds),
            "peak_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sites", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--flare-poll", type=float, default=0.1,
                        help="also run FLARE with this task_request_interval (0: do not)")
    parser.add_argument("--output", type=Path, default=ROOT / "bench/results/simulate.json")
    args = parser.parse_args()
    nvflare = flare_bin()
    systems: dict[str, Callable[[Path, int], dict[str, float]]] = {
        "fedhive": lambda tmp, sites: run_fedhive(tmp, sites, args.rounds),
        "flare": lambda tmp, sites: run_flare(nvflare, tmp, sites, args.rounds)}
    if args.flare_poll:
        systems["flare_fast_poll"] = lambda tmp, sites: run_flare(
            nvflare, tmp, sites, args.rounds, args.flare_poll)
    load_before = load_average()
    results: dict[str, Any] = {}
    for sites in args.sites:
        runs: dict[str, list[dict[str, float]]] = {system: [] for system in systems}
        for _ in range(args.repeats):  # alternately, so that all see the same machine
            for system, run in systems.items():
                with tempfile.TemporaryDirectory(prefix="fedhive-bench-simulate-") as tmp:
                    runs[system].append(run(Path(tmp), sites))
        for system, measured in runs.items():
            for key in ("round_s", "wall_s", "peak_mib"):
                median = statistics.median(run[key] for run in measured)
                results[f"{system}_{key}_{sites}_sites"] = round(
                    median, 4 if key == "round_s" else 1)
            results[f"{system}_runs_{sites}_sites"] = [
                {key: round(value, 4) for key, value in run.items()} for run in measured]
        results[f"simulate_round_ratio_vs_flare_{sites}_sites"] = round(
            results[f"flare_round_s_{sites}_sites"] / results[f"fedhive_round_s_{sites}_sites"], 2)
    if 8 in args.sites:
        results["simulate_round_ratio_vs_flare"] = results[
            "simulate_round_ratio_vs_flare_8_sites"]
    results.update(rounds=args.rounds, repeats=args.repeats, model_mib=1, nvflare=NVFLARE,
                   flare_fast_poll_s=args.flare_poll or None, python=platform.python_version(),
                   cpus=os.cpu_count(), load_average=load_before,
                   loadavg_1_5_15_at_end=load_average(),
                   command=" ".join(["bench/simulate.py", *sys.argv[1:]]))
    write_results(results, args.output)


if __name__ == "__main__":
    main()
