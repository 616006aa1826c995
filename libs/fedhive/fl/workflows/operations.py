"""OperationController: the workflow of an operation-driven job (seed 004's HubController).

It has no training loop of its own: it runs, one at a time, the operations its callers ask for
(`fedhive.fl.operations`: an admin's `Session.call_operation`, or the hub site of an upper tier
forwarding that tier's tasks) and hands each back its result:

* the operation is the caller's description overridden by the job's `operators` entry for the
  task (`fedhive.jobs.operators.resolve`, the `project`'s entry first);
* `bcast`: the task goes to the targets, each result is folded into the aggregator as it
  arrives, and the aggregate is the result, its meta `NUM_STEPS_CURRENT_ROUND` the sum of the
  weights folded in (so an upper tier weighs this system's aggregate as the sum of its sites:
  FedAvg over tiers equals FedAvg over the same sites flat); `relay`: the targets in turn, each
  given the previous result, the last result is the operation's;
* the task data's refs are the caller's (an upper tier's objects, with that tier's presigned
  URLs): they go to the sites untouched and are never re-signed, tracked or deleted here;
* each finished operation is a round of the job (`fedhive metrics`: who contributed what);
  the objects of the previous operation's result are deleted once the next one finished;
* a caller that copies the result up (`export`: a hub site) gets a bcast aggregate kept in
  files beside the workspace (`KeptModelStore`, deleted with the next operation's end or the
  job's) instead of this system's store: no one here reads it, so it is written once, read
  once by the export, never uploaded here;
* the method `end` completes the job (the caller's loop is over); so does nothing else:
  `task_wait_time` (seconds, default none) fails the job when no operation came for that long.

An operation that cannot be done (bad description, no result could be aggregated, every
target failed) fails alone, with its reason; the job goes on with the next.
"""

from __future__ import annotations

import functools
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhive.blobs import TensorRef
from fedhive.errors import FedhiveError, InvalidArgument, WorkflowFailed
from fedhive.fl.aggregators import Aggregator, InTimeAccumulateWeightedAggregator
from fedhive.fl.arguments import check_str
from fedhive.fl.components import ComponentError
from fedhive.fl.dxo import DataKind, Dxo, MetaKey
from fedhive.fl.model_store import KeptModelStore, ModelStore
from fedhive.fl.operations import END, Call, Operations
from fedhive.fl.persistors import ModelPersistor
from fedhive.fl.shareables import ShareableGenerator
from fedhive.fl.tasks import ClientTask, CompletionStatus, Task
from fedhive.fl.workflow import WorkflowContext
from fedhive.fl.workflows.base import BaseWorkflow, site_metrics, steps_of, weighted_metrics
from fedhive.jobs.operators import BCAST, COMPONENT_FIELDS, Operation, parse_operators, resolve

POLL_S = 0.2
_KINDS = {"aggregator": Aggregator, "shareable_generator": ShareableGenerator,
          "persistor": ModelPersistor}


