"""The interface between the server-job process and the workflows it runs.

A workflow is any object built from a `workflows` entry of config_fed_server.json (`{id, path,
args}`) that has a `run(ctx)` method. The server job calls the workflows' `run` one after the
other, in the order the config lists them, on its main thread:

* `run` returning normally means the workflow completed; when the last one has, the job is
  `FINISHED:COMPLETED`;
* `run` raising ends the job `FINISHED:EXECUTION_EXCEPTION` with the error (later workflows do
  not run);
* a workflow must watch `ctx.abort` (a `threading.Event`, set when the job is aborted or its
  server job is told to stop) and return soon after it is set;
* `ctx.gone_sites()` names the sites that left the job while it ran (a site that stopped
  reporting the job, or went offline), each with the reason: a workflow goes on with the
  others or raises if it can no longer meet its minimums.

The controller/task API of the FL runtime is built on this interface.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


@dataclass
class WorkflowContext:
    job_id: str
    sites: list[str]  # the client sites the job started on
    workspace: Path  # the server job's own folder; what it holds becomes the job's result
    log: Any  # a structlog logger bound with job_id
    components: dict[str, Any] = field(default_factory=dict)  # built components by id
    abort: threading.Event = field(default_factory=threading.Event)
    _gone: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def gone_sites(self) -> dict[str, str]:
        """Sites that left the job while it ran -> why."""
        with self._lock:
            return dict(self._gone)

    def site_gone(self, site: str, reason: str) -> None:
        """Called by the server job when the job-runner says `site` is gone."""
        with self._lock:
            self._gone.setdefault(site, reason)


class Workflow(Protocol):
    def run(self, ctx: WorkflowContext) -> None: ...
