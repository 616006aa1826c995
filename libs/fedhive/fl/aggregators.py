"""Aggregators: what a workflow feeds each site's result to, and asks for the round's result.

    aggregator.bind(models)                                  # the job's ModelStore (prepare)
    aggregator.begin_round(3, global_model)                  # reset; results are checked
    ok, reason = aggregator.accept("site-1", result_dxo)     # against the global model
    aggregate = aggregator.aggregate()                       # the round's Dxo
    aggregator.failed                                        # {site: why} unreadable results

`accept` is called as results arrive (from the task manager's callbacks, so on several threads).
An aggregator with `accepts_lazy` takes results as the sites sent them (refs); the workflow
materializes results for one without. `accept` answers (False, reason) for a result it rejects
(wrong data kind, shape or dtype...) and raises a FedhiveError for one it cannot read (a missing
object, a checksum mismatch), which the workflow handles as that site's error.

Choice for large models: `InTimeAccumulateWeightedAggregator` itself streams (the name the
examples and FLARE configs use keeps working, with the same arguments and results), in two
modes chosen per result by its size:

* in time (results up to `in_time_mb`, default 16 MiB of stored tensors: small models): the
  result is read as it arrives and folded into running sums, so aggregation overlaps the wait
  for slower sites; the server holds the sums (at most the model) and one result at a time.
  Stored tensors are checksum verified; inline ones are added as the bytes that came (their
  label is checked only where something trusts it: pass-through, content keys);
* streamed (larger results): `accept` checks the refs' dtypes and shapes (no download) and
  keeps them; `aggregate` then builds the new global model tensor by tensor, `stream_workers`
  tensors at a time within `stream_memory_mb`: download each site's tensor (checksum
  verified), accumulate, store the new tensor at its content key, drop. The server holds a few
  tensors, never the model times the sites. A tensor every site sent unchanged (the same
  checksum: frozen layers) is taken as it is when one of them is the server's own object, read
  by no one (an inline one's few bytes are hashed first: nobody would read them later to catch
  a false label). The aggregate never names an object a site uploaded (a site can write its
  own keys, `fedhive.blobs.keys`): when every site sent the same content as uploads of their
  own, one of them is read (checksum verified) and stored as the server's.

A failure to read a site's object names the site that uploaded it.

A result whose data turns out unreadable while streaming is left out with its reason in
`failed` and the aggregate is computed again without it, so nothing it sent reaches the model.
"""

from __future__ import annotations

import abc
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np

from fedhive.blobs import TensorKind, TensorRef, checksum, content_key, inline_values
from fedhive.blobs.dtypes import bytes_to_torch
from fedhive.blobs.keys import uploaded_by
from fedhive.blobs.transfer import MiB
from fedhive.errors import FedhiveError, InvalidArgument
from fedhive.fl import arguments
from fedhive.fl.accumulation import Budget, Job, Part, SiteFailed, Stopped, Sum
from fedhive.fl.dxo import DataKind, Dxo, MetaKey
from fedhive.fl.model_store import (
    Array,
    ModelStore,
    ModelWriter,
    TensorSpec,
    from_compute,
    storage_of,
    to_compute,
)


class Aggregator(abc.ABC):
    accepts_lazy: ClassVar[bool] = False  # True: `accept` takes results whose data are refs
    models: ModelStore | None = None

    def bind(self, models: ModelStore) -> None:
        """The job's tensor store (called by the workflow before its first round); kept in
        `self.models`."""
        self.models = models

    def begin_round(self, round_: int, model: Dxo | None = None) -> None:
        """A new round whose global model is `model`: forget what was accepted."""
        self.reset()

    @property
    def failed(self) -> dict[str, str]:
        """Sites whose accepted result could not be read by `aggregate` -> why."""
        return {}

    @abc.abstractmethod
    def accept(self, site: str, dxo: Dxo) -> tuple[bool, str]:
        """Fold `site`'s result in; (False, the reason) when it is rejected."""

    @abc.abstractmethod
    def aggregate(self) -> Dxo:
        """The result of what was accepted since the last reset."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget what was accepted (a new round)."""


