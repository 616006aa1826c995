"""The POC's state file (`state.json`): what `poc start` started, so that `poc status` and
`poc stop` (another process, later) know it.

It is rewritten after every step of a start (each process spawned, the broker users made), so
a start that dies half-way still leaves what it started findable. A process is known by its pid
AND its create time: a pid the kernel has given to another process since does not match.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fedhive.errors import PocFailed
from fedhive.poc.layout import write_private

VERSION = 1


@dataclass(frozen=True)
class ProcessEntry:
    name: str  # job-store, scheduler, job-runner, gateway, site-<name>, seaweedfs
    pid: int  # also its process group and session (started with its own session)
    create_time: float  # psutil's create time (seconds since the epoch)
    log: str
    argv: list[str] = field(default_factory=list)


@dataclass
class PocState:
    root: str
    namespace: str
    sites: list[str]
    gateway: str  # host:port
    s3_endpoint: str
    embedded_s3: bool
    started_at: str  # ISO 8601 UTC
    processes: list[ProcessEntry] = field(default_factory=list)
    broker_users: list[str] = field(default_factory=list)  # deleted by `poc stop`
    infra_started: list[str] = field(default_factory=list)  # "rabbitmq", "redis"
    ready: bool = False  # every process answered and every site came online

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> PocState:
        values = {k: v for k, v in raw.items() if k != "version"}
        values["processes"] = [ProcessEntry(**p) for p in values.get("processes", [])]
        return cls(**values)

    def save(self, path: Path) -> None:
        # mode 0600: names and addresses only, but nobody else needs to read it
        write_private(path, json.dumps(self.to_json(), indent=2) + "\n")


def load_state(path: Path) -> PocState | None:
    """The state file, or None when there is none (no POC started there, or it was stopped)."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise PocFailed(f"cannot read {path}: {err}: remove it after checking that no POC "
                        "process runs (fedhive poc stop --dir ... also scans for them)") from None
    if not isinstance(raw, dict) or raw.get("version") != VERSION:
        raise PocFailed(f"{path} is not a state file of this fedhive version: remove it")
    try:
        return PocState.from_json(raw)
    except TypeError as err:
        raise PocFailed(f"{path} is damaged ({err}): remove it") from None
