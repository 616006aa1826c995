"""Cyclic: the model travels from site to site (FLARE's CyclicController).

Each round relays the `task_name` task over the sites still in the job, in `order`: "FIXED" (the
job's site order), "RANDOM" (shuffled each round), "RANDOM_WITHOUT_SAME_IN_A_ROW" (shuffled,
never starting with the site that ended the previous round) or a list of site names (each must
still be in the job). A site's result becomes the next site's task data: a full model is
forwarded within the round as the refs the site sent, unread; at the end of the round the
model's site uploads are read once and stored as the server's (`ModelStore.adopt`: the global
model never names a site's object); a WEIGHT_DIFF is read and added to the model. A site that
does not take its turn within `task_assignment_timeout` seconds is passed over. A site's error
result ends the workflow, as does EARLY_TERMINATION unless `allow_early_termination` (then it
stops after the round, model persisted). The model is persisted every `persist_every_n_rounds`
rounds and at the end, and checkpointed every `snapshot_every_n_rounds` rounds and at the end. A
result of the wrong shape or dtype for the model ends the workflow like an error result.

The model stays in S3 (refs; see `workflows.base`): a WEIGHT_DIFF is added tensor by tensor,
the persistor writes the file tensor by tensor, and after each round the objects no longer
needed (the previous sites' models) are deleted.
"""

from __future__ import annotations

import functools
import random
import threading
from dataclasses import dataclass, field
from typing import Any

from fedhive.errors import FedhiveError, InvalidArgument
from fedhive.fl.arguments import check_int, check_seconds, check_str
from fedhive.fl.components import ComponentError
from fedhive.fl.dxo import DataKind, Dxo, MetaKey
from fedhive.fl.persistors import ModelPersistor
from fedhive.fl.shareables import ShareableGenerator
from fedhive.fl.tasks import ClientTask, CompletionStatus, ReturnCode, Task
from fedhive.fl.workflow import WorkflowContext
from fedhive.fl.workflows.base import BaseWorkflow, every_n, site_metrics, steps_of

ORDERS = ("FIXED", "RANDOM", "RANDOM_WITHOUT_SAME_IN_A_ROW")


