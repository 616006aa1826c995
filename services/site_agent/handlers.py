"""The control queue's RPC handlers: decode the request, call the `SiteAgent`, encode the reply.

| request                   | reply                 |
| CheckResourcesRequest     | CheckResourcesReply   |
| CancelResourcesRequest    | CancelResourcesReply  |
| AllocateResourcesRequest  | AllocateResourcesReply|
| FreeResourcesRequest      | SiteJob               |
| DeployRequest             | SiteJob               |
| StartRequest              | SiteJob               |
| AbortRequest              | SiteJob               |
| ListSiteJobsRequest       | ListSiteJobsReply     |

User errors are `FedhiveError`s and travel back as typed errors (the bus does that).
`check_resources` is the one command whose effect is not keyed by the job: a redelivered check
(same message id) gets the first reply back instead of reserving twice.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from threading import Lock

import structlog
from google.protobuf.message import Message

from fedhive.bus import Delivery, Handler
from fedhive.proto.v1 import site_pb2
from fedhive.structs import dict_to_struct, struct_to_dict

from .agent import SiteAgent
from .records import JobRecord

ACCEPTS: tuple[type[Message], ...] = (
    site_pb2.CheckResourcesRequest,
    site_pb2.CancelResourcesRequest,
    site_pb2.AllocateResourcesRequest,
    site_pb2.FreeResourcesRequest,
    site_pb2.DeployRequest,
    site_pb2.StartRequest,
    site_pb2.AbortRequest,
    site_pb2.ListSiteJobsRequest,
)
_REMEMBERED_CHECKS = 1024
log = structlog.get_logger()


def site_job(record: JobRecord) -> site_pb2.SiteJob:
    message = site_pb2.SiteJob(
        job_id=record.job_id,
        state=record.state.value,
        pid=record.pid,
        app_name=record.app_name,
        reason=record.reason,
        updated_at_ms=record.updated_at_ms,
    )
    if record.allocation:
        message.allocation.CopyFrom(dict_to_struct(record.allocation))
    if record.exit_code is not None:
        message.exit_code = record.exit_code
    return message


class _CheckReplies:
    """The last few check replies by message id (bounded; a redelivery comes soon or never)."""

    def __init__(self) -> None:
        self._replies: OrderedDict[str, site_pb2.CheckResourcesReply] = OrderedDict()
        self._lock = Lock()

    def get(self, message_id: str | None) -> site_pb2.CheckResourcesReply | None:
        with self._lock:
            return self._replies.get(message_id) if message_id else None

    def put(self, message_id: str | None, reply: site_pb2.CheckResourcesReply) -> None:
        if not message_id:
            return
        with self._lock:
            self._replies[message_id] = reply
            while len(self._replies) > _REMEMBERED_CHECKS:
                self._replies.popitem(last=False)


def make_handler(agent: SiteAgent, on_contact: Callable[[], None]) -> Handler:
    """The handler for the site's control queue; `on_contact` runs for every request (it
    records the last server contact)."""
    checks = _CheckReplies()
    check_lock = Lock()

    def check(request: site_pb2.CheckResourcesRequest, delivery: Delivery) -> Message:
        with check_lock:  # a redelivery waits for the first delivery's reply
            reply = checks.get(delivery.message_id)
            if reply is None:
                result = agent.check_resources(request.job_id,
                                               struct_to_dict(request.requirement))
                reply = site_pb2.CheckResourcesReply(
                    ok=result.ok, token=result.token if result.ok else "", reason=result.reason
                )
                checks.put(delivery.message_id, reply)
            else:
                log.info("site_agent.check_redelivered", job_id=request.job_id,
                         message_id=delivery.message_id)
            return reply

    def handle(message: Message, delivery: Delivery) -> Message | None:
        on_contact()
        if isinstance(message, site_pb2.CheckResourcesRequest):
            return check(message, delivery)
        if isinstance(message, site_pb2.CancelResourcesRequest):
            return site_pb2.CancelResourcesReply(cancelled=agent.cancel_resources(message.token))
        if isinstance(message, site_pb2.AllocateResourcesRequest):
            record = agent.allocate(message.job_id, message.token)
            return site_pb2.AllocateResourcesReply(
                resources=dict_to_struct(record.allocation or {})
            )
        if isinstance(message, site_pb2.FreeResourcesRequest):
            freed = agent.free(message.job_id)  # None: never heard of; nothing held either
            return site_pb2.SiteJob(job_id=message.job_id) if freed is None else site_job(freed)
        if isinstance(message, site_pb2.DeployRequest):
            return site_job(agent.deploy(message.job_id, message.app_name, message.bundle_url,
                                         message.bundle_url_expires_at_ms))
        if isinstance(message, site_pb2.StartRequest):
            return site_job(agent.start(message.job_id))
        if isinstance(message, site_pb2.AbortRequest):
            return site_job(agent.abort(message.job_id, message.reason))
        if isinstance(message, site_pb2.ListSiteJobsRequest):
            return site_pb2.ListSiteJobsReply(jobs=[site_job(r) for r in agent.jobs()])
        raise AssertionError(f"unregistered type {type(message).__name__}")  # bus filters types

    return handle
