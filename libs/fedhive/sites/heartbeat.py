"""Heartbeats: a site agent's periodic report, and each running client job's own beat.

Times are unix epoch milliseconds. `resources` is the resource manager's report (e.g.
`{"num_gpus": 2, "free": {"num_gpus": 1}}`), kept as plain JSON-able data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SiteHeartbeat:
    site: str
    org: str = ""
    running_job_ids: list[str] = field(default_factory=list)
    resources: dict[str, Any] = field(default_factory=dict)
    agent_version: str = ""
    sent_at_ms: int = 0


@dataclass(frozen=True)
class JobHeartbeat:
    """Sent by a client job so a long training step is never taken for a dead site; with
    `ended`, its site agent's notice that the client job's process is over (`exit_code`: the
    exit code, or -N for signal N; `reason`: why, one line)."""

    job_id: str
    site: str
    sent_at_ms: int = 0
    current_task: str = ""
    progress: float = 0.0
    ended: bool = False
    exit_code: int = 0
    reason: str = ""