@dataclass
class _Outcome:
    results: dict[str, tuple[dict[str, Any], float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    last: Dxo | None = None  # relay: the latest result
    lock: threading.Lock = field(default_factory=threading.Lock)

    def contributions(self) -> dict[str, Any]:
        table: dict[str, Any] = {site: {"weight": weight, "metrics": metrics}
                                 for site, (metrics, weight) in self.results.items()}
        table.update({site: {"error": why} for site, why in self.errors.items()})
        return table


class OperationController(BaseWorkflow):
    def __init__(self, project: str = "", task_wait_time: float | None = None) -> None:
        super().__init__()
        self.project = check_str(project, "project", empty=True)
        if task_wait_time is not None and (isinstance(task_wait_time, bool) or not isinstance(
                task_wait_time, int | float) or task_wait_time <= 0):
            raise InvalidArgument("task_wait_time must be a positive number of seconds or null",
                                  field="task_wait_time")
        self.task_wait_time = task_wait_time
        self._rounds = 0
        self._calls = 0
        self._kept: Path | None = None  # the latest result kept for export

    def prepare(self, ctx: WorkflowContext) -> None:
        super().prepare(ctx)
        try:
            self.operators = parse_operators(ctx.operators)
        except InvalidArgument as err:
            raise ComponentError(f"workflow {self.name!r}: {err.message}") from None
        for task, desc in self.operators.items():
            for name in COMPONENT_FIELDS:
                if desc.get(name):
                    self.find(f"operators.{task}.{name}", desc[name], _KINDS[name])
        self.inbox = Operations()
        ctx.operations = self.inbox
        self._kept_root = ctx.workspace.parent / "kept-results"  # not the job's result

    def run(self, ctx: WorkflowContext) -> None:
        try:
            super().run(ctx)
        finally:
            self.inbox.close("the job was aborted" if ctx.abort.is_set() else "the job ended")
            shutil.rmtree(self._kept_root, ignore_errors=True)

    def control_flow(self) -> None:
        idle_since = time.monotonic()
        while not self.aborted:
            call = self.inbox.next(POLL_S)
            if call is None:
                if self.task_wait_time and time.monotonic() - idle_since > self.task_wait_time:
                    reason = f"no operation came within task_wait_time ({self.task_wait_time:g} s)"
                    self.inbox.close(reason)
                    raise self.fail(reason)
                continue
            if call.method == END:
                self.inbox.close("the job was ended by its caller")
                self.inbox.finish(call, Dxo(_kind(call.data)), {})
                self.ctx.log.info("operation.end", op_id=call.op_id)
                return
            self._operate(call)
            idle_since = time.monotonic()

    # one operation ------------------------------------------------------------------------
    def _operate(self, call: Call) -> None:
        log = self.ctx.log.bind(op_id=call.op_id, task=call.task_name)
        try:
            op = resolve(call.task_name, {**call.args, "method": call.method}, self.operators,
                         self.project)
            targets = list(op.targets) if op.targets is not None else self.active_sites()
            if not targets:
                raise WorkflowFailed("no site is left in the job")
        except (FedhiveError, ComponentError) as err:
            log.warning("operation.refused", error=str(err))
            self.inbox.fail(call, str(err))
            return
        self.ctx.add_foreign(ref.key for ref in call.data.refs() if not ref.is_inline)
        log.info("operation.started", method=op.method, sites=targets)
        outcome = _Outcome()
        try:
            result = self._bcast(call, op, targets, outcome) if op.method == BCAST \
                else self._relay(call, op, targets, outcome)
        except (FedhiveError, ComponentError) as err:
            log.warning("operation.failed", error=str(err), errors=outcome.errors)
            self.inbox.fail(call, str(err), outcome.contributions())
            if call.kept is not None:
                shutil.rmtree(call.kept, ignore_errors=True)
            return
        self.inbox.finish(call, result, outcome.contributions())  # the caller waits for it
        log.info("operation.done", sites=sorted(outcome.results), errors=outcome.errors)
        self._keep(call.kept)
        # what earlier operations left, and this one's site results; a kept result is not in
        # the store: tracking its keys would only send deletes for objects that never existed
        self.end_round(*([] if call.kept is not None else [result]))
        self._report(call, outcome)

    def _bcast(self, call: Call, op: Operation, targets: list[str], outcome: _Outcome) -> Dxo:
        aggregator = self.find("aggregator", op.aggregator, Aggregator) if op.aggregator \
            else InTimeAccumulateWeightedAggregator(expected_data_kind=_averaged(call.data))
        models = self.models
        if call.export:
            self._calls += 1
            call.kept = self._kept_root / str(self._calls)
            models = KeptModelStore(self.models, call.kept)
        aggregator.bind(models)
        aggregator.begin_round(self._rounds, call.data)
        min_targets, wait = op.min_targets, op.wait_time_after_min_received
        if min_targets > len(targets):  # FLARE's rule: then wait for every target
            min_targets, wait = len(targets), 0.0
        task = Task(call.task_name, call.data, timeout=op.timeout,
                    result_received_cb=functools.partial(self._on_bcast, aggregator, outcome))
        self.broadcast_and_wait(task, targets=targets, min_responses=min_targets,
                                wait_time_after_min_received=wait)
        self._check_ended(task)
        aggregate = aggregator.aggregate()
        with outcome.lock:
            for site, why in aggregator.failed.items():
                outcome.results.pop(site, None)
                outcome.errors[site] = why
        if not outcome.results:
            raise WorkflowFailed(f"no result could be aggregated ({_why(task, outcome)})")
        model = self._packed(aggregate, models)
        model.meta.update(self._summary(outcome))
        return model

    def _on_bcast(self, aggregator: Aggregator, outcome: _Outcome, client_task: ClientTask,
                  ) -> None:
        site = client_task.site
        dxo, error = self.result_of(client_task, materialize=not aggregator.accepts_lazy)
        accepted, reason = False, ""
        if dxo is not None:
            accepted, reason, error = self.accept(aggregator, site, dxo)
        with outcome.lock:
            if error or not accepted:
                outcome.errors[site] = error or f"rejected: {reason}"
                return
            assert dxo is not None
            outcome.results[site] = (site_metrics(dxo), steps_of(dxo))

    def _relay(self, call: Call, op: Operation, targets: list[str], outcome: _Outcome) -> Dxo:
        generator = self.find("shareable_generator", op.shareable_generator,
                              ShareableGenerator) if op.shareable_generator else None
        if generator is not None:
            self.bind(generator)
        task = Task(call.task_name, call.data, timeout=op.timeout,
                    result_received_cb=functools.partial(self._on_relay, generator, outcome))
        self.relay_and_wait(task, targets, task_assignment_timeout=op.task_assignment_timeout,
                            dynamic_targets=op.targets is None)
        self._check_ended(task)
        if outcome.last is None:
            raise WorkflowFailed(f"no site returned a result ({_why(task, outcome)})")
        result = outcome.last
        result.meta.update(self._summary(outcome))
        return result

    def _on_relay(self, generator: ShareableGenerator | None, outcome: _Outcome,
                  client_task: ClientTask) -> None:
        site = client_task.site
        dxo, error = self.result_of(client_task)
        if dxo is None:
            with outcome.lock:
                outcome.errors[site] = error
            self.cancel_task(client_task.task, CompletionStatus.ERROR)
            return
        if generator is not None:
            previous = client_task.task.data
            dxo = generator.learnable_to_shareable(generator.shareable_to_learnable(dxo, previous))
        dxo.meta.update({k: v for k, v in client_task.task.data.meta.items()
                         if k in (MetaKey.CURRENT_ROUND, MetaKey.TOTAL_ROUNDS)})
        with outcome.lock:
            outcome.results[site] = (site_metrics(dxo), steps_of(dxo))
            outcome.last = dxo
        client_task.task.data = dxo  # the next target's turn carries it

    # helpers ------------------------------------------------------------------------------
    @staticmethod
    def _packed(dxo: Dxo, models: ModelStore) -> Dxo:
        """`dxo` with its arrays as refs, the way task data goes: small ones inline (no
        object to write, read back and copy up), the others stored as this job's objects."""
        writer = models.writer()
        return Dxo(dxo.data_kind, {
            name: value if isinstance(value, TensorRef) else writer.put(name, value)
            for name, value in dxo.data.items()}, dict(dxo.meta))

    def _keep(self, kept: Path | None) -> None:
        """Once an operation ended, only its kept result stays (the caller exports it before
        it asks for another)."""
        if self._kept is not None and self._kept != kept:
            shutil.rmtree(self._kept, ignore_errors=True)
        self._kept = kept

    def _check_ended(self, task: Task) -> None:
        if self.aborted:
            raise WorkflowFailed("the job was aborted")
        if task.completion_status is CompletionStatus.CLIENT_DEAD:
            raise WorkflowFailed(f"too few sites still responding (gone: "
                                 f"{sorted(self.ctx.gone_sites())})")

    def _summary(self, outcome: _Outcome) -> dict[str, Any]:
        """Meta of an operation's result: the weight it stands for and its sites' metrics."""
        with outcome.lock:
            results = dict(outcome.results)
        return {MetaKey.NUM_STEPS_CURRENT_ROUND: sum(w for _, w in results.values()),
                MetaKey.METRICS: weighted_metrics(results),
                "contributors": sorted(results)}

    def _report(self, call: Call, outcome: _Outcome) -> None:
        meta = call.data.meta
        number = meta.get(MetaKey.CURRENT_ROUND)
        total = meta.get(MetaKey.TOTAL_ROUNDS)
        self.report(int(number) if isinstance(number, int | float) else self._rounds,
                    int(total) if isinstance(total, int | float) else 0, dict(outcome.results))
        self._rounds += 1


def _kind(data: Dxo) -> DataKind:
    return data.data_kind


def _averaged(data: Dxo) -> str:
    """What the built-in aggregator expects back for this task data: its kind when it can be
    averaged, else WEIGHTS."""
    kind = data.data_kind
    return kind.value if kind in (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF, DataKind.METRICS) \
        else DataKind.WEIGHTS.value


def _why(task: Task, outcome: _Outcome) -> str:
    errors = "; ".join(f"{site}: {why}" for site, why in sorted(outcome.errors.items()))
    return errors or f"the task ended {task.completion_status}"


# FLARE's name for it (seed 004): a hub site's lower tier runs this controller.
HubController = OperationController
