"""Operation-driven jobs from the admin side (seed 004's "FL operation process engine").

An operation-driven job runs `OperationController` on its server: it has no training loop of
its own and runs, one at a time, the operations a caller asks for. The caller keeps the loop:

    with Session(address, token) as s:
        job = s.start_operation_job(Path("my_site_app"), sites=["site-1", "site-2"]).job_id
        model = {"w": np.zeros(3, np.float32)}
        for round_ in range(3):
            result = s.call_operation(job, "train", model, meta={"current_round": round_})
            model = result.data                      # the weighted average of the sites'
        s.end_operation_job(job)                     # the job ends FINISHED:COMPLETED

`operation_job` builds such a job (its `meta.json`, a server app with the controller and the
`operators`, the site app given); `OperationCall` runs one operation through the gateway:
the request goes with a caller-chosen op id, so a lost reply or a retry never runs it twice,
and is asked again until the result is in. Until `read_wait` seconds have passed the job may
still be starting (the gateway answers UNAVAILABLE); after that the call fails with what the
job is doing (seed 004's task_read_wait_time). `wait` bounds the whole call (None: as long as
the job runs).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhive.blobs import PresignedFetcher, TensorKind, inline_refs
from fedhive.errors import FailedPrecondition, RpcTimeout, Unavailable
from fedhive.fl.dxo import DataKind, Dxo, MetaKey, dxo_from_proto, dxo_to_proto
from fedhive.fl.operations import END
from fedhive.jobs.archive import write_zip
from fedhive.proto.v1 import operation_pb2
from fedhive.structs import dict_to_struct, struct_to_dict

CONTROLLER = "fedhive.fl.workflows.operations.OperationController"
SERVER_APP, SITE_APP = "server", "site"
INLINE_LIMIT = 6 * 1024 * 1024  # arrays an admin sends go inline, under gRPC's 8 MiB
POLL_MS = 10_000
_R = operation_pb2.OperationReply


def operation_job(site_app: Path, *, sites: list[str], name: str = "operations",
                  operators: Mapping[str, Any] | None = None,
                  components: list[dict[str, Any]] | None = None, min_clients: int | None = None,
                  resource_spec: Mapping[str, Any] | None = None, project: str = "",
                  task_wait_time: float | None = None,
                  extra_meta: Mapping[str, Any] | None = None) -> bytes:
    """The zip of an operation-driven job: `site_app` (a folder with config/ and custom/)
    deployed to `sites`, a server app running `OperationController` with `operators` and the
    `components` they name."""
    meta: dict[str, Any] = {"name": name, "deploy_map": {SERVER_APP: ["server"],
                                                         SITE_APP: list(sites)}}
    if min_clients is not None:
        meta["min_clients"] = min_clients
    if resource_spec:
        meta["resource_spec"] = dict(resource_spec)
    meta.update(extra_meta or {})
    server = {"format_version": 2,
              "workflows": [{"id": "controller", "path": CONTROLLER,
                             "args": {"project": project, "task_wait_time": task_wait_time}}],
              "operators": dict(operators or {}), "components": list(components or [])}
    members = [("meta.json", _text(meta)),
               (f"{SERVER_APP}/config/config_fed_server.json", _text(server))]
    members += [(f"{SITE_APP}/{path.relative_to(site_app).as_posix()}", path.read_bytes)
                for path in site_app.rglob("*")
                if path.is_file() and "__pycache__" not in path.parts]
    archive = write_zip(members)
    assert archive is not None  # no `out`: the bytes
    return archive


def _text(value: Any) -> Callable[[], bytes]:
    return lambda: json.dumps(value, indent=1).encode()


@dataclass
class OperationResult:
    """What one operation gave back. `dxo` is lazy (refs with presigned URLs) until
    `materialize`d; `weight` is what the result stands for (the sum of its sites' weights)."""

    op_id: str
    dxo: Dxo
    contributions: dict[str, Any] = field(default_factory=dict)

    @property
    def weight(self) -> float:
        value = self.dxo.meta.get(MetaKey.NUM_STEPS_CURRENT_ROUND, 0.0)
        return float(value) if isinstance(value, int | float) else 0.0

    @property
    def metrics(self) -> dict[str, Any]:
        value = self.dxo.meta.get(MetaKey.METRICS, {})
        return dict(value) if isinstance(value, dict) else {}

    @property
    def data(self) -> dict[str, Any]:
        """The result's arrays (read through their URLs, checksums verified)."""
        fetcher = PresignedFetcher()
        try:
            return dict(self.dxo.materialized(fetcher, kind=TensorKind.NUMPY).data)
        finally:
            fetcher.close()


def to_dxo(data: Dxo | Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> Dxo:
    """A Dxo as given, or WEIGHTS of these arrays with `meta`."""
    if isinstance(data, Dxo):
        return Dxo(data.data_kind, dict(data.data), {**data.meta, **(meta or {})})
    return Dxo(DataKind.WEIGHTS, dict(data), dict(meta or {}))


def request_for(job_id: str, task_name: str, dxo: Dxo, *, method: str = "",
                args: Mapping[str, Any] | None = None, op_id: str = "",
                ) -> operation_pb2.OperationRequest:
    request = operation_pb2.OperationRequest(
        job_id=job_id, op_id=op_id or str(uuid.uuid4()), task_name=task_name, method=method,
        args=dict_to_struct({k: v for k, v in (args or {}).items() if v is not None}),
        wait_ms=POLL_MS)
    dxo_to_proto(dxo, lambda arrays: inline_refs(arrays, limit=INLINE_LIMIT), into=request.data)
    return request


def end_request(job_id: str) -> operation_pb2.OperationRequest:
    """The operation that ends an operation-driven job (FINISHED:COMPLETED)."""
    return request_for(job_id, END, Dxo(DataKind.WEIGHTS), method=END)


def run_until_done(send: Callable[[operation_pb2.OperationRequest], _R],
                   request: operation_pb2.OperationRequest, *, read_wait: float = 10.0,
                   wait: float | None = None, alive: Callable[[], str] | None = None,
                   sleep: Callable[[float], None] = time.sleep) -> OperationResult:
    """Send `request` until its operation is done; FailedPrecondition when it failed, when the
    job did not take it within `read_wait` seconds, or when `wait` ran out. `alive()` (called
    while waiting) returns why the job can no longer answer ("" while it can)."""
    started = time.monotonic()
    accepted = False
    while True:
        try:
            reply = send(request)
        except (Unavailable, RpcTimeout) as err:
            reply = None
            if not accepted and time.monotonic() - started > read_wait:
                raise FailedPrecondition(f"operation {request.task_name!r} was not picked up "
                                         f"within {read_wait:g} s (task_read_wait_time): "
                                         f"{err.message}", field="job_id") from None
        if reply is not None:
            accepted = True
            if reply.state == _R.STATE_DONE:
                return OperationResult(request.op_id, dxo_from_proto(reply.result),
                                       struct_to_dict(reply.contributions))
            if reply.state == _R.STATE_FAILED:
                raise FailedPrecondition(f"operation {request.task_name!r} failed: "
                                         f"{reply.error}", field="op_id")
        if wait is not None and time.monotonic() - started > wait:
            raise FailedPrecondition(f"operation {request.task_name!r} did not finish within "
                                     f"{wait:g} s (task_wait_time)", field="op_id")
        why = _ended(alive)
        if why:
            raise FailedPrecondition(f"operation {request.task_name!r}: {why}", field="job_id")
        if reply is None:
            sleep(0.5)


def _ended(alive: Callable[[], str] | None) -> str:
    """`alive()`, a gateway that does not answer for a moment taken as "not ended"."""
    try:
        return alive() if alive is not None else ""
    except (Unavailable, RpcTimeout):
        return ""


def job_gone(job_id: str, status: str, reason: str) -> str:
    """Why a job in `status` can no longer run operations ("" when it can), worded as the
    gateway refuses an operation on it (whichever of the two a caller meets first)."""
    if status.startswith("FINISHED"):
        return f"job {job_id} is {status} ({reason})" if reason else f"job {job_id} is {status}"
    return ""

