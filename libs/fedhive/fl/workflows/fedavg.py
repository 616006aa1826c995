"""FedAvg, in FLARE's model-controller style.

Each round: sample `num_clients` of the sites still in the job (all of them when fewer are
left, logged), send them the global model as an FLModel (`task_name`), average their results
as they arrive (weight: NUM_STEPS_CURRENT_ROUND; a FULL result replaces the model's arrays, a
DIFF one is added), report the round, save the model through the persistor and checkpoint it.
`stop_cond` ("accuracy >= 0.95": key, one of >= <= > < ==, number) is checked against the
round's sample-weighted site metrics and ends the workflow early once met; with `patience`,
so does that many rounds in a row without the key improving. A site's error result ends the
workflow (FLARE's model controller does the same); a site that leaves mid-round is no longer
waited for, and the round goes on with the results it got. A result whose data cannot be
read (a missing object, a checksum mismatch) is such an error; one of the wrong shape or dtype
for the global model is rejected (logged) and the round goes on.

The global model stays in S3 between rounds (refs; see `workflows.base`), the built-in
aggregators stream large results (`InTimeAccumulateWeightedAggregator`), and after each
round the objects no longer needed are deleted.
"""

from __future__ import annotations

import functools
import operator
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fedhive.errors import InvalidArgument
from fedhive.fl.aggregators import Aggregator, InTimeAccumulateWeightedAggregator
from fedhive.fl.arguments import check_int, check_seconds, check_str
from fedhive.fl.dxo import DataKind, Dxo
from fedhive.fl.model import FLModel, ParamsType
from fedhive.fl.persistors import ModelPersistor
from fedhive.fl.shareables import FullModelShareableGenerator
from fedhive.fl.tasks import ClientTask, CompletionStatus, Task
from fedhive.fl.workflow import WorkflowContext
from fedhive.fl.workflows.base import BaseWorkflow, site_metrics, steps_of, weighted_metrics

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq}


def parse_stop_cond(text: str) -> tuple[str, str, float]:
    """"accuracy >= 0.9" -> ("accuracy", ">=", 0.9); InvalidArgument naming stop_cond."""
    parts = text.split() if isinstance(text, str) else []
    try:
        key, op, value = parts
        if op not in _OPS:
            raise ValueError(op)
        return key, op, float(value)
    except ValueError:
        raise InvalidArgument(f"stop_cond must read '<metric> <op> <number>' with op one of "
                              f"{' '.join(_OPS)}, not {text!r}", field="stop_cond") from None


@dataclass
class _Round:
    number: int
    results: dict[str, tuple[dict[str, Any], float]] = field(default_factory=dict)
    fatal: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)


