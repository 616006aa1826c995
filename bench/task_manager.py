"""Benchmark: the task manager's CPU per site result of one broadcast, with 100 to 1,000 sites.

In-process (no broker): a `TaskManager` of N sites broadcasts one task to all of them (every
site must answer), each site takes its assignment, then every result is submitted; the time of
the submits divided by N is `us_per_result_<n>_sites`. What a server job pays on every result
for the rules of the task (FLARE's wf_comm_server): it must not grow with the sites.

    .venv/bin/python bench/task_manager.py [--sites 100 300 1000] [--repeat 5]

Prints JSON and writes bench/results/task_manager.json (the best of `--repeat` runs per N).
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import time
from pathlib import Path
from typing import Any

import structlog

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/support imports tests.fixtures

from support import load_average, write_results  # noqa: E402  (beside this script)

from fedhive.fl.dxo import DataKind, Dxo  # noqa: E402
from fedhive.fl.task_manager import TaskManager  # noqa: E402
from fedhive.fl.tasks import Result, ReturnCode, Task  # noqa: E402

OUTPUT = Path(__file__).resolve().parent / "results" / "task_manager.json"


def us_per_result(count: int) -> float:
    sites = [f"site-{n}" for n in range(1, count + 1)]
    manager = TaskManager(sites)
    task = Task("train", Dxo(DataKind.WEIGHTS, {"w": [0.0]}, {}))
    manager.broadcast(task, min_responses=count)
    assignments = [manager.next_task(site).client_task for site in sites]
    started = time.perf_counter()
    for client_task in assignments:
        assert client_task is not None
        manager.submit(client_task.site, client_task.id, Result(ReturnCode.OK))
    elapsed = time.perf_counter() - started
    assert task.completion_status is not None, "the broadcast did not complete"
    return elapsed / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    # the manager logs every result at info: not what this measures
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    results: dict[str, Any] = {"loadavg_1_5_15_at_start": load_average()}
    for count in args.sites:
        best = min(us_per_result(count) for _ in range(args.repeat))
        results[f"us_per_result_{count}_sites"] = round(best, 1)
    results.update(python=platform.python_version(), loadavg_1_5_15_at_end=load_average(),
                   command=" ".join(["bench/task_manager.py", *sys.argv[1:]]))
    write_results(results, OUTPUT)


if __name__ == "__main__":
    main()
