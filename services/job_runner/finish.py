"""Ending a job the runner owns: stop its server job and client jobs, store the rest of the
server job's log (`server_logs`), free every site, keep the server job's workspace as the job's
result, write the final status, forget the job.

The result (the workspace zipped, a final model of any size included) is built and uploaded
streaming: files are copied into a temporary zip in chunks (`write_folder_zip`) and the zip is
uploaded part by part (`BlobStore.put_file`), so the runner's memory does not grow with the
model.

Every step is idempotent, so the monitor, an abort and a restarted runner may all run it for
the same job; the final status is a compare-and-set, so exactly one of them writes it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from fedhive.errors import (
    FedhiveError,
    IllegalTransition,
    NotFound,
    StaleFencingToken,
)
from fedhive.jobs.archive import write_folder_zip
from fedhive.jobs.events import publish_status
from fedhive.jobs.record import JobRecord
from fedhive.jobs.status import JobStatus
from fedhive.state.port import JobUpdate
from fedhive.state.runs import RunEntry

from . import server_job
from .context import RunnerContext, fence, lease_name
from .sites import release


def conclude(ctx: RunnerContext, entry: RunEntry, expected: JobStatus, new: JobStatus,
             reason: str) -> JobRecord | None:
    """Clean up, then `expected -> new` (fenced by the runner's ownership lease) with the
    result; None when the job had already left `expected` (someone else ended it)."""
    result_key = clean_up(ctx, entry, reason)
    update = JobUpdate(result_key=result_key or None, failed_sites=failed_sites(entry),
                       site_states=site_states(entry))
    try:
        record = ctx.state.change_status(entry.job_id, expected, new, reason, update=update,
                                         fence=fence(entry.job_id, entry.fence_token))
    except (IllegalTransition, StaleFencingToken) as err:
        ctx.log.info("job_runner.end_skipped", job_id=entry.job_id, status=new.value,
                     why=str(err))
        forget(ctx, entry)
        return None
    publish_status(ctx.bus, record)
    ctx.log.info("job_runner.job_ended", job_id=entry.job_id, status=new.value, reason=reason)
    forget(ctx, entry)
    return record


def clean_up(ctx: RunnerContext, entry: RunEntry, reason: str) -> str:
    """Stop the SJ (its whole process group) and the CJs, free every site, delete the job's
    task queue, store the result; returns the result's key ('' when the server job never had a
    workspace)."""
    server_job.stop(ctx, entry)
    if ctx.server_logs is not None:  # its last lines, before the final status is written
        ctx.server_logs.drain(entry)
    release(ctx, entry.job_id, {site: state.token for site, state in entry.sites.items()},
            reason)
    try:  # the job's task queue: nobody serves it any more
        ctx.bus.delete_queue(ctx.names.job_server_queue(entry.job_id))
    except FedhiveError as err:
        ctx.log.warning("job_runner.queue_not_deleted", job_id=entry.job_id, error=str(err))
    return store_result(ctx, entry)


def wind_up(ctx: RunnerContext, entry: RunEntry, reason: str) -> JobRecord:
    """For a job someone else ended (an abort): clean up, record the result, forget the job."""
    result_key = clean_up(ctx, entry, reason)
    record = ctx.state.update_job(entry.job_id, JobUpdate(result_key=result_key or None,
                                                          failed_sites=failed_sites(entry),
                                                          site_states=site_states(entry)))
    forget(ctx, entry)
    return record


def store_result(ctx: RunnerContext, entry: RunEntry) -> str:
    """Zip the server job's workspace (streamed to a temporary file next to it) and upload it
    (streamed: one part in memory per upload worker); returns the result's key."""
    folder = Path(entry.workspace) / "workspace" if entry.workspace else None
    if folder is None or not folder.is_dir():
        return ""
    key = ctx.names.job_result_key(entry.job_id)
    with tempfile.TemporaryFile(dir=entry.workspace, prefix=".result-") as archive:
        write_folder_zip(folder, archive)
        ctx.blobs.put_file(key, archive)
    return key


def site_states(entry: RunEntry) -> dict[str, dict[str, Any]]:
    """The run's per-site sub-state as `JobRecord.site_states` keeps it."""
    return {site: {"allocated": s.allocated, "deployed": s.deployed, "started": s.started,
                   "excluded": s.excluded.removeprefix("fatal: "), "gone": s.gone,
                   "last_heartbeat_ms": s.last_heartbeat_ms}
            for site, s in sorted(entry.sites.items())}


def record_sites(ctx: RunnerContext, entry: RunEntry) -> None:
    """Copy the per-site sub-state into the job record (fenced: only the job's owner writes
    it), where it outlives the running-jobs table; a lost ownership is only logged."""
    try:
        ctx.state.update_job(entry.job_id, JobUpdate(site_states=site_states(entry)),
                             fence=fence(entry.job_id, entry.fence_token))
    except (StaleFencingToken, NotFound) as err:
        ctx.log.warning("job_runner.site_states_not_recorded", job_id=entry.job_id,
                        error=str(err))


def failed_sites(entry: RunEntry) -> list[str]:
    return sorted(site for site, state in entry.sites.items() if state.excluded or state.gone)


def forget(ctx: RunnerContext, entry: RunEntry) -> None:
    """Drop the job from the running-jobs table, give its lease up, delete its workspace."""
    try:
        ctx.runs.remove(entry.job_id, entry.fence_token)
    except StaleFencingToken as err:  # its successor's now: lease and workspace are its own
        ctx.log.warning("job_runner.not_forgotten", job_id=entry.job_id, error=str(err))
        return
    ctx.state.release(lease_name(entry.job_id), ctx.config.holder, entry.fence_token)
    if entry.workspace:
        shutil.rmtree(entry.workspace, ignore_errors=True)
    ctx.forget(entry.job_id)
