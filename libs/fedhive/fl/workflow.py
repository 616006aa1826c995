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

* a workflow may define `prepare(ctx)`: the server job calls it for every workflow before
  running the first, so a workflow that names a missing component or one of the wrong type
  (`ComponentError` naming the id and the field) fails the job at start, not rounds into it.

Workflows give sites work through the task API (`fedhive.fl.controller.Controller` over
`ctx.tasks`), put tensors in S3 through `ctx.codec` (refs the sites can read through presigned
URLs), and report each finished round through `ctx.report_round` (what `fedhive metrics` shows).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fedhive.errors import FailedPrecondition
from fedhive.fl.components import ComponentError
from fedhive.names import Names

if TYPE_CHECKING:
    from fedhive.blobs import BlobStore, TensorCodec
    from fedhive.fl.operations import Operations
    from fedhive.fl.task_manager import TaskManager


@dataclass(frozen=True)
class RoundReport:
    workflow: str  # the workflow's id in the server config
    round: int  # 0-based
    num_rounds: int
    metrics: dict[str, Any]  # {"aggregate": {...}, "sites": {site: {...}}} or any JSON

@dataclass
class WorkflowContext:
    job_id: str
    sites: list[str]  # the client sites the job started on
    workspace: Path  # the server job's own folder; what it holds becomes the job's result
    log: Any  # a structlog logger bound with job_id
    components: dict[str, Any] = field(default_factory=dict)  # built components by id
    tasks: TaskManager | None = None  # the job's task manager (set by the server job)
    store: BlobStore | None = None  # credentialed S3 (the SJ's)
    codec: TensorCodec | None = None  # packs arrays into refs sites can read
    names: Names | None = None  # the deployment's queue, key and object names
    resume_from: str = ""  # a job id: continue from that job's last checkpoint
    report_round: Any = None  # Callable[[RoundReport], None], set by the server job
    checkpointed: set[str] | None = None  # the keys this job's checkpoint names, once known
    operators: Any = None  # the server config's `operators` section, as written
    operations: Operations | None = None  # an operation-driven job's inbox (its controller's)
    abort: threading.Event = field(default_factory=threading.Event)
    prepared: threading.Event = field(default_factory=threading.Event)  # every prepare() ran
    _gone: dict[str, str] = field(default_factory=dict)
    _foreign: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def tensor_prefix(self) -> str:
        """Where this job's tensor objects live (task data, results, checkpoints)."""
        if self.names is None:
            raise FailedPrecondition("the workflow context has no names", field="names")
        return self.names.job_tensor_prefix(self.job_id)

    def gone_sites(self) -> dict[str, str]:
        """Sites that left the job while it ran -> why."""
        with self._lock:
            return dict(self._gone)

    def add_foreign(self, keys: Iterable[str]) -> None:
        """Keys of another system's objects (an upper tier's, in an operation's task data):
        they go to the sites with the URLs they came with and are never re-signed here."""
        with self._lock:
            self._foreign.update(keys)

    def is_foreign(self, key: str) -> bool:
        with self._lock:
            return key in self._foreign

    def site_gone(self, site: str, reason: str) -> None:
        """Called by the server job when the job-runner says `site` is gone."""
        with self._lock:
            self._gone.setdefault(site, reason)


class Workflow(Protocol):
    def run(self, ctx: WorkflowContext) -> None: ...


def component(ctx: WorkflowContext, owner: str, field_name: str, cid: str, kind: type) -> Any:
    """The component `cid` that workflow `owner` names in `field_name`, checked to be a `kind`."""
    if cid not in ctx.components:
        raise ComponentError(f"workflow {owner!r}: {field_name} names component {cid!r}, "
                             "which the server config does not define")
    value = ctx.components[cid]
    if not isinstance(value, kind):
        raise ComponentError(f"workflow {owner!r}: {field_name} names component {cid!r}, a "
                             f"{type(value).__name__}, not a {kind.__name__}")
    return value
