"""Verifying a site's `LogBatch` before anything of it is stored. Transport-free, like
`fedhive.sites.intake`.

A site publishes its batches on `site.<site>.logs` with the AMQP `user_id` property, which
RabbitMQ verifies against the connection's user. `accept` takes a batch only when that user is
the broker user of the routing key's site and the payload names the same site (a site holding
its own credentials cannot write as another), and only when the batch is well formed (a job id,
lines within the bounds a site agent keeps, their end offsets increasing). Whether the job was
deployed to that site is the caller's check: it needs the job's record.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedhive.errors import MalformedMessage, PermissionDenied
from fedhive.joblogs.lines import MAX_LINE_BYTES, Line
from fedhive.joblogs.tail import MAX_BATCH_BYTES, MAX_BATCH_LINES
from fedhive.joblogs.wire import lines_from_proto
from fedhive.jobs.limits import MAX_JOB_ID
from fedhive.names import Names
from fedhive.proto.v1 import site_pb2

KIND = "logs"
PATTERN = Names.site_event("*", KIND)  # what the runner's logs queue is bound to
MAX_TEXT = MAX_LINE_BYTES + 64  # characters of one line (its clipping note included)
MAX_LINES = MAX_BATCH_LINES


@dataclass(frozen=True)
class SiteBatch:
    """An accepted batch: `site` is the verified sender."""

    site: str
    job_id: str
    start: int
    lines: list[Line]
    eof: bool
    private: bool


def accept(message: site_pb2.LogBatch, routing_key: str, user_id: str | None,
           names: Names) -> SiteBatch:
    """PermissionDenied (naming the sender and the claimed site) unless `user_id` is the broker
    user of the routing key's site and the payload names that site; MalformedMessage for a
    routing key, job id or lines out of bounds."""
    parts = routing_key.split(".")
    if len(parts) != 3 or parts[0] != "site" or not parts[1] or parts[2] != KIND:
        raise MalformedMessage(f"routing key {routing_key[:200]!r} is not site.<site>.{KIND}",
                               field="routing_key")
    site = parts[1]
    if user_id != names.site_user(site) or message.site != site:
        raise PermissionDenied(
            f"{routing_key} refused: sent by broker user {user_id or '(none)'!r} for site "
            f"{site!r} with payload site {message.site[:100]!r}; the sender must be the "
            f"site's broker user {names.site_user(site)!r} and the payload name the site",
            field="user_id")
    if not message.job_id or len(message.job_id) > MAX_JOB_ID:
        raise MalformedMessage(f"{routing_key}: a log batch without a valid job_id",
                               field="job_id")
    lines = lines_from_proto(message)
    if len(lines) > MAX_LINES or sum(len(line.text) for line in lines) > 2 * MAX_BATCH_BYTES:
        raise MalformedMessage(f"{routing_key}: a log batch of {len(lines)} lines is past the "
                               "bounds of a batch", field="lines")
    previous = message.start
    for line in lines:
        if line.end <= previous or len(line.text) > MAX_TEXT:
            raise MalformedMessage(f"{routing_key}: a log line ending at {line.end} after "
                                   f"{previous}, or longer than {MAX_TEXT} characters",
                                   field="lines")
        previous = line.end
    return SiteBatch(site, message.job_id, message.start, lines, message.eof, message.private)
