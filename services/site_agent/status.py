"""`fedhive-site-agent status`: what a site operator may see of the site, from the site's own
files and process table only (no broker, no server): the agent, the last server contact, and
every job with its state, allocation and client-job process.

A job recorded RUNNING whose client-job process is gone (the agent was killed before it could
notice) is shown as LOST, as the agent will record it when it restarts: never a phantom job.
One whose client job still runs stays RUNNING: a restarted agent re-adopts it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import process
from .config import load_site
from .records import JobState, Workspace, now_ms


@dataclass(frozen=True)
class SiteStatus:
    site: str
    org: str
    workspace: str
    agent_running: bool
    agent_pid: int
    last_server_contact_ms: int
    jobs: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {
            "site": self.site,
            "org": self.org,
            "workspace": self.workspace,
            "agent": {"running": self.agent_running, "pid": self.agent_pid},
            "last_server_contact_ms": self.last_server_contact_ms or None,
            "jobs": self.jobs,
        }


def site_status(site_dir: Path) -> SiteStatus:
    config = load_site(site_dir)
    ws = Workspace(config.workspace)
    info = ws.load_agent()
    agent_running = info is not None and process.alive(info.pid, info.pid_started)
    jobs = []
    for record in ws.load_jobs():
        values = record.to_json()
        values["state"] = record.state.value
        values.pop("pid_started")
        values.pop("token")
        running = record.state is JobState.RUNNING
        # pid 0: a light site's client job, a thread that lives as long as its host
        alive = process.alive(record.pid, record.pid_started) if record.pid else agent_running
        values["process_alive"] = running and alive
        if running and not values["process_alive"]:
            values["state"] = JobState.LOST.value
            values["reason"] = "client job process is gone (the agent has not seen it exit)"
        jobs.append(values)
    return SiteStatus(
        site=config.site,
        org=config.org,
        workspace=str(config.workspace),
        agent_running=agent_running,
        agent_pid=info.pid if info else 0,
        last_server_contact_ms=info.last_server_contact_ms if info else 0,
        jobs=jobs,
    )


def render(status: SiteStatus, now: int | None = None) -> str:
    now = now_ms() if now is None else now
    agent = f"running (pid {status.agent_pid})" if status.agent_running else "not running"
    if status.last_server_contact_ms:
        ago = (now - status.last_server_contact_ms) / 1000
        contact = f"{_when(status.last_server_contact_ms)} ({ago:.0f} s ago)"
    else:
        contact = "never"
    lines = [
        f"site {status.site}" + (f" ({status.org})" if status.org else ""),
        f"agent: {agent}",
        f"last server contact: {contact}",
        f"workspace: {status.workspace}",
    ]
    if not status.jobs:
        lines.append("no jobs")
        return "\n".join(lines)
    rows = [("JOB", "STATE", "APP", "ALLOCATION", "PID", "EXIT", "UPDATED")]
    for job in status.jobs:
        rows.append((
            job["job_id"],
            job["state"],
            job["app_name"] or "-",
            "-" if job["allocation"] is None else json.dumps(job["allocation"], sort_keys=True),
            str(job["pid"] or "-"),
            "-" if job["exit_code"] is None else str(job["exit_code"]),
            _when(job["updated_at_ms"]),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines.append("")
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
              for row in rows]
    for job in status.jobs:
        pending = "its end is not yet reported to the server" if job["notice_pending"] else ""
        if why := "; ".join(filter(None, [job["reason"], job["exit_reason"], pending])):
            lines.append(f"  {job['job_id']}: {why}")
    return "\n".join(lines)


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
