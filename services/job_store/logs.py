"""`JobLogsRequest` -> `JobLogPage`: one page of a job's shared log lines
(`fedhive.state.joblogs`), for the gateway's `JobLogs` stream.

The page says, besides its lines, which of the job's sites do not share their logs, whether the
job is final, and whether its logs are complete: the server job (when the job got as far as the
job-runner) and every site that started a client job have sent their last line, or do not share
them. The record and those marks are read before the lines, so a complete page's lines are all
there were. Errors: NOT_FOUND (no such job), INVALID_ARGUMENT (a `site` past `MAX_FILTER`, an
`after` that is no line id, a `limit` outside 0..`joblogs.PAGE`).
"""

from __future__ import annotations

from fedhive.bus import Delivery
from fedhive.errors import InvalidArgument
from fedhive.joblogs.wire import SERVER, entry_to_proto
from fedhive.jobs.limits import MAX_FILTER, check_text
from fedhive.jobs.record import JobRecord
from fedhive.proto.v1 import admin_pb2
from fedhive.state.joblogs import PAGE, PRIVATE

from .context import JobStoreContext, lookup_job


def expected_sites(record: JobRecord) -> set[str]:
    """Whose last lines a complete log has: every site that started a client job, and the
    server job once the job-runner worked on the job."""
    started = {site for site, state in record.site_states.items()
               if isinstance(state, dict) and state.get("started")}
    return started | ({SERVER} if record.site_states else set())


def job_logs(request: admin_pb2.JobLogsRequest, delivery: Delivery, ctx: JobStoreContext
             ) -> admin_pb2.JobLogPage:
    record = lookup_job(ctx, request.job_id)
    site = check_text(request.site, "site", MAX_FILTER)
    if not 0 <= request.limit <= PAGE:
        raise InvalidArgument(f"limit {request.limit} is outside 0..{PAGE}", field="limit")
    reply = admin_pb2.JobLogPage(job_id=record.job_id, final=record.status.is_final)
    if ctx.logs is None:  # a job-store without the logs store: nothing is shared
        reply.complete = reply.final
        return reply
    marks = ctx.logs.sites(record.job_id)
    page = ctx.logs.read(record.job_id, after=request.after, site=site,
                         limit=request.limit or PAGE)
    reply.lines.extend(entry_to_proto(entry) for entry in page.lines)
    reply.private_sites.extend(sorted(s for s, mark in marks.items() if mark == PRIVATE))
    reply.more = page.more
    reply.complete = reply.final and expected_sites(record) <= set(marks)
    return reply


def last_errors(ctx: JobStoreContext, job_id: str) -> dict[str, str]:
    """site (or "server") -> the last error line of its log; {} without the logs store."""
    return ctx.logs.last_errors(job_id) if ctx.logs is not None else {}
