"""ScatterAndGather: FLARE's classic FedAvg workflow, with FLARE's arguments and defaults.

Each round: broadcast the global model as the `train` task (targets: the sites still in the
job; done once `min_clients` answered and `wait_time_after_min_received` passed, or all did),
fold every result into the aggregator the moment it arrives, turn the aggregate into the new
global model through the shareable generator, report the round, persist the model every
`persist_every_n_rounds` rounds and after the last one, and checkpoint it to S3 every
`snapshot_every_n_rounds` rounds and after the last one (resume).

A site's error result: `ignore_result_error` True ignores it; False ends the workflow;
None ignores it while the round's targets less its failed sites still number `min_clients`.
A result whose data cannot be read (a missing object, a checksum mismatch: found when the
aggregator reads it, as it arrives or while it streams the aggregate) is such an error, with a
reason naming the job, round, site and tensor; nothing it sent reaches the model. A result the
aggregator rejects (wrong data kind, or a tensor of the wrong shape or dtype for the global
model) is logged with the reason, the round goes on. A site that leaves the job is no longer
waited for; fewer than `min_clients` sites left ends the workflow.

The global model stays in S3 between rounds (refs; see `workflows.base`): results reach the
aggregator as refs, and after each round the objects no longer needed are deleted.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

from fedhive.errors import InvalidArgument
from fedhive.fl.aggregators import Aggregator
from fedhive.fl.arguments import check_int, check_seconds, check_str
from fedhive.fl.dxo import Dxo, MetaKey
from fedhive.fl.persistors import ModelPersistor
from fedhive.fl.shareables import ShareableGenerator
from fedhive.fl.tasks import ClientTask, CompletionStatus, Task
from fedhive.fl.workflow import WorkflowContext
from fedhive.fl.workflows.base import BaseWorkflow, every_n, site_metrics, steps_of


@dataclass
class _Round:
    number: int
    targets: list[str]
    failed: dict[str, str] = field(default_factory=dict)
    results: dict[str, tuple[dict[str, Any], float]] = field(default_factory=dict)
    fatal: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)


class ScatterAndGather(BaseWorkflow):
    checkpoints = True

    def __init__(self, min_clients: int = 1000, num_rounds: int = 5, start_round: int = 0,
                 wait_time_after_min_received: float = 10, aggregator_id: str = "aggregator",
                 persistor_id: str = "", shareable_generator_id: str = "shareable_generator",
                 train_task_name: str = "train", train_timeout: float = 0,
                 ignore_result_error: bool | None = None,
                 allow_empty_global_weights: bool = False, task_check_period: float = 0.5,
                 persist_every_n_rounds: int = 1, snapshot_every_n_rounds: int = 1) -> None:
        super().__init__()
        self.min_clients = check_int(min_clients, "min_clients", 1)
        self.num_rounds = check_int(num_rounds, "num_rounds")
        self.start_round = check_int(start_round, "start_round")
        self.wait_time = check_seconds(wait_time_after_min_received,
                                       "wait_time_after_min_received")
        self.aggregator_id = check_str(aggregator_id, "aggregator_id")
        self.persistor_id = check_str(persistor_id, "persistor_id", empty=True)
        self.shareable_generator_id = check_str(shareable_generator_id,
                                                "shareable_generator_id")
        self.train_task_name = check_str(train_task_name, "train_task_name")
        self.train_timeout = check_seconds(train_timeout, "train_timeout")
        if ignore_result_error not in (None, True, False):
            raise InvalidArgument(f"ignore_result_error must be true, false or null, not "
                                  f"{ignore_result_error!r}", field="ignore_result_error")
        self.ignore_result_error = ignore_result_error
        if not isinstance(allow_empty_global_weights, bool):
            raise InvalidArgument("allow_empty_global_weights must be true or false",
                                  field="allow_empty_global_weights")
        self.allow_empty_global_weights = allow_empty_global_weights
        # Accepted for FLARE configs; the server job's task monitor sets the pace here.
        check_seconds(task_check_period, "task_check_period")
        self.persist_every_n_rounds = check_int(persist_every_n_rounds, "persist_every_n_rounds")
        self.snapshot_every_n_rounds = check_int(snapshot_every_n_rounds,
                                                 "snapshot_every_n_rounds")

    def prepare(self, ctx: WorkflowContext) -> None:
        super().prepare(ctx)
        self.min_sites("min_clients", self.min_clients)
        self.aggregator: Aggregator = self.find("aggregator_id", self.aggregator_id, Aggregator)
        self.generator: ShareableGenerator = self.find(
            "shareable_generator_id", self.shareable_generator_id, ShareableGenerator)
        self.persistor: ModelPersistor | None = (
            self.find("persistor_id", self.persistor_id, ModelPersistor)
            if self.persistor_id else None)
        self.bind(self.aggregator, self.generator)

    def control_flow(self) -> None:
        self.bind(self.aggregator, self.generator)
        total = self.start_round + self.num_rounds
        model, first = self.starting_point(self.persistor, self.start_round)
        if not model.data and not self.allow_empty_global_weights:
            raise self.fail("the initial global model is empty (persistor_id "
                            f"{self.persistor_id!r}); set allow_empty_global_weights to "
                            "start from no weights")
        for number in range(first, total):
            if self.aborted:
                return
            model = self._round(number, total, model)
        if first >= total and self.persistor is not None:  # resumed after the last round
            self.persistor.save(self.ctx, model, total - 1)

    def _round(self, number: int, total: int, model: Dxo) -> Dxo:
        targets = self.active_sites()
        if len(targets) < self.min_clients:
            raise self.fail(f"round {number}: {len(targets)} site(s) left in the job, "
                            f"min_clients is {self.min_clients}")
        self.aggregator.begin_round(number, model)
        state = _Round(number, targets)
        data = self.generator.learnable_to_shareable(model)
        data.meta.update({MetaKey.CURRENT_ROUND: number, MetaKey.TOTAL_ROUNDS: total})
        task = Task(self.train_task_name, data, timeout=self.train_timeout,
                    result_received_cb=functools.partial(self._on_result, state))
        self.ctx.log.info("workflow.round_started", workflow=self.name, round=number,
                          sites=targets)
        self.broadcast_and_wait(task, targets=targets, min_responses=self.min_clients,
                                wait_time_after_min_received=self.wait_time)
        if self.aborted:
            return model
        if state.fatal:
            raise self.fail(state.fatal)
        if task.completion_status is CompletionStatus.CLIENT_DEAD:
            raise self.fail(f"round {number}: fewer than min_clients ({self.min_clients}) "
                            f"sites still responding (gone: {sorted(self.ctx.gone_sites())})")
        if task.completion_status is CompletionStatus.ERROR:
            raise self.fail(f"round {number}: the {self.train_task_name} task ended in error")
        if state.results:
            aggregate = self.aggregator.aggregate()
            for site, error in self.aggregator.failed.items():
                with state.lock:
                    state.results.pop(site, None)
                if not self._error(state, site, error):
                    raise self.fail(state.fatal)
            if not self.generator.accepts_lazy:  # one of its own that cannot read refs
                aggregate, model = self.materialized(aggregate), self.materialized(model)
            model = self.models.as_refs(self.generator.shareable_to_learnable(aggregate, model))
        if not state.results:
            self.ctx.log.warning("workflow.round_without_results", workflow=self.name,
                                 round=number, status=str(task.completion_status))
        last = number == total - 1
        self.close_round(
            number, total, model, state.results,
            checkpoint=last or every_n(number, self.snapshot_every_n_rounds),
            persistor=self.persistor if last or every_n(number, self.persist_every_n_rounds)
            else None)
        return model

    def _error(self, state: _Round, site: str, error: str) -> bool:
        """Record `site`'s error result; False (and `state.fatal` set) when it ends the
        workflow, per `ignore_result_error` and `min_clients`."""
        with state.lock:
            state.failed[site] = error
            left = len(state.targets) - len(state.failed)
        if self.ignore_result_error or (self.ignore_result_error is None
                                        and left >= self.min_clients):
            self.ctx.log.warning("workflow.result_error_ignored", workflow=self.name,
                                 round=state.number, site=site, error=error)
            return True
        state.fatal = f"round {state.number}: the result of {site} is an error ({error})"
        return False

    def _on_result(self, state: _Round, client_task: ClientTask) -> None:
        site = client_task.site
        dxo, error = self.result_of(client_task, materialize=not self.aggregator.accepts_lazy)
        accepted, reason = False, ""
        if dxo is not None:
            accepted, reason, error = self.accept(self.aggregator, site, dxo)
        if error:
            if not self._error(state, site, error):
                self.cancel_task(client_task.task, CompletionStatus.ERROR)
            return
        if not accepted:
            self.ctx.log.warning("workflow.result_rejected", workflow=self.name,
                                 round=state.number, site=site, reason=reason)
            return
        assert dxo is not None
        with state.lock:
            state.results[site] = (site_metrics(dxo), steps_of(dxo))