@dataclass
class _Round:
    number: int
    total: int
    model: Dxo  # the latest model: refs of the last site's result, or arrays
    results: dict[str, tuple[dict[str, Any], float]] = field(default_factory=dict)
    fatal: str = ""
    stop: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class Cyclic(BaseWorkflow):
    checkpoints = True

    def __init__(self, num_rounds: int = 5, task_assignment_timeout: float = 10,
                 persistor_id: str = "persistor",
                 shareable_generator_id: str = "shareable_generator", task_name: str = "train",
                 persist_every_n_rounds: int = 1, snapshot_every_n_rounds: int = 1,
                 order: str | list[str] = "FIXED", allow_early_termination: bool = False) -> None:
        super().__init__()
        self.num_rounds = check_int(num_rounds, "num_rounds")
        self.task_assignment_timeout = check_seconds(task_assignment_timeout,
                                                     "task_assignment_timeout")
        self.persistor_id = check_str(persistor_id, "persistor_id")
        self.shareable_generator_id = check_str(shareable_generator_id,
                                                "shareable_generator_id")
        self.task_name = check_str(task_name, "task_name")
        self.persist_every_n_rounds = check_int(persist_every_n_rounds, "persist_every_n_rounds")
        self.snapshot_every_n_rounds = check_int(snapshot_every_n_rounds,
                                                 "snapshot_every_n_rounds")
        if not (order in ORDERS or (isinstance(order, list) and order and all(
                isinstance(site, str) and site for site in order))):
            raise InvalidArgument(f"order must be one of {', '.join(ORDERS)} or a list of site "
                                  f"names, not {order!r}", field="order")
        self.order = order
        if not isinstance(allow_early_termination, bool):
            raise InvalidArgument("allow_early_termination must be true or false",
                                  field="allow_early_termination")
        self.allow_early_termination = allow_early_termination
        self._random = random.Random()
        self._last = ""  # the site that ended the previous round

    def prepare(self, ctx: WorkflowContext) -> None:
        super().prepare(ctx)
        if len(ctx.sites) < 2:
            raise ComponentError(f"workflow {self.name!r}: Not enough client sites.")
        if isinstance(self.order, list):
            strangers = [site for site in self.order if site not in ctx.sites]
            if strangers:
                raise ComponentError(f"workflow {self.name!r}: order names {strangers[0]!r}, "
                                     "which is not a site of the job")
        self.persistor: ModelPersistor = self.find("persistor_id", self.persistor_id,
                                                   ModelPersistor)
        self.generator: ShareableGenerator = self.find(
            "shareable_generator_id", self.shareable_generator_id, ShareableGenerator)
        self.bind(self.generator)

    def control_flow(self) -> None:
        self.bind(self.generator)
        model, first = self.starting_point(self.persistor, 0)
        number = first - 1
        for number in range(first, self.num_rounds):
            if self.aborted:
                return
            state = self._round(number, model)
            if self.aborted:
                return
            model = self.models.as_refs(state.model)
            last = number == self.num_rounds - 1 or state.stop
            self.close_round(
                number, self.num_rounds, model, state.results,
                checkpoint=last or every_n(number, self.snapshot_every_n_rounds),
                persistor=self.persistor if last or every_n(number, self.persist_every_n_rounds)
                else None)
            if state.stop:
                return
        if first >= self.num_rounds:  # resumed after the last round
            self.persistor.save(self.ctx, model, number)

    def targets(self) -> list[str]:
        active = self.active_sites()
        if len(active) < 2:
            raise self.fail(f"Not enough active client sites ({len(active)}).")
        if isinstance(self.order, list):
            for site in self.order:
                if site not in active:
                    raise self.fail(f"Required client site ({site}) is not in active clients.")
            return list(self.order)
        if self.order == "FIXED":
            return active
        self._random.shuffle(active)
        if self.order == "RANDOM_WITHOUT_SAME_IN_A_ROW" and active[0] == self._last:
            swap = self._random.randrange(1, len(active))
            active[0], active[swap] = active[swap], active[0]
        return active

    def _round(self, number: int, model: Dxo) -> _Round:
        targets = self.targets()
        state = _Round(number, self.num_rounds, model)
        task = Task(self.task_name, self._task_data(state),
                    result_received_cb=functools.partial(self._on_result, state))
        self.ctx.log.info("workflow.round_started", workflow=self.name, round=number,
                          sites=targets)
        self.relay_and_wait(task, targets, task_assignment_timeout=self.task_assignment_timeout,
                            dynamic_targets=False)
        if self.aborted:
            return state
        if state.fatal:
            raise self.fail(state.fatal)
        if task.completion_status in (CompletionStatus.CLIENT_DEAD, CompletionStatus.ERROR):
            raise self.fail(f"round {number}: the relay ended {task.completion_status.value}")
        if not state.results:
            self.ctx.log.warning("workflow.round_without_results", workflow=self.name,
                                 round=number, status=str(task.completion_status))
        self._last = task.client_tasks[-1].site if task.client_tasks else self._last
        return state

    def _task_data(self, state: _Round) -> Dxo:
        data = self.generator.learnable_to_shareable(state.model)
        data.meta.update({MetaKey.CURRENT_ROUND: state.number,
                          MetaKey.TOTAL_ROUNDS: state.total})
        return data

    def _on_result(self, state: _Round, client_task: ClientTask) -> None:
        site, result = client_task.site, client_task.result
        if result is not None and result.return_code == ReturnCode.EARLY_TERMINATION \
                and self.allow_early_termination:
            self.ctx.log.info("workflow.early_termination", workflow=self.name,
                              round=state.number, site=site)
            state.stop = True
            self.cancel_task(client_task.task)
            return
        if result is None or not result.ok or result.dxo is None:
            why = "no data" if result is not None and result.ok else (
                f"{result.return_code}: {result.error}" if result else "no result")
            state.fatal = (f"Result from {site} is bad ({why}). {self.name} exiting at round "
                           f"{state.number}.")
            self.cancel_task(client_task.task, CompletionStatus.ERROR)
            return
        dxo = result.dxo
        self.models.track(dxo)
        try:
            if not self.generator.accepts_lazy and dxo.data_kind is DataKind.WEIGHT_DIFF:
                # a generator of its own that cannot read refs: give it arrays
                dxo, state.model = self.materialized(dxo), self.materialized(state.model)
            state.model = self.generator.shareable_to_learnable(dxo, state.model)
        except FedhiveError as err:
            state.fatal = (f"Result from {site} cannot update the model ({err}). {self.name} "
                           f"exiting at round {state.number}.")
            self.cancel_task(client_task.task, CompletionStatus.ERROR)
            return
        # The next site's turn carries this model (FLARE's cyclic relay does the same).
        client_task.task.data = self._task_data(state)
        with state.lock:
            state.results[site] = (site_metrics(dxo), steps_of(dxo))
