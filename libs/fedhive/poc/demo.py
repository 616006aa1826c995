"""The demo's jobs: submit an example, follow it (status and the rounds `fedhive metrics`
reads, polled through the SDK) until it is final, keep its result. The display is the CLI's
(fedhive/cli/demo.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhive import extras
from fedhive.errors import PocFailed
from fedhive.jobs.metrics import RoundMetrics
from fedhive.jobs.status import JobStatus
from fedhive.sdk import Session

EXAMPLES = ("hello-numpy", "hello-pt")
POLL_S = 0.25


def find_examples(given: Path | None) -> Path:
    """The folder holding the demo's examples: `given`, else ./examples, else the copy an
    installed wheel bundles (fedhive/examples, put there by setup.py), else the examples of the
    fedhive checkout this package runs from (an editable install)."""
    package = Path(__file__).resolve().parents[1]
    candidates = [given] if given else [Path.cwd() / "examples", package / "examples",
                                        package.parents[1] / "examples"]
    for folder in candidates:
        if all((folder / name / "meta.json").is_file() for name in EXAMPLES):
            return folder.resolve()
    raise PocFailed(f"the examples {' and '.join(EXAMPLES)} are not in "
                    f"{' or '.join(str(c) for c in candidates)}: pass --examples DIR")


def check_example_needs() -> None:
    """hello-pt trains with torch on scikit-learn's digits, at the sites and the server: both
    come with the `torch` extra (ConfigError naming it when either is missing)."""
    extras.require("examples/hello-pt", "torch", "sklearn")


@dataclass
class JobProgress:
    name: str
    job_id: str
    status: JobStatus = JobStatus.SUBMITTED
    reason: str = ""
    rounds: list[RoundMetrics] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None

    @property
    def done(self) -> int:
        return len(self.rounds)

    @property
    def num_rounds(self) -> int | None:
        return self.rounds[-1].num_rounds if self.rounds else None

    @property
    def final_metrics(self) -> dict[str, Any]:
        return self.rounds[-1].aggregate if self.rounds else {}

    @property
    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    @property
    def completed(self) -> bool:
        return self.status == JobStatus.FINISHED_COMPLETED


def run_job(session: Session, folder: Path, on_update: Callable[[JobProgress], None]) -> \
        JobProgress:
    """Submit `folder` and poll the job (record and rounds) until its status is final;
    `on_update` sees every poll."""
    job_id = session.submit(folder).job_id
    progress = JobProgress(folder.name, job_id)
    on_update(progress)
    while True:
        record = session.get(job_id)
        progress.status, progress.reason = record.status, record.status_reason
        progress.rounds = session.metrics(job_id)
        if record.status.is_final:
            progress.ended = time.monotonic()
            on_update(progress)
            return progress
        on_update(progress)
        time.sleep(POLL_S)


def save_result(session: Session, job_id: str, folder: Path) -> Path:
    """Download the job's result (metrics.json, the model, logs) to folder/JOB/result.zip."""
    target = folder / job_id / "result.zip"
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("wb") as out:
        session.download(job_id, out, result=True)
    return target
