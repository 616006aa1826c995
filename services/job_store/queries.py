"""Read-only requests: list jobs, get one job, a job's per-round metrics, list sites."""

from __future__ import annotations

from dataclasses import dataclass

from fedhive.bus import Delivery
from fedhive.errors import InvalidArgument
from fedhive.jobs.limits import DEFAULT_LIST_LIMIT, MAX_FILTER, check_list_limit, check_text
from fedhive.jobs.metrics import round_from_dict, round_to_proto
from fedhive.jobs.record import JobRecord
from fedhive.jobs.serde import status_from_proto
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import admin_pb2, job_pb2, site_pb2
from fedhive.sites.serde import site_heartbeat_to_proto
from fedhive.state import JobStore

from .context import JobStoreContext, lookup_job
from .replies import list_reply, record_reply

BATCH = 200  # job ids read from the index, and records fetched, per round trip


@dataclass(frozen=True)
class JobFilter:
    """`ListJobsRequest` as a predicate; every part is optional and they combine with AND."""

    statuses: frozenset[JobStatus] = frozenset()
    name: str = ""  # lower-cased substring of the name
    submitter: str = ""
    id_prefix: str = ""  # lower-cased

    def matches(self, record: JobRecord) -> bool:
        return (
            (not self.statuses or record.status in self.statuses)
            and self.name in record.meta.name.lower()
            and (not self.submitter or record.submitter.name == self.submitter)
            and record.job_id.lower().startswith(self.id_prefix)
        )


def job_filter(request: admin_pb2.ListJobsRequest) -> JobFilter:
    statuses = set()
    for value in request.statuses:
        status = status_from_proto(value)
        if status is None:
            raise InvalidArgument("statuses contains JOB_STATUS_UNSPECIFIED", field="statuses")
        statuses.add(status)
    return JobFilter(
        statuses=frozenset(statuses),
        name=check_text(request.name, "name", MAX_FILTER).lower(),
        submitter=check_text(request.submitter, "submitter", MAX_FILTER),
        id_prefix=check_text(request.id_prefix, "id_prefix", MAX_FILTER).lower(),
    )


def page_size(limit: int) -> int:
    return check_list_limit(limit) or DEFAULT_LIST_LIMIT


def find_jobs(state: JobStore, wanted: JobFilter, limit: int) -> list[JobRecord]:
    """Up to `limit` matching jobs, newest first, reading the newest-first index in batches.

    A single wanted status walks that status's index; otherwise the submission index. Ids are
    pre-filtered by `id_prefix` before their records are fetched. A job submitted while the
    walk runs shifts the pages by one; `seen` keeps it from being listed twice.
    """
    index = next(iter(wanted.statuses)) if len(wanted.statuses) == 1 else None
    found: list[JobRecord] = []
    seen: set[str] = set()
    start = 0
    while len(found) < limit:
        ids = state.recent_job_ids(index, start=start, count=BATCH)
        if not ids:
            break
        start += len(ids)
        fresh = [i for i in ids if i not in seen and i.lower().startswith(wanted.id_prefix)]
        seen.update(fresh)
        found += [r for r in state.get_jobs(fresh) if wanted.matches(r)]
    return found[:limit]


def list_jobs(
    request: admin_pb2.ListJobsRequest, delivery: Delivery, ctx: JobStoreContext
) -> admin_pb2.ListJobsReply:
    records = find_jobs(ctx.state, job_filter(request), page_size(request.limit))
    return list_reply(records)


def get_job(
    request: admin_pb2.GetJobRequest, delivery: Delivery, ctx: JobStoreContext
) -> job_pb2.JobRecord:
    record = lookup_job(ctx, request.job_id)
    reply = record_reply(record)
    if ctx.logs is not None:  # each site's last error line (`fedhive logs`, `.logs`)
        reply.last_errors.update(ctx.logs.last_errors(record.job_id))
    return reply


def get_job_metrics(
    request: admin_pb2.GetJobMetricsRequest, delivery: Delivery, ctx: JobStoreContext
) -> admin_pb2.JobMetrics:
    """The rounds the job's server job logged so far, oldest first (NotFound: no such job)."""
    record = lookup_job(ctx, request.job_id)
    rounds = [round_to_proto(round_from_dict(entry)) for entry in ctx.rounds.read(record.job_id)]
    return admin_pb2.JobMetrics(job_id=record.job_id, rounds=rounds)


def list_sites(
    request: admin_pb2.ListSitesRequest, delivery: Delivery, ctx: JobStoreContext
) -> admin_pb2.ListSitesReply:
    """Every site that ever sent a heartbeat, by name; `online` while its heartbeat is live.
    An offline site's entry carries only its name (its last heartbeat has expired)."""
    sites = []
    for name in ctx.state.known_sites():
        beat = ctx.state.get_site(name)
        sites.append(
            admin_pb2.SiteInfo(
                last_heartbeat=(
                    site_pb2.SiteHeartbeat(site=name)
                    if beat is None
                    else site_heartbeat_to_proto(beat)
                ),
                online=beat is not None,
            )
        )
    return admin_pb2.ListSitesReply(sites=sites)
