"""What the built-in workflows share: argument checks, results, per-round reports, the global
model kept as refs, checkpoints and resume, and deleting round objects.

The global model lives in S3 between rounds (a Dxo of refs to the job's content-addressed
tensor objects): the persistor's initial model is stored tensor by tensor, a resumed
checkpoint's refs are copied into this job (so it never depends on, nor deletes, the old
job's objects), aggregators and shareable generators are bound to the job's `ModelStore`
and write the new model tensor by tensor. After each round `end_round` deletes the objects
the round made or received that neither the new global model nor the job's checkpoint names
(the previous model, the sites' results), then gives freed memory back to the system.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

from fedhive.errors import FedhiveError, WorkflowFailed
from fedhive.fl.aggregators import Aggregator
from fedhive.fl.checkpoint import Checkpoint, checkpoint_keys, load_checkpoint, save_checkpoint
from fedhive.fl.components import ComponentError
from fedhive.fl.controller import Controller
from fedhive.fl.dxo import DataKind, Dxo, MetaKey
from fedhive.fl.model_store import ModelStore
from fedhive.fl.persistors import ModelPersistor
from fedhive.fl.shareables import ShareableGenerator
from fedhive.fl.tasks import ClientTask
from fedhive.fl.workflow import RoundReport, WorkflowContext, component
from fedhive.heap import release_memory


def weighted_metrics(results: dict[str, tuple[dict[str, Any], float]]) -> dict[str, float]:
    """{name: mean over the sites that report it, weighted by their sample counts}."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for metrics, weight in results.values():
        for name, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                sums[name] = sums.get(name, 0.0) + float(value) * weight
                weights[name] = weights.get(name, 0.0) + weight
    return {name: total / weights[name] for name, total in sums.items() if weights[name] > 0}


def steps_of(dxo: Dxo) -> float:
    """A result's sample weight: its NUM_STEPS_CURRENT_ROUND, 1 when it has none."""
    steps = dxo.meta.get(MetaKey.NUM_STEPS_CURRENT_ROUND, 1.0)
    if isinstance(steps, int | float) and not isinstance(steps, bool) and steps >= 0:
        return float(steps)
    return 1.0


def site_metrics(dxo: Dxo) -> dict[str, Any]:
    metrics = dxo.meta.get(MetaKey.METRICS)
    return dict(metrics) if isinstance(metrics, dict) else {}


RELEASE_MEMORY_FROM = 64 * 1024 * 1024  # stored model bytes from which a round ends with gc


