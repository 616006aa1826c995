"""The job-runner's own share of the jobs' logs: each server job's `server_job.log`.

A thread reads, every `interval_s`, the new lines of the log of each server job this runner owns
(`<work dir>/<job>/workspace/server_job.log`) and stores them as site "server", source "server"
(`fedhive.state.joblogs`). When a job ends, `drain` (called by `finish.clean_up` once the server
job stopped, before the final status is written) stores the rest, an unfinished last line
included, and marks the server's log done.

The read position is the store's: `JobLogStore.stored_up_to(job, "server")`, written in the same
script as the lines, so a restarted runner goes on exactly where the lines stored end (nothing
sent twice, nothing lost; the position kept in memory is only a cache of it).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from fedhive.joblogs.tail import Position, read_batch
from fedhive.joblogs.wire import SERVER
from fedhive.state.joblogs import JobLogStore
from fedhive.state.runs import RunEntry, RunTable

INTERVAL_S = 1.0
MAX_BATCHES = 4  # per job and round: a chatty server job cannot hold up the others
MAX_DRAIN = 64  # batches of the last read (the file is skipped ahead past 8 MiB behind anyway)


def log_path(entry: RunEntry) -> Path | None:
    return Path(entry.workspace) / "workspace" / "server_job.log" if entry.workspace else None


class ServerLogs:
    def __init__(self, runs: RunTable, logs: JobLogStore, holder: str, log: Any, *,
                 interval_s: float = INTERVAL_S) -> None:
        self._runs = runs
        self._logs = logs
        self._holder = holder
        self._log = log.bind(component="server-logs")
        self._interval_s = interval_s
        self._positions: dict[str, Position] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="server-logs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                for entry in self._runs.all():
                    if entry.runner == self._holder and entry.phase != "deploying":
                        self.ship(entry)
            except Exception as err:  # Redis away: the next round goes on where this stopped
                self._log.warning("server_logs.failed", error=str(err))

    def ship(self, entry: RunEntry, *, final: bool = False) -> None:
        """Store the new lines of the job's server log; `final`: all of it, and mark it done."""
        path = log_path(entry)
        if path is None:
            return
        job_id = entry.job_id
        with self._lock:
            at = self._positions.get(job_id)
            if at is None:
                at = Position(self._logs.stored_up_to(job_id, SERVER))
            for _ in range(MAX_DRAIN if final else MAX_BATCHES):
                batch = read_batch(path, at, final=final)
                done = final and batch.drained
                if (batch.lines or done) and self._logs.append(
                        job_id, SERVER, SERVER, batch.start, batch.lines, eof=done) is None:
                    break  # the job is gone
                at = batch.after
                if batch.drained:
                    break
            if final:
                self._positions.pop(job_id, None)
            else:
                self._positions[job_id] = at

    def drain(self, entry: RunEntry) -> None:
        """The job ended (its server job stopped): store the rest of its log, mark it done.
        A failure is logged: the job ends all the same."""
        try:
            self.ship(entry, final=True)
        except Exception as err:
            self._log.warning("server_logs.not_drained", job_id=entry.job_id, error=str(err))
