"""The running scheduler: leader lease, wake-ups and the pass loop.

Replicas compete for the Redis lease `scheduler` (TTL `lease_ttl_s`, renewed every
`renew_interval_s` by its own thread, so a long pass never lets it lapse). Only the holder runs
passes, each under its fencing token, and only the holder consumes the wake-up events
(`job.status.*` and `site.online` on the shared queue `{ns}.events.scheduler`); a pass also runs
every `tick_s`. A killed leader's lease expires and another replica takes over within
`lease_ttl_s + renew_interval_s`; a deposed leader's writes are refused by the fence.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from fedhive.bus import Bus, Delivery, Subscription
from fedhive.errors import FedhiveError, LeaseNotHeld
from fedhive.names import Names
from fedhive.proto.v1 import job_pb2, site_pb2
from fedhive.scheduling import Scheduler
from fedhive.scheduling.scheduler import LEASE
from fedhive.state import StateStore

CONSUMER = "scheduler"
WAKE_PATTERNS = ("job.status.*", Names.SITE_ONLINE)


@dataclass(frozen=True)
class LoopConfig:
    tick_s: float = 1.0
    lease_ttl_s: float = 3.0
    renew_interval_s: float = 1.0


class SchedulerService:
    def __init__(self, scheduler: Scheduler, state: StateStore, bus: Bus, config: LoopConfig,
                 log: Any) -> None:
        self._scheduler = scheduler
        self._state = state
        self._bus = bus
        self._config = config
        self._log = log
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._token: int | None = None
        self._lock = threading.Lock()
        self._follow_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._wakeups: Subscription | None = None
        self._threads = [threading.Thread(target=self._lease_loop, name="scheduler-lease"),
                         threading.Thread(target=self._pass_loop, name="scheduler-pass")]

    @property
    def token(self) -> int | None:
        with self._lock:
            return self._token

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join()
        token = self.token
        if token is not None:
            self._state.release(LEASE, self.holder, token)
        self._follow(False)

    # leadership -----------------------------------------------------------------------------
    def _lease_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._hold_lease()
            except FedhiveError as err:  # Redis trouble: keep trying, the lease decides
                self._log.error("scheduler.lease_error", error=str(err))
            self._stop.wait(self._config.renew_interval_s)

    def _hold_lease(self) -> None:
        token = self.token
        ttl = self._config.lease_ttl_s
        if token is not None:
            try:
                self._state.renew(LEASE, self.holder, token, ttl)
                return
            except LeaseNotHeld:
                self._log.warning("scheduler.lease_lost", token=token)
                self._set_token(None)
        token = self._state.acquire(LEASE, self.holder, ttl)
        if token is not None:
            self._log.info("scheduler.leader", token=token, holder=self.holder)
            self._set_token(token)

    def _set_token(self, token: int | None) -> None:
        with self._lock:
            self._token = token
        self._follow(token is not None)
        if token is not None:
            self._wake.set()

    def _follow(self, leading: bool) -> None:
        """Consume the wake-up events while leading, and only then."""
        with self._follow_lock:
            if leading and self._wakeups is None:
                self._wakeups = self._bus.subscribe(
                    CONSUMER, WAKE_PATTERNS, self._on_event,
                    [job_pb2.JobStatusEvent, site_pb2.SiteHeartbeat])
            elif not leading and self._wakeups is not None:
                self._wakeups.stop()
                self._wakeups = None

    def _on_event(self, message: Message, delivery: Delivery) -> None:
        self._wake.set()

    # passes ---------------------------------------------------------------------------------
    def _pass_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._config.tick_s)
            self._wake.clear()
            token = self.token
            if token is None or self._stop.is_set():
                continue
            try:
                result = self._scheduler.run_pass(token)
            except Exception as err:  # broker/Redis trouble: logged; the next pass tries again
                self._log.error("scheduler.pass_failed", error=str(err), exc_info=True)
                continue
            if result.deposed:
                if self.token == token:
                    self._set_token(None)
            elif result.dispatched or result.unschedulable:
                self._wake.set()  # statuses changed: look again at once
