"""What the job-runner's job duties share: its ports, its options, the SJs it started."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fedhive.blobs import BlobStore
from fedhive.bus import Bus
from fedhive.names import Names
from fedhive.state import StateStore
from fedhive.state.port import Fence
from fedhive.state.runs import RunEntry, RunTable


class ChildProcess(Protocol):
    """A server job this runner started: the part of `subprocess.Popen` the runner uses."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...


class Ownership(Protocol):
    """Whether this process may act on the jobs of its runner id now (`identity.RunnerLease`)."""

    def held(self) -> bool: ...


class LogDrain(Protocol):
    """Stores the rest of an ended job's server log (`server_logs.ServerLogs`)."""

    def drain(self, entry: RunEntry) -> None: ...


class NotOwnerNow(Exception):
    """This process is not sure it still holds its runner id (Redis away, or fenced). Not a
    `FedhiveError` on purpose: the bus requeues the command for a runner that is sure."""


@dataclass(frozen=True)
class RunnerConfig:
    holder: str  # this runner's id: a restarted runner with the same id re-attaches at once
    # (one live process per id: `identity`)
    work_dir: Path  # where the server jobs' workspaces are
    sync_timeout_s: float = 10.0  # allocate, deploy and start replies (FLARE runner_sync_timeout)
    lease_ttl_s: float = 15.0  # the job-ownership and runner-id leases
    monitor_interval_s: float = 0.5
    abort_grace_s: float = 5.0  # SIGTERM -> SIGKILL of a server job's process group
    sj_liveness_s: float = 1.0  # how often the server job renews its liveness record
    orphan_grace_s: float = 5.0  # a DISPATCHED job no runner works on is re-issued after this


@dataclass
class RunnerContext:
    state: StateStore
    blobs: BlobStore
    bus: Bus
    names: Names
    runs: RunTable
    config: RunnerConfig
    log: Any
    owner: Ownership
    server_logs: LogDrain | None = None  # None: the server jobs' logs are not shared
    children: dict[str, ChildProcess] = field(default_factory=dict)
    _locks: dict[str, threading.Lock] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    @contextmanager
    def job_lock(self, job_id: str) -> Iterator[None]:
        """Serialises what the dispatcher, the monitor and abort do to one job."""
        with self._guard:
            lock = self._locks.setdefault(job_id, threading.Lock())
        with lock:
            yield

    @contextmanager
    def try_job_lock(self, job_id: str) -> Iterator[bool]:
        """Like `job_lock`, without waiting: yields False when another thread holds it."""
        with self._guard:
            lock = self._locks.setdefault(job_id, threading.Lock())
        got = lock.acquire(blocking=False)
        try:
            yield got
        finally:
            if got:
                lock.release()

    def check_owner(self) -> None:
        """NotOwnerNow unless this process may act on its jobs."""
        if not self.owner.held():
            raise NotOwnerNow(f"job-runner {self.config.holder} is not sure it holds its "
                              "runner id now")

    def forget(self, job_id: str) -> None:
        with self._guard:
            self._locks.pop(job_id, None)
            self.children.pop(job_id, None)


def lease_name(job_id: str) -> str:
    """The job-ownership lease: exactly one runner owns a dispatched or running job."""
    return f"job:{job_id}"


def fence(job_id: str, token: int) -> Fence:
    return Fence(lease_name(job_id), token)