class InTimeAccumulateWeightedAggregator(Aggregator):
    """Weighted average of the accepted results (FLARE's), streamed for large models.

    A site's weight is `aggregation_weights[site]` (1.0 when not listed) times, with
    `weigh_by_local_iter`, its meta NUM_STEPS_CURRENT_ROUND (1.0 when missing). Each array is
    averaged over the sites that sent it; names matching `exclude_vars` (a regex) are left out.
    The aggregate has the expected kind: a WEIGHT_DIFF average stays a diff (the shareable
    generator adds it to the model) and each array keeps the dtype it arrived with; a tensor
    of the global model must come back with its shape and dtype.

    fedhive's arguments (see the module doc): `in_time_mb` (results up to this size are read
    and folded as they arrive), `stream_memory_mb` and `stream_workers` (how many bytes and
    tensors the streamed aggregation works on at once). Bound to no store (`bind`), it takes
    materialized results only and aggregates to arrays.
    """

    accepts_lazy = True

    def __init__(self, expected_data_kind: str = "WEIGHTS",
                 aggregation_weights: dict[str, float] | None = None,
                 exclude_vars: str | None = None, weigh_by_local_iter: bool = True,
                 in_time_mb: float = 16, stream_memory_mb: float = 64,
                 stream_workers: int = 4) -> None:
        self.expected_data_kind = arguments.check_kind(
            expected_data_kind, "expected_data_kind",
            (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF, DataKind.METRICS))
        self.aggregation_weights = arguments.check_weights(aggregation_weights,
                                                           "aggregation_weights")
        self._exclude = arguments.check_regex(exclude_vars, "exclude_vars")
        self.weigh_by_local_iter = arguments.check_flag(weigh_by_local_iter, "weigh_by_local_iter")
        self.in_time_bytes = int(arguments.check_number(in_time_mb, "in_time_mb", " of MiB") * MiB)
        self.stream_bytes = int(arguments.check_number(stream_memory_mb, "stream_memory_mb",
                                                       " of MiB") * MiB)
        self.stream_workers = arguments.check_int(stream_workers, "stream_workers", 1)
        self._round: int | None = None
        self._model_specs: dict[str, TensorSpec] = {}
        self._lock = threading.Lock()
        self._in_time = threading.Lock()  # one result read in time at once
        self.reset()

    def begin_round(self, round_: int, model: Dxo | None = None) -> None:
        self.reset()
        with self._lock:
            self._round = round_
            self._model_specs = {} if model is None else {
                name: TensorSpec.of(name, value) for name, value in model.data.items()}

    def reset(self) -> None:
        with self._lock:
            self._sums: dict[str, Sum] = {}
            self._parts: dict[str, list[Part]] = {}
            self._specs: dict[str, TensorSpec] = {}  # tensors not in the global model
            self._sites: list[str] = []
            self._claimed: set[str] = set()
            self._failed: dict[str, str] = {}
            self._result: Dxo | None = None

    def weight(self, site: str, dxo: Dxo) -> float:
        """`site`'s weight for `dxo`; InvalidArgument for a step count that is no number."""
        weight = float(self.aggregation_weights.get(site, 1.0))
        if not self.weigh_by_local_iter:
            return weight
        steps = dxo.meta.get(MetaKey.NUM_STEPS_CURRENT_ROUND, 1.0)
        return weight * arguments.check_number(steps, MetaKey.NUM_STEPS_CURRENT_ROUND)

    def where(self, site: str) -> str:
        """'job J round R site S': who a reason is about."""
        parts = [] if self.models is None else [f"job {self.models.job_id}"]
        if self._round is not None:
            parts.append(f"round {self._round}")
        return " ".join([*parts, f"site {site}"])

    def accept(self, site: str, dxo: Dxo) -> tuple[bool, str]:
        if dxo.is_lazy and self.models is None:
            raise InvalidArgument(f"the result of {site} must be materialized before it is "
                                  "aggregated (the aggregator is bound to no store)",
                                  field="data")
        if dxo.data_kind is not self.expected_data_kind:
            return False, (f"data kind {dxo.data_kind.value}, expected "
                           f"{self.expected_data_kind.value}")
        try:
            weight = self.weight(site, dxo)
        except InvalidArgument as err:
            return False, err.message
        if weight <= 0:
            return False, f"aggregation weight {weight} (must be > 0)"
        values = {name: value for name, value in dxo.data.items()
                  if not (self._exclude and self._exclude.search(name))}
        try:
            specs = {name: TensorSpec.of(name, value) for name, value in values.items()}
        except InvalidArgument as err:
            return False, f"{self.where(site)}: {err.message}"
        with self._lock:
            if site in self._claimed:
                return False, "this round already has a result from the site"
            problem = self._check(site, specs)
            if problem:
                return False, problem
            for name, spec in specs.items():
                if name not in self._model_specs:
                    self._specs.setdefault(name, spec)
            self._claimed.add(site)
        try:
            stored = sum(v.length for v in values.values()
                         if isinstance(v, TensorRef) and not v.is_inline)
            if self.models is None or stored <= self.in_time_bytes:
                self._fold(site, values, specs, weight)
            else:
                with self._lock:
                    for name, value in values.items():
                        self._parts.setdefault(name, []).append(Part(site, value, weight))
                    self._sites.append(site)
                    self._result = None
        except BaseException:
            with self._lock:
                self._claimed.discard(site)
            raise
        return True, ""

    def _check(self, site: str, specs: dict[str, TensorSpec]) -> str:
        """Under the lock: '' or why `site`'s tensors do not fit the global model (or, for a
        tensor the model lacks, the first site's)."""
        for name, spec in specs.items():
            expected = self._model_specs.get(name) or self._specs.get(name)
            if expected is not None and (mismatch := expected.mismatch(spec)):
                if name not in self._model_specs:
                    mismatch = mismatch.replace("the global model's is", "other sites sent")
                return f"{self.where(site)}: tensor {name!r} {mismatch}"
        return ""

    def _fold(self, site: str, values: dict[str, Any], specs: dict[str, TensorSpec],
              weight: float) -> None:
        """Read the whole result (one at a time), then add it to the sums at once: a result
        that cannot be read adds nothing."""
        weighted: dict[str, Array] = {}
        with self._in_time:
            for name, value in values.items():
                weighted[name] = self._weighted(site, name, value, specs[name], weight)
        with self._lock:
            for name, array in weighted.items():
                total = self._sums.get(name)
                if total is None:
                    self._sums[name] = Sum(array, weight)
                else:
                    total.values += array
                    total.weight += weight
            self._sites.append(site)
            self._result = None

    def _weighted(self, site: str, name: str, value: Any, spec: TensorSpec,
                  weight: float) -> Array:
        """`value` (a stored ref is read, checksum verified; an inline one's bytes are taken as
        they came, `inline_values`) times `weight`, in a buffer of its own."""
        try:
            if isinstance(value, TensorRef) and value.is_inline:
                storage, owned = inline_values(value), False
            elif isinstance(value, TensorRef):
                storage, owned = self._fetch(site, name, value), True
            else:
                storage, owned = storage_of(name, value)[0], False
        except FedhiveError as err:
            raise type(err)(f"{self.where(site)}: tensor {name!r}: {err.message}",
                            field=name) from err
        array = to_compute(storage, spec.dtype, owned=owned)
        del storage
        np.multiply(array, weight, out=array)
        return array

    def _fetch(self, site: str, name: str, ref: TensorRef) -> Array:
        """`ref`'s stored tensor, checksum verified; an error names the site that uploaded it."""
        assert self.models is not None
        try:
            return self.models.fetch(ref)
        except FedhiveError as err:
            raise type(err)(f"{err.message}{uploaded_by(ref.key)}", field=name) from err

    @property
    def sites(self) -> list[str]:
        """The sites accepted since the last reset and not failed, in order."""
        with self._lock:
            return [site for site in self._sites if site not in self._failed]

    @property
    def failed(self) -> dict[str, str]:
        with self._lock:
            return dict(self._failed)

    def aggregate(self) -> Dxo:
        with self._lock:
            if self._result is not None:
                return self._result
        while True:
            jobs = self._jobs()
            try:
                data = self._stream(jobs) if self.models is not None else self._in_memory(jobs)
                break
            except SiteFailed as failure:
                self._drop(failure.site, failure.reason)
        meta = {"aggregated_sites": self.sites}
        result = Dxo(self.expected_data_kind, data, meta)
        with self._lock:
            self._result = result
        return result

    def _jobs(self) -> list[Job]:
        """One job per tensor that has contributions: the global model's order first."""
        with self._lock:
            names = [n for n in self._model_specs if n in self._sums or n in self._parts]
            names += [n for n in self._specs if n not in self._model_specs
                      and (n in self._sums or n in self._parts)]
            return [Job(name, self._model_specs.get(name) or self._specs[name],
                         self._sums.get(name), list(self._parts.get(name, [])))
                    for name in names]

    def _drop(self, site: str, reason: str) -> None:
        with self._lock:
            self._failed[site] = reason
            for name in list(self._parts):
                self._parts[name] = [p for p in self._parts[name] if p.site != site]
                if not self._parts[name]:
                    del self._parts[name]
        if self.models is not None:
            self.models.log.warning("aggregator.result_unreadable", site=site,
                                     round=self._round, reason=reason)

    def _in_memory(self, jobs: list[Job]) -> dict[str, Any]:
        """Unbound: the averages as arrays of the kind and dtype the sites sent."""
        data: dict[str, Any] = {}
        for job in jobs:
            assert job.folded is not None and not job.parts
            stored = from_compute(job.folded.values / job.weight, job.spec.dtype)
            if job.spec.kind is TensorKind.TORCH:
                flat = np.ascontiguousarray(stored).reshape(-1).view(np.uint8)
                data[job.name] = bytes_to_torch(flat, job.spec.dtype, job.spec.shape)
            else:
                data[job.name] = stored
        return data

    def _stream(self, jobs: list[Job]) -> dict[str, Any]:
        """The new tensors, `stream_workers` at a time within the memory budget; raises
        SiteFailed for the first site whose tensor cannot be read (the others stop)."""
        assert self.models is not None
        writer = self.models.writer()
        stop = threading.Event()
        if not any(job.parts for job in jobs) and sum(
                job.spec.nbytes for job in jobs) <= self.models.inline_budget:
            # all folded as the results came and the model travels inline: nothing to read or
            # write, a thread pool would cost more than the work
            return {job.name: self._combine(job, writer, stop) for job in jobs}
        budget = Budget(self.stream_bytes)

        def work(job: Job) -> TensorRef | None:
            with budget.hold(job.need):
                if stop.is_set():
                    return None
                try:
                    return self._combine(job, writer, stop)
                except BaseException:
                    stop.set()
                    raise

        refs: dict[str, Any] = {}
        first: BaseException | None = None
        with ThreadPoolExecutor(max_workers=self.stream_workers,
                                thread_name_prefix="aggregate") as pool:
            futures: list[Future[TensorRef | None]] = [pool.submit(work, job) for job in jobs]
            for job, future in zip(jobs, futures, strict=True):
                try:
                    ref = future.result()
                except Stopped:
                    continue
                except BaseException as err:  # the first real failure wins; the rest stop
                    stop.set()
                    for waiting in futures:
                        waiting.cancel()
                    first = first or err
                    continue
                if ref is not None:
                    refs[job.name] = ref
        if first is not None:
            raise first
        return refs

    def _combine(self, job: Job, writer: ModelWriter, stop: threading.Event) -> TensorRef:
        """One tensor of the aggregate: the in-time sum plus each part, averaged, stored."""
        assert self.models is not None
        refs = [part.value for part in job.parts if isinstance(part.value, TensorRef)]
        if (job.folded is None and len(refs) == len(job.parts)
                and len({ref.checksum for ref in refs}) == 1
                and all(_labelled_truly(ref) for ref in refs)):
            return self._unchanged(job, refs, writer)
        if job.folded is None:
            total: Array | None = None
        else:
            total = job.folded.values.copy() if job.parts else job.folded.values / job.weight
        for part in job.parts:
            if stop.is_set():
                raise Stopped  # another tensor failed: this aggregate is discarded
            try:
                array = self._weighted(part.site, job.name, part.value, job.spec, part.weight)
            except FedhiveError as err:
                raise SiteFailed(part.site, err.message) from err
            if total is None:
                total = array
            else:
                total += array
            del array
        assert total is not None
        if job.parts:
            total /= job.weight
        stored = from_compute(total, job.spec.dtype)
        del total
        ref: TensorRef = writer.put(job.name, stored, dtype=job.spec.dtype, kind=job.spec.kind)
        return ref

    def _unchanged(self, job: Job, refs: list[TensorRef], writer: ModelWriter) -> TensorRef:
        """The tensor every site sent with the same content: inline or the server's object,
        unread, if one was sent so, else the first site's upload read (checksum verified) and
        stored as the server's (no site can write that)."""
        assert self.models is not None
        prefix = self.models.prefix
        own = next((ref for ref in refs if ref.is_inline or (
            ref.offset == 0 and ref.key == content_key(prefix, ref.checksum))), None)
        if own is not None:
            return replace(own, name=job.name, url="", url_expires_at_ms=0)
        part = job.parts[0]
        try:
            stored = self._fetch(part.site, job.name, refs[0])
        except FedhiveError as err:
            raise SiteFailed(part.site, f"{self.where(part.site)}: tensor {job.name!r}: "
                                        f"{err.message}") from err
        ref: TensorRef = writer.put(job.name, stored, dtype=job.spec.dtype, kind=job.spec.kind)
        return ref


