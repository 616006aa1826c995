"""`LogStream`: what `Session.logs` returns, an iterator of a job's log lines (`LogEntry`).

Besides the lines it tells, as the gateway's pages arrive, the job's full id (`job_id`: the
request may name a prefix) and the sites that do not share their logs (`private_sites`: their
site config says `share_logs: false`, so no line of theirs is ever stored).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from fedhive.joblogs.wire import LogEntry, entry_from_proto
from fedhive.proto.v1 import admin_pb2


class LogStream:
    def __init__(self, pages: Iterable[admin_pb2.JobLogPage]) -> None:
        self.job_id = ""
        self.private_sites: list[str] = []
        self._lines = self._read(pages)

    def _read(self, pages: Iterable[admin_pb2.JobLogPage]) -> Iterator[LogEntry]:
        for page in pages:
            self.job_id = page.job_id or self.job_id
            self.private_sites = sorted(page.private_sites)
            for line in page.lines:
                yield entry_from_proto(line)

    def __iter__(self) -> LogStream:
        return self

    def __next__(self) -> LogEntry:
        return next(self._lines)
