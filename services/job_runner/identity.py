"""One live process per runner id: the lease `runner:<id>`.

Jobs are owned by runner id (their ownership leases and the running-jobs table name it), so that
a runner restarted with the same id re-attaches at once; two live processes with one id would
both act on the same jobs. So each process holds the id's lease under a holder of its own
(`host:pid:random`), renewed every third of its TTL by a thread of its own:

* at start, a free or expired lease is taken; one whose holder is dead is taken over at once
  (a new fencing token): same host and its pid is gone, or is this very process's pid (a
  restarted container reuses pids). Of any other holder (another host, or a pid that runs) the
  lease is watched: renewed, it is live and the runner refuses to start (`FailedPrecondition`,
  one line naming the id and the holder, exit 2); left to lapse, it is taken once it expired
  (so a runner killed on one host starts again on another within one lease TTL);
* while running it acts on jobs only while `held()`: its last successful renewal began less than
  two thirds of the TTL ago, so it stops before the lease could lapse and pass to another
  process (Redis away that long pauses it);
* a renewal that finds the lease taken by another holder (this process was frozen or cut off
  past the TTL, and a new one took the id over) fences it for good: `on_fenced` is called once
  (the runner shuts down). The new holder also took the jobs' leases over with new tokens
  (`monitor.recover`), so a write of the old one still in flight is refused by its fence.

A clean stop releases the lease, so a restart is never refused by its own predecessor.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psutil

from fedhive.errors import FailedPrecondition, FedhiveError, LeaseNotHeld
from fedhive.state.port import Lease, Leases

WATCH_POLL_S = 0.2  # how often a holder that may be alive is looked at for a renewal


def lease_name(runner_id: str) -> str:
    return f"runner:{runner_id}"


def new_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def holder_dead(holder: str) -> bool:
    """A holder on this host whose process is gone (or is this process: an earlier life)."""
    host, _, rest = holder.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False  # another host's process: only its lease's expiry tells
    pid = int(pid_text)
    if pid == os.getpid():
        return True
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def claim(leases: Leases, runner_id: str, holder: str, ttl_s: float, log: Any, *,
          sleep: Callable[[float], None] = time.sleep) -> int:
    """The id's lease for `holder` (its token); FailedPrecondition naming the live holder."""
    name = lease_name(runner_id)
    watched: Lease | None = None  # the other holder's lease as last seen
    while True:
        token = leases.acquire(name, holder, ttl_s)
        if token is not None:
            return token
        lease = leases.get_lease(name)
        if lease is None:
            continue  # it expired meanwhile
        if holder_dead(lease.holder):
            token = leases.take_over(name, holder, ttl_s, previous=lease.holder)
            if token is not None:
                return token
            continue  # taken by someone else meanwhile
        if watched is not None and (watched.holder, watched.token) == (lease.holder,
                                                                      lease.token):
            if lease.expires_in_s > watched.expires_in_s:
                raise FailedPrecondition(
                    f"runner id {runner_id!r} is in use by the live job-runner {lease.holder} "
                    f"(it renews the id's lease): stop it, or give this runner another "
                    f"--runner-id", field="runner_id")
        else:
            log.info("job_runner.id_watched", holder=lease.holder,
                     expires_in_s=round(lease.expires_in_s, 1),
                     why="taken once it lapses; refused if its holder renews it")
        watched = lease
        sleep(WATCH_POLL_S)


class RunnerLease:
    """The id's lease held by this process: `start()` claims it (or raises), `close()` gives it
    back."""

    def __init__(self, leases: Leases, runner_id: str, ttl_s: float, log: Any,
                 on_fenced: Callable[[], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.runner_id = runner_id
        self.holder = new_holder()
        self.token = 0
        self._leases = leases
        self._ttl_s = ttl_s
        self._log = log.bind(runner_id=runner_id, holder=self.holder)
        self._on_fenced = on_fenced
        self._clock = clock
        self._renewed_at = -float("inf")  # when the last successful renewal began
        self._fenced = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="runner-lease",
                                        daemon=True)

    def start(self) -> None:
        began = self._clock()
        self.token = claim(self._leases, self.runner_id, self.holder, self._ttl_s, self._log)
        self._renewed_at = began
        self._log.info("job_runner.id_claimed", token=self.token)
        self._thread.start()

    def held(self) -> bool:
        """Whether this process may act on its jobs now (see the module)."""
        return not self._fenced.is_set() and \
            self._clock() - self._renewed_at < self._ttl_s * 2 / 3

    @property
    def fenced(self) -> bool:
        return self._fenced.is_set()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.token and not self._fenced.is_set():
            try:
                self._leases.release(lease_name(self.runner_id), self.holder, self.token)
            except FedhiveError as err:  # it lapses by itself
                self._log.warning("job_runner.id_not_released", error=str(err))

    def _renew_loop(self) -> None:
        while not self._stop.wait(self._ttl_s / 3):
            began = self._clock()
            try:
                self._leases.renew(lease_name(self.runner_id), self.holder, self.token,
                                   self._ttl_s)
            except LeaseNotHeld:
                self._fence()
                return
            except Exception as err:  # Redis away: held() runs out unless a renewal succeeds
                self._log.warning("job_runner.id_renewal_failed", error=str(err))
                continue
            self._renewed_at = began

    def _fence(self) -> None:
        self._fenced.set()
        try:
            lease = self._leases.get_lease(lease_name(self.runner_id))
        except FedhiveError:
            lease = None
        self._log.error("job_runner.fenced", now_held_by=lease.holder if lease else None,
                        why="another job-runner took this runner id over while this one was "
                        "frozen or cut off past the lease; this one stops")
        self._on_fenced()
