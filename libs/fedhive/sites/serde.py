"""Heartbeats to and from protobuf (`fedhive.v1.SiteHeartbeat`, `fedhive.v1.JobHeartbeat`)."""

from __future__ import annotations

from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct

from fedhive.proto.v1 import site_pb2
from fedhive.sites.heartbeat import JobHeartbeat, SiteHeartbeat


def site_heartbeat_to_proto(beat: SiteHeartbeat) -> site_pb2.SiteHeartbeat:
    resources = Struct()
    resources.update(beat.resources)
    return site_pb2.SiteHeartbeat(
        site=beat.site,
        org=beat.org,
        running_job_ids=beat.running_job_ids,
        resources=resources,
        agent_version=beat.agent_version,
        sent_at_ms=beat.sent_at_ms,
    )


def site_heartbeat_from_proto(msg: site_pb2.SiteHeartbeat) -> SiteHeartbeat:
    return SiteHeartbeat(
        site=msg.site,
        org=msg.org,
        sent_at_ms=msg.sent_at_ms,
        running_job_ids=list(msg.running_job_ids),
        resources=MessageToDict(msg.resources),
        agent_version=msg.agent_version,
    )


def job_heartbeat_to_proto(beat: JobHeartbeat) -> site_pb2.JobHeartbeat:
    return site_pb2.JobHeartbeat(
        job_id=beat.job_id,
        site=beat.site,
        current_task=beat.current_task,
        progress=beat.progress,
        sent_at_ms=beat.sent_at_ms,
    )


def job_heartbeat_from_proto(msg: site_pb2.JobHeartbeat) -> JobHeartbeat:
    return JobHeartbeat(
        job_id=msg.job_id,
        site=msg.site,
        sent_at_ms=msg.sent_at_ms,
        current_task=msg.current_task,
        progress=msg.progress,
    )
