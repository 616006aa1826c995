"""Sharing the client jobs' logs: what `fedhive logs JOB` shows of this site.

A thread looks, every `interval_s`, at each job whose client job was started here, reads the new
lines of its log (`<workspace>/.agent/jobs/<job>.log`: the client job's and its trainer's
stdout and stderr) and publishes them as `LogBatch`es on `site.<site>.logs` to the job-runner
(`fedhive.joblogs.tail`: lines clipped to 4 KiB, batches of at most 256 KiB, at most
`MAX_BATCHES` per job per round, a log that grows faster skipped ahead). Once the client job
ended and its log is read to the end (its unfinished last line included), the last batch says
`eof` and the job is done.

Position: after each batch the broker confirmed, how far the log was shared is saved in
`<job>.logs.json` (`records.Workspace.log_position_file`), so a restarted agent goes on from
there. Delivery is at least once: a batch confirmed but whose position was not saved yet (the
agent killed in between) is sent again, and the runner stores each line once (it knows the
byte ranges it has: `fedhive.state.joblogs`). A publish that fails (the broker away) is tried
again next round from the same position.

`share_logs: false` in site.json: no line leaves the site; for each started job one batch marked
`private` tells the runner, so that `fedhive logs` can say the site does not share its logs.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import structlog

from fedhive.bus import Bus
from fedhive.errors import FedhiveError
from fedhive.joblogs.intake import KIND
from fedhive.joblogs.tail import Position, read_batch
from fedhive.joblogs.wire import batch_to_proto
from fedhive.names import Names
from fedhive.proto.v1 import site_pb2

from .agent import SiteAgent
from .records import JobRecord, Workspace, read_json, write_json

log = structlog.get_logger()

INTERVAL_S = 1.0
MAX_BATCHES = 4  # per job and round: one chatty job cannot hold up the others


class LogShipper:
    def __init__(self, agent: SiteAgent, workspace: Workspace, bus: Bus, *,
                 interval_s: float = INTERVAL_S) -> None:
        self._agent = agent
        self._ws = workspace
        self._bus = bus
        self._site = agent.config.site
        self._share = agent.config.share_logs
        self._route = Names.site_event(self._site, KIND)
        self._interval_s = interval_s
        self._positions: dict[str, tuple[Position, bool]] = {}  # job -> (position, done)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-shipper", daemon=True)
        self._log = log.bind(site=self._site)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop, after one more round (the lines and ends of jobs a clean shutdown aborted)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.ship_all()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.ship_all()

    def ship_all(self) -> None:
        for record in self._agent.jobs():
            if not record.pid:  # its client job never started: there is no log
                continue
            try:
                self.ship(record)
            except FedhiveError as err:  # the broker away: the next round tries again
                self._log.warning("site_agent.logs_not_shared", job_id=record.job_id,
                                  error=str(err))
                return
            except OSError as err:
                self._log.warning("site_agent.log_unreadable", job_id=record.job_id,
                                  error=str(err))

    def ship(self, record: JobRecord) -> None:
        """Publish the job's new log lines (or, not sharing, that it does not share them)."""
        job_id = record.job_id
        at, done = self._position(job_id)
        if done:
            return
        if not self._share:
            self._publish(site_pb2.LogBatch(job_id=job_id, site=self._site, private=True),
                          f"{job_id}.{self._site}.logs.private")
            self._save(job_id, at, True)
            return
        final = record.state.final
        for _ in range(MAX_BATCHES):
            batch = read_batch(self._ws.log_file(job_id), at, final=final)
            eof = final and batch.drained
            if batch.lines or eof:
                self._publish(batch_to_proto(job_id, self._site, batch, eof=eof),
                              f"{job_id}.{self._site}.logs.{batch.start}")
            if batch.after != at or eof:
                at = batch.after
                self._save(job_id, at, eof)
            if batch.drained:
                return

    def _publish(self, message: site_pb2.LogBatch, message_id: str) -> None:
        self._bus.publish_event(self._route, message, message_id=message_id)

    def _position(self, job_id: str) -> tuple[Position, bool]:
        known = self._positions.get(job_id)
        if known is None:
            known = _load(self._ws.log_position_file(job_id))
            self._positions[job_id] = known
        return known

    def _save(self, job_id: str, at: Position, done: bool) -> None:
        write_json(self._ws.log_position_file(job_id), {**at.to_json(), "done": done})
        self._positions[job_id] = (at, done)


def _load(path: Path) -> tuple[Position, bool]:
    """A saved position (offset 0, not done, when there is none or it cannot be read)."""
    try:
        values: Any = read_json(path)
    except (OSError, ValueError):
        return Position(), False
    return Position.from_json(values), isinstance(values, dict) and values.get("done") is True