def _labelled_truly(ref: TensorRef) -> bool:
    """Whether a ref passed through unread holds what its checksum says: a stored object is
    verified by whoever reads it (and the server's own holds what its key says); inline bytes
    are checked here (a site could otherwise label other bytes as the unchanged tensor, and
    they would become the aggregate's)."""
    if not ref.is_inline:
        return True
    return checksum.matches_data(ref.checksum, ref.inline_data, ref.name)


class CollectAggregator(Aggregator):
    """Keeps each site's result as it is (refs stay refs: nothing is read). `collected()` gives
    them per site; `aggregate()` gives one COLLECTION Dxo whose arrays are named
    `<site>/<name>` and whose meta["sites"] holds each site's data kind and meta."""

    accepts_lazy = True

    def __init__(self, expected_data_kind: str | None = None) -> None:
        self.expected_data_kind = None if expected_data_kind is None else arguments.check_kind(
            expected_data_kind, "expected_data_kind", tuple(DataKind))
        self._lock = threading.Lock()
        self._results: dict[str, Dxo] = {}

    def accept(self, site: str, dxo: Dxo) -> tuple[bool, str]:
        if self.expected_data_kind is not None and dxo.data_kind is not self.expected_data_kind:
            return False, (f"data kind {dxo.data_kind.value}, expected "
                           f"{self.expected_data_kind.value}")
        with self._lock:
            if site in self._results:
                return False, "this round already has a result from the site"
            self._results[site] = dxo
        return True, ""

    def collected(self) -> dict[str, Dxo]:
        with self._lock:
            return dict(self._results)

    def aggregate(self) -> Dxo:
        with self._lock:
            data = {f"{site}/{name}": value for site, dxo in self._results.items()
                    for name, value in dxo.data.items()}
            sites = {site: {"data_kind": dxo.data_kind.value, "meta": dict(dxo.meta)}
                     for site, dxo in self._results.items()}
        return Dxo(DataKind.COLLECTION, data, {"sites": sites})

    def reset(self) -> None:
        with self._lock:
            self._results = {}
