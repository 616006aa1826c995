"""The runner's commands to site agents, sent to several sites at once under one timeout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from google.protobuf.message import Message

from fedhive.errors import FedhiveError, NotFound, RpcTimeout, Unroutable
from fedhive.proto.v1 import site_pb2

from .context import RunnerContext

M = TypeVar("M", bound=Message)


def call_sites(ctx: RunnerContext, requests: Mapping[str, Message], reply_type: type[M],
               ) -> dict[str, M | FedhiveError]:
    """site -> reply or error; no reply within `sync_timeout_s` is an `RpcTimeout`."""
    if not requests:
        return {}
    by_queue = {ctx.names.site_queue(site): request for site, request in requests.items()}
    replies = ctx.bus.call_many(by_queue, reply_type, timeout=ctx.config.sync_timeout_s)
    return {site: replies[ctx.names.site_queue(site)] for site in requests}


def describe(error: FedhiveError, what: str) -> str:
    """`no reply (deployment timeout)`, `unreachable`, or the site's own error line."""
    if isinstance(error, RpcTimeout):
        return f"no reply ({what} timeout)"
    if isinstance(error, Unroutable):
        return "unreachable (no control queue)"
    return f"{what} failed: {error}"


def cancel(ctx: RunnerContext, job_id: str, tokens: Mapping[str, str]) -> None:
    """Cancel reservations (site -> token) of a dispatch that is not acted on; a reservation
    already allocated is not affected (the site answers `cancelled=False`)."""
    replies = call_sites(ctx, {s: site_pb2.CancelResourcesRequest(token=t)
                               for s, t in tokens.items() if t}, site_pb2.CancelResourcesReply)
    for site, reply in replies.items():
        if isinstance(reply, FedhiveError):
            ctx.log.warning("job_runner.cancel_failed", job_id=job_id, site=site,
                            error=str(reply))


def release(ctx: RunnerContext, job_id: str, sites: Mapping[str, str], reason: str) -> None:
    """Stop the client jobs, free what they hold and cancel unused reservations on `sites`
    (site -> reservation token), best effort: a site that does not answer frees its own once
    the job is gone from it (its reservations expire), so a site whose abort went unanswered
    is not asked again (each unanswered call costs a whole sync timeout)."""
    log = ctx.log.bind(job_id=job_id)
    aborts = call_sites(ctx, {s: site_pb2.AbortRequest(job_id=job_id, reason=reason)
                              for s in sites}, site_pb2.SiteJob)
    answered = {s: t for s, t in sites.items()
                if not isinstance(aborts[s], RpcTimeout | Unroutable)}
    frees = call_sites(ctx, {s: site_pb2.FreeResourcesRequest(job_id=job_id) for s in answered},
                       site_pb2.SiteJob)
    cancels = call_sites(ctx, {s: site_pb2.CancelResourcesRequest(token=t)
                               for s, t in answered.items() if t},
                         site_pb2.CancelResourcesReply)
    for site in sites:
        problems = [f"{name}: {reply}" for name, reply in
                    (("abort", aborts[site]), ("free", frees.get(site)),
                     ("cancel", cancels.get(site)))
                    if isinstance(reply, FedhiveError) and not _harmless(reply)]
        if problems:
            log.warning("job_runner.release_incomplete", site=site, problems=problems)


def _harmless(error: FedhiveError) -> bool:
    """An abort of a job the site never heard of: there is nothing to stop."""
    return isinstance(error, NotFound)
