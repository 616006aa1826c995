"""The protobuf forms of shared log lines: the site agent's `LogBatch` (site.proto) and the
`LogLine`s of the gateway's `JobLogs` stream (admin.proto) as the SDK's `LogEntry`."""

from __future__ import annotations

from dataclasses import dataclass

from fedhive.joblogs.lines import Line
from fedhive.joblogs.tail import Batch
from fedhive.proto.v1 import admin_pb2, site_pb2

SERVER = "server"  # the site name and the source of the server job's lines
CLIENT_JOB = "client_job"  # the source of a site's lines: its client job and trainer


@dataclass(frozen=True)
class LogEntry:
    """One stored line of a job's logs: `id` orders them (`<ms>-<seq>`, the stream's id; pass
    the last one seen as `after` to read on), `site` is a site or "server", `source`
    "server" or "client_job"."""

    id: str
    site: str
    source: str
    line: str


def batch_to_proto(job_id: str, site: str, batch: Batch, *, eof: bool = False
                   ) -> site_pb2.LogBatch:
    return site_pb2.LogBatch(
        job_id=job_id, site=site, start=batch.start, eof=eof,
        lines=[site_pb2.LogBatchLine(end=line.end, text=line.text, error=line.error)
               for line in batch.lines])


def lines_from_proto(message: site_pb2.LogBatch) -> list[Line]:
    return [Line(line.end, line.text, line.error) for line in message.lines]


def entry_from_proto(message: admin_pb2.LogLine) -> LogEntry:
    return LogEntry(message.id, message.site, message.source, message.line)


def entry_to_proto(entry: LogEntry) -> admin_pb2.LogLine:
    return admin_pb2.LogLine(id=entry.id, site=entry.site, source=entry.source, line=entry.line)