class BaseWorkflow(Controller):
    """A Controller with the helpers the built-in workflows use; `self.ctx` is set by
    `prepare` (and again by `run`)."""

    checkpoints: ClassVar[bool] = False  # writes a checkpoint after rounds, resumes from one
    _closer: ThreadPoolExecutor | None = None  # a round's writes (close_round)
    _closing: Future[None] | None = None

    @property
    def name(self) -> str:
        return type(self).__name__

    def prepare(self, ctx: WorkflowContext) -> None:
        self.ctx = ctx
        if ctx.store is None or ctx.codec is None or ctx.names is None:
            raise ComponentError(f"workflow {self.name!r}: the server job gave it no blob "
                                 "store, codec or names")
        self.models = ModelStore.of(ctx)

    def run(self, ctx: WorkflowContext) -> None:
        """Controller.run and the last round's writes; then, whether the workflow completed,
        failed or was aborted, the round objects its checkpoint does not name are deleted
        (what a resumed job needs is the checkpoint; the final model is the last one
        checkpointed, and the persistor's copy is in the result)."""
        try:
            super().run(ctx)
        except BaseException:
            self._closing_done(failed=True)  # the workflow's own error is the one to raise
            self._discard()
            raise
        try:
            self._closing_done()
        finally:
            self._discard()

    def _discard(self) -> None:
        models = getattr(self, "models", None)
        if models is None:
            return
        try:
            models.collect([], protect=checkpoint_keys(self.ctx))
        except FedhiveError as err:  # leftovers cost space, not correctness
            self.ctx.log.warning("workflow.cleanup_failed", workflow=self.name, error=str(err))

    def find(self, field: str, cid: str, kind: type) -> Any:
        """The component `cid` named by `field`, checked to be a `kind` (ComponentError)."""
        return component(self.ctx, self.name, field, cid, kind)

    def bind(self, *parts: Aggregator | ShareableGenerator | None) -> None:
        """Give aggregators and generators this workflow's ModelStore (again at each run: a
        component two workflows share works for the one running)."""
        for part in parts:
            if part is not None:
                part.bind(self.models)

    def min_sites(self, field: str, value: int) -> None:
        if value > len(self.ctx.sites):
            raise ComponentError(f"workflow {self.name!r}: {field} is {value} but the job has "
                                 f"{len(self.ctx.sites)} site(s)")

    def materialized(self, dxo: Dxo) -> Dxo:
        """A result with its arrays read (checksums verified) with the server's credentials."""
        assert self.ctx.store is not None  # checked by prepare
        return dxo.materialized(self.ctx.store) if dxo.is_lazy else dxo

    def result_of(self, client_task: ClientTask, *, materialize: bool = False,
                  ) -> tuple[Dxo | None, str]:
        """A site's result (lazy: refs; read when `materialize`), or (None, why it is an
        error). The objects it names are tracked: deleted after the round unless the new
        model keeps them."""
        result = client_task.result
        if result is None:
            return None, "no result"
        if not result.ok:
            return None, f"{result.return_code}: {result.error}".rstrip(": ")
        if result.dxo is None:
            return None, "the result carries no data"
        self.models.track(result.dxo)
        if not materialize:
            return result.dxo, ""
        try:
            return self.materialized(result.dxo), ""
        except FedhiveError as err:
            return None, f"its data cannot be read: {err}"

    def accept(self, aggregator: Aggregator, site: str, dxo: Dxo) -> tuple[bool, str, str]:
        """(accepted, why rejected, why unreadable): `aggregator.accept` with a result whose
        data cannot be read (a missing object, a checksum mismatch) told apart, as an error."""
        try:
            accepted, reason = aggregator.accept(site, dxo)
        except FedhiveError as err:
            return False, "", f"its data cannot be read: {err}"
        return accepted, reason, ""

    def report(self, round_: int, num_rounds: int,
               results: dict[str, tuple[dict[str, Any], float]]) -> None:
        metrics = {"sites": {site: metrics for site, (metrics, _) in results.items()},
                   "aggregate": weighted_metrics(results)}
        if self.ctx.report_round is not None:
            self.ctx.report_round(RoundReport(self.name, round_, num_rounds, metrics))

    def checkpoint(self, round_: int, num_rounds: int, model: Dxo) -> None:
        save_checkpoint(self.ctx, Checkpoint(self.name, round_, num_rounds, model))

    def close_round(self, number: int, total: int, model: Dxo,
                    results: dict[str, tuple[dict[str, Any], float]], *, checkpoint: bool,
                    persistor: ModelPersistor | None) -> None:
        """After round `number` made `model`: delete the round objects nothing needs, then
        write the checkpoint, the round report and the persisted model while the next round
        runs (they took a third of a small model's round). One round's writes at a time, in
        order: the next close waits for them first, so `end_round` always sees the last
        checkpoint written, and `model`'s objects outlive the writes that read them. A failed
        write fails the workflow at the next close or at its end."""
        self.await_closed()
        self.end_round(model)
        results = dict(results)

        def writes() -> None:
            if checkpoint:
                self.checkpoint(number, total, model)
            self.report(number, total, results)
            if persistor is not None:
                persistor.save(self.ctx, model, number)

        if self._closer is None:
            self._closer = ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-close")
        self._closing = self._closer.submit(writes)

    def await_closed(self) -> None:
        """Wait for the last round's writes; raises what they raised."""
        closing, self._closing = self._closing, None
        if closing is not None:
            closing.result()

    def _closing_done(self, *, failed: bool = False) -> None:
        try:
            self.await_closed()
        except Exception as err:
            if not failed:
                raise
            self.ctx.log.warning("workflow.round_writes_failed", workflow=self.name,
                                 error=str(err))
        finally:
            if self._closer is not None:
                self._closer.shutdown()
                self._closer = None

    def end_round(self, *live: Dxo) -> None:
        """After a round: delete the round objects that neither `live` (the global model) nor
        the job's checkpoint names; give freed memory back when the model is large (a full
        garbage collection costs tens of ms, most of a small model's round)."""
        self.models.track(*live)
        self.models.collect(live, protect=checkpoint_keys(self.ctx))
        stored = sum(ref.length for dxo in live for ref in dxo.refs() if ref.key)
        if stored >= RELEASE_MEMORY_FROM:
            release_memory()

    def resumed(self) -> Checkpoint | None:
        """The checkpoint of `ctx.resume_from` when it is this workflow's, else None (logged):
        the job then starts at the round after it, with its model."""
        old = self.ctx.resume_from
        if not old or not self.checkpoints:
            return None
        checkpoint = load_checkpoint(self.ctx, old)
        if checkpoint is None:
            self.ctx.log.warning("workflow.resume_no_checkpoint", workflow=self.name, job=old)
            return None
        if checkpoint.workflow != self.name:
            self.ctx.log.warning("workflow.resume_other_workflow", workflow=self.name, job=old,
                                 checkpoint_workflow=checkpoint.workflow)
            return None
        self.ctx.log.info("workflow.resumed", workflow=self.name, job=old,
                          last_round=checkpoint.round_)
        return checkpoint

    def starting_point(self, persistor: ModelPersistor | None,
                       start_round: int) -> tuple[Dxo, int]:
        """The global model (refs of this job) and first round: the resumed checkpoint's model
        and the round after it, else the persistor's initial model (empty without one) and
        `start_round`."""
        checkpoint = self.resumed()
        if checkpoint is not None:
            return self.models.as_refs(checkpoint.model), checkpoint.round_ + 1
        if persistor is None:
            return Dxo(DataKind.WEIGHTS, {}), start_round
        return self.models.as_refs(persistor.load(self.ctx)), start_round

    def fail(self, message: str) -> WorkflowFailed:
        self.ctx.log.error("workflow.failed", workflow=self.name, reason=message)
        return WorkflowFailed(f"{self.name}: {message}")


def every_n(number: int, n: int) -> bool:
    """Is round `number` (0-based) one of every `n` (0: never)?"""
    return n > 0 and (number + 1) % n == 0
