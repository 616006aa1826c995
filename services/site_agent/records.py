"""The agent's own memory, kept in the site's workspace as small JSON files.

    <workspace>/<job_id>/                 the deployed app bundle (the client job's cwd)
    <workspace>/.agent/agent.json         the agent's pid and last server contact
    <workspace>/.agent/jobs/<job_id>.json one job's record
    <workspace>/.agent/jobs/<job_id>.log  the client job's stdout and stderr
    <workspace>/.agent/jobs/<job_id>.cj.json  what the client job reported about itself
    <workspace>/.agent/jobs/<job_id>.end.json its last words: exit code and why it ended
    <workspace>/.agent/jobs/<job_id>.logs.json how much of its log was shared (`logs`)

Every file is written whole to a temporary name and renamed into place, so a reader (the
`status` command, an agent restarted after SIGKILL) sees the old or the new version, never half.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from fedhive.errors import InvalidArgument

# Job ids become folder and file names: no '/', no leading '.', no ':'.
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
AGENT_DIR = ".agent"
MAX_REASON = 500  # characters of a one-line reason (the JobHeartbeat goes to every runner)
_LOG_TAIL_BYTES = 4096


class JobState(StrEnum):
    ALLOCATED = "ALLOCATED"  # resources allocated, nothing deployed yet
    DEPLOYED = "DEPLOYED"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"  # the client job exited on its own
    ABORTED = "ABORTED"
    LOST = "LOST"  # the agent restarted and found its client job gone (or had to stop it)

    @property
    def final(self) -> bool:
        return self in (JobState.FINISHED, JobState.ABORTED, JobState.LOST)


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    state: JobState
    app_name: str = ""
    token: str = ""  # the resource manager's token while resources are held
    allocation: dict[str, Any] | None = None  # None: nothing held
    pid: int = 0
    pid_started: int | None = None  # the process's start time, to tell a reused pid apart
    exit_code: int | None = None  # None: not ended, or ended while not the agent's child
    reason: str = ""  # why the agent changed its state (an abort's reason, LOST's)
    exit_reason: str = ""  # why its client job's process ended, one line
    notice_pending: bool = False  # its ended JobHeartbeat is not yet confirmed by the broker
    updated_at_ms: int = field(default_factory=lambda: now_ms())

    def but(self, **changes: Any) -> JobRecord:
        return replace(self, **changes, updated_at_ms=now_ms())

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> JobRecord:
        return cls(**{**values, "state": JobState(values["state"])})


@dataclass(frozen=True)
class LastWords:
    """What a client job writes just before it exits, for its agent to pass on: its exit code
    (-N when it ends itself by signal N) and why it ended, one line."""

    exit_code: int
    reason: str
    at_ms: int = field(default_factory=lambda: now_ms())


@dataclass(frozen=True)
class AgentInfo:
    site: str
    pid: int
    pid_started: int | None
    started_at_ms: int
    last_server_contact_ms: int = 0


def now_ms() -> int:
    return int(time.time() * 1000)


def job_id_problem(job_id: str) -> str | None:
    if not JOB_ID.match(job_id):
        return f"invalid job id {job_id!r} (letters, digits, '-', '_'; at most 128)"
    return None


def one_line(text: str, limit: int = MAX_REASON) -> str:
    """`text` on one line (whitespace runs made one space), cut to `limit` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def check_job_id(job_id: str) -> str:
    if (problem := job_id_problem(job_id)) is not None:
        raise InvalidArgument(problem, field="job_id")
    return job_id


class Workspace:
    """Paths and atomic reads/writes under one site's workspace."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.agent_dir = root / AGENT_DIR
        self.jobs_dir = self.agent_dir / "jobs"

    def create(self) -> None:
        self.jobs_dir.mkdir(parents=True, exist_ok=True)

    def app_dir(self, job_id: str) -> Path:
        return self.root / job_id

    def job_file(self, job_id: str) -> Path:
        return self.jobs_dir / f"{job_id}.json"

    def log_file(self, job_id: str) -> Path:
        return self.jobs_dir / f"{job_id}.log"

    def report_file(self, job_id: str) -> Path:
        return self.jobs_dir / f"{job_id}.cj.json"

    def last_words_file(self, job_id: str) -> Path:
        return self.jobs_dir / f"{job_id}.end.json"

    def log_position_file(self, job_id: str) -> Path:
        return self.jobs_dir / f"{job_id}.logs.json"

    @property
    def agent_file(self) -> Path:
        return self.agent_dir / "agent.json"

    def save_job(self, record: JobRecord) -> None:
        write_json(self.job_file(record.job_id), record.to_json())

    def load_jobs(self) -> list[JobRecord]:
        if not self.jobs_dir.is_dir():
            return []
        records = []
        for path in sorted(self.jobs_dir.glob("*.json")):
            if job_id_problem(path.stem) is not None:  # <job>.cj.json, <job>.end.json
                continue
            records.append(JobRecord.from_json(read_json(path)))
        return records

    def save_last_words(self, job_id: str, words: LastWords) -> None:
        write_json(self.last_words_file(job_id), asdict(words))

    def load_last_words(self, job_id: str) -> LastWords | None:
        """The client job's last words; None when it wrote none (killed, or crashed before it
        knew its workspace) or they cannot be read."""
        try:
            values = read_json(self.last_words_file(job_id))
            return LastWords(int(values["exit_code"]), one_line(str(values["reason"])),
                             int(values.get("at_ms", 0)))
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def log_tail(self, job_id: str) -> str:
        """The last non-empty line the client job wrote to its log ("" for none): the error
        of one that died before it could write its last words."""
        try:
            with self.log_file(job_id).open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
                lines = log.read().decode("utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return next((one_line(line) for line in reversed(lines) if line.strip()), "")

    def save_agent(self, info: AgentInfo) -> None:
        write_json(self.agent_file, asdict(info))

    def load_agent(self) -> AgentInfo | None:
        if not self.agent_file.exists():
            return None
        return AgentInfo(**read_json(self.agent_file))


def write_json(path: Path, values: dict[str, Any]) -> None:
    """Write `values` to `path` atomically: a temporary file in the same folder, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(values, out, indent=1, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))
