"""CrossSiteModelEval: every participating site validates every model (FLARE's).

1. `submit_model` is broadcast to the participants (`participating_clients`, default: the
   sites still in the job); each model a site sends back becomes a `validate` task for all
   participants, its arrays forwarded as the refs the site sent (the server never reads them);
2. with `persistor_id`, the persistor's model (the trained global model, after a training
   workflow saved it) is validated too, as owner `SRV_<persistor_id>`;
3. once every task is done, `<workspace>/<cross_val_dir>/cross_val_results.json` holds
   `{model_owner: {validator_site: metrics}}` (a failed validation: `{"error": why}`).

Validate task data: the model (WEIGHTS) with meta {"model_owner": owner}; a validation result:
a METRICS Dxo with meta {"metrics": {...}}.

The persistor's model goes out as refs too (stored tensor by tensor); once every validation is
done, the submitted models' objects are deleted (not those the job's checkpoint names).
"""

from __future__ import annotations

import functools
import json
import os
import queue
import threading
from pathlib import PurePosixPath
from typing import Any

from fedhive.errors import InvalidArgument
from fedhive.fl.arguments import check_seconds, check_str
from fedhive.fl.components import ComponentError
from fedhive.fl.dxo import DataKind, Dxo, MetaKey
from fedhive.fl.persistors import ModelPersistor
from fedhive.fl.tasks import ClientTask, Task
from fedhive.fl.workflow import WorkflowContext
from fedhive.fl.workflows.base import BaseWorkflow, site_metrics

RESULTS_FILE = "cross_val_results.json"
_POLL_S = 0.5  # how often the control loop looks at the abort flag while it waits


class CrossSiteModelEval(BaseWorkflow):
    def __init__(self, submit_model_timeout: float = 600, validation_timeout: float = 6000,
                 submit_model_task_name: str = "submit_model",
                 validation_task_name: str = "validate",
                 participating_clients: list[str] | None = None, persistor_id: str = "",
                 cross_val_dir: str = "cross_site_val") -> None:
        super().__init__()
        self.submit_model_timeout = check_seconds(submit_model_timeout, "submit_model_timeout")
        self.validation_timeout = check_seconds(validation_timeout, "validation_timeout")
        self.submit_model_task_name = check_str(submit_model_task_name,
                                                "submit_model_task_name")
        self.validation_task_name = check_str(validation_task_name, "validation_task_name")
        if participating_clients is not None and not (
                isinstance(participating_clients, list) and participating_clients
                and all(isinstance(site, str) and site for site in participating_clients)):
            raise InvalidArgument("participating_clients must be a non-empty list of site "
                                  f"names, not {participating_clients!r}",
                                  field="participating_clients")
        self.participating_clients = participating_clients
        self.persistor_id = check_str(persistor_id, "persistor_id", empty=True)
        path = PurePosixPath(check_str(cross_val_dir, "cross_val_dir"))
        if path.is_absolute() or ".." in path.parts:
            raise InvalidArgument(f"cross_val_dir must be a relative folder inside the "
                                  f"workspace, not {cross_val_dir!r}", field="cross_val_dir")
        self.cross_val_dir = cross_val_dir
        self._results: dict[str, dict[str, Any]] = {}  # owner -> validator -> metrics
        self._lock = threading.Lock()

    def prepare(self, ctx: WorkflowContext) -> None:
        super().prepare(ctx)
        strangers = [site for site in self.participating_clients or [] if site not in ctx.sites]
        if strangers:
            raise ComponentError(f"workflow {self.name!r}: participating_clients names "
                                 f"{strangers[0]!r}, which is not a site of the job")
        self.persistor: ModelPersistor | None = (
            self.find("persistor_id", self.persistor_id, ModelPersistor)
            if self.persistor_id else None)

    def control_flow(self) -> None:
        active = self.active_sites()
        participants = [site for site in self.participating_clients or active if site in active]
        missing = sorted(set(self.participating_clients or []) - set(participants))
        if missing:
            self.ctx.log.warning("workflow.participants_gone", workflow=self.name, sites=missing)
        if not participants:
            raise self.fail("no participating site is left in the job")
        with self._lock:
            self._results = {}
        # Callbacks only queue events; this thread schedules the validate tasks.
        events: queue.Queue[tuple[str, Any]] = queue.Queue()
        open_tasks: set[str] = set()

        def done(task: Task) -> None:
            events.put(("done", task.id))

        submit = Task(self.submit_model_task_name, Dxo(DataKind.WEIGHTS, {}),
                      timeout=self.submit_model_timeout,
                      result_received_cb=functools.partial(self._on_model, events),
                      task_done_cb=done)
        open_tasks.add(submit.id)
        self.broadcast(submit, targets=participants, min_responses=len(participants))
        if self.persistor is not None:
            model = self.models.as_refs(self.persistor.load(self.ctx))
            events.put(("model", (f"SRV_{self.persistor_id}", model)))
        while open_tasks or not events.empty():
            if self.aborted:
                return
            try:
                kind, value = events.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if kind == "done":
                open_tasks.discard(value)
                continue
            owner, model = value
            task = self._validate_task(owner, model, done)
            targets = [site for site in participants if site in self.active_sites()]
            if not targets:
                self.ctx.log.warning("workflow.no_validators", workflow=self.name, owner=owner)
                continue
            open_tasks.add(task.id)
            self.broadcast(task, targets=targets, min_responses=len(targets))
        self._write()
        self.end_round()

    def _validate_task(self, owner: str, model: Dxo, done: Any) -> Task:
        with self._lock:
            self._results.setdefault(owner, {})
        data = Dxo(DataKind.WEIGHTS, dict(model.data), {MetaKey.MODEL_OWNER: owner})
        return Task(self.validation_task_name, data, timeout=self.validation_timeout,
                    result_received_cb=functools.partial(self._on_validation, owner),
                    task_done_cb=done)

    def _on_model(self, events: queue.Queue[tuple[str, Any]], client_task: ClientTask) -> None:
        site, result = client_task.site, client_task.result
        if result is None or not result.ok or result.dxo is None \
                or result.dxo.data_kind is not DataKind.WEIGHTS:
            why = (f"{result.return_code}: {result.error}" if result and not result.ok
                   else "no WEIGHTS data")
            self.ctx.log.warning("workflow.model_not_submitted", workflow=self.name, site=site,
                                 reason=why)
            return
        self.models.track(result.dxo)
        events.put(("model", (site, result.dxo)))

    def _on_validation(self, owner: str, client_task: ClientTask) -> None:
        site, result = client_task.site, client_task.result
        if result is not None and result.ok and result.dxo is not None:
            entry: dict[str, Any] = site_metrics(result.dxo)
        else:
            entry = {"error": f"{result.return_code}: {result.error}" if result else "no result"}
            self.ctx.log.warning("workflow.validation_failed", workflow=self.name, site=site,
                                 owner=owner, error=entry["error"])
        with self._lock:
            self._results.setdefault(owner, {})[site] = entry

    def _write(self) -> None:
        folder = self.ctx.workspace / self.cross_val_dir
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / RESULTS_FILE
        partial = folder / f".{RESULTS_FILE}.partial"
        with self._lock:
            partial.write_text(json.dumps(self._results, indent=2, sort_keys=True))
        os.replace(partial, path)
        self.ctx.log.info("workflow.cross_site_results", workflow=self.name, file=str(path),
                          models=len(self._results))