class FedAvg(BaseWorkflow):
    checkpoints = True

    def __init__(self, num_clients: int = 3, num_rounds: int = 5, start_round: int = 0,
                 persistor_id: str = "persistor", aggregator_id: str = "",
                 task_name: str = "train", train_timeout: float = 0,
                 stop_cond: str | None = None, patience: int | None = None) -> None:
        super().__init__()
        self.num_clients = check_int(num_clients, "num_clients", 1)
        self.num_rounds = check_int(num_rounds, "num_rounds")
        self.start_round = check_int(start_round, "start_round")
        self.persistor_id = check_str(persistor_id, "persistor_id", empty=True)
        self.aggregator_id = check_str(aggregator_id, "aggregator_id", empty=True)
        self.task_name = check_str(task_name, "task_name")
        self.train_timeout = check_seconds(train_timeout, "train_timeout")
        self.stop_cond = None if stop_cond is None else parse_stop_cond(stop_cond)
        self.patience = None if patience is None else check_int(patience, "patience", 1)
        if self.patience is not None and self.stop_cond is None:
            raise InvalidArgument("patience needs a stop_cond (its metric is what must "
                                  "improve)", field="patience")
        self._generator = FullModelShareableGenerator()
        self._random = random.Random()

    def prepare(self, ctx: WorkflowContext) -> None:
        super().prepare(ctx)
        self.persistor: ModelPersistor | None = (
            self.find("persistor_id", self.persistor_id, ModelPersistor)
            if self.persistor_id else None)
        # Without an aggregator: in-time weighted averages, one per kind a site may send.
        self.aggregators: dict[DataKind, Aggregator] = (
            {kind: InTimeAccumulateWeightedAggregator(expected_data_kind=kind)
             for kind in (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF)} if not self.aggregator_id
            else {DataKind.WEIGHTS: self.find("aggregator_id", self.aggregator_id, Aggregator)})
        self.bind(*self.aggregators.values(), self._generator)

    def control_flow(self) -> None:
        self.bind(*self.aggregators.values(), self._generator)
        total = self.start_round + self.num_rounds
        if self.persistor is None:
            self.ctx.log.warning("workflow.no_persistor", workflow=self.name)
        model, first = self.starting_point(self.persistor, self.start_round)
        best: float | None = None
        stale = 0
        for number in range(first, total):
            if self.aborted:
                return
            model, metrics = self._round(number, total, model)
            if self.stop_cond is None:
                continue
            key, op, target = self.stop_cond
            value = metrics.get(key)
            if value is None:
                self.ctx.log.warning("workflow.stop_metric_missing", workflow=self.name,
                                     round=number, metric=key)
                continue
            if _OPS[op](value, target):
                self.ctx.log.info("workflow.stopped_early", workflow=self.name, round=number,
                                  stop_cond=" ".join(map(str, self.stop_cond)), value=value)
                return
            if best is None or _better(op, value, best):
                best, stale = value, 0
            else:
                stale += 1
            if self.patience is not None and stale >= self.patience:
                self.ctx.log.info("workflow.stopped_no_improvement", workflow=self.name,
                                  round=number, patience=self.patience, best=best)
                return

    def sample_clients(self, num_clients: int) -> list[str]:
        sites = self.active_sites()
        if num_clients > len(sites):
            self.ctx.log.error("workflow.too_few_sites", workflow=self.name, wanted=num_clients,
                               available=len(sites))
            return sites
        return sorted(self._random.sample(sites, num_clients), key=sites.index)

    def _round(self, number: int, total: int, model: Dxo) -> tuple[Dxo, dict[str, float]]:
        clients = self.sample_clients(self.num_clients)
        if not clients:
            raise self.fail(f"round {number}: no site is left in the job")
        for aggregator in self.aggregators.values():
            aggregator.begin_round(number, model)
        state = _Round(number)
        data = FLModel(params=dict(model.data), params_type=ParamsType.FULL,
                       current_round=number, total_rounds=total).to_dxo()
        task = Task(self.task_name, data, timeout=self.train_timeout,
                    result_received_cb=functools.partial(self._on_result, state))
        self.ctx.log.info("workflow.round_started", workflow=self.name, round=number,
                          sites=clients)
        self.broadcast_and_wait(task, targets=clients, min_responses=len(clients))
        if self.aborted:
            return model, {}
        if state.fatal:
            raise self.fail(state.fatal)
        if not state.results:
            raise self.fail(f"round {number}: no result could be aggregated (task "
                            f"{task.completion_status})")
        for aggregator in self.aggregators.values():
            aggregate = aggregator.aggregate()
            for site, error in aggregator.failed.items():
                raise self.fail(f"round {number}: the result of {site} is bad ({error}); "
                                f"{self.name} exiting")
            if aggregate.data:
                model = self._generator.shareable_to_learnable(aggregate, model)
        model = self.models.as_refs(model)
        self.close_round(number, total, model, state.results, checkpoint=True,
                         persistor=self.persistor)
        return model, weighted_metrics(state.results)

    def _on_result(self, state: _Round, client_task: ClientTask) -> None:
        site = client_task.site
        result = client_task.result
        kind = result.dxo.data_kind if result is not None and result.dxo is not None else None
        aggregator = self.aggregators.get(kind or DataKind.WEIGHTS,
                                          self.aggregators[DataKind.WEIGHTS])
        dxo, error = self.result_of(client_task, materialize=not aggregator.accepts_lazy)
        accepted, reason = False, ""
        if dxo is not None:
            accepted, reason, error = self.accept(aggregator, site, dxo)
        if error:
            state.fatal = (f"round {state.number}: the result of {site} is bad ({error}); "
                           f"{self.name} exiting")
            self.cancel_task(client_task.task, CompletionStatus.ERROR)
            return
        assert dxo is not None
        if not accepted:
            self.ctx.log.warning("workflow.result_rejected", workflow=self.name,
                                 round=state.number, site=site, reason=reason)
            return
        with state.lock:
            state.results[site] = (site_metrics(dxo), steps_of(dxo))


def _better(op: str, value: float, best: float) -> bool:
    """Does `value` improve on `best`, for a condition that wants the metric `op` a target?"""
    return value < best if op in ("<", "<=") else value > best
