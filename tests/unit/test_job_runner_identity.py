"""One live process per runner id (`identity`): a live holder's id is refused, a dead holder's
is taken over (its token goes stale), and a runner whose id was taken over is fenced."""

from __future__ import annotations

import os
import socket
import subprocess
import threading

import pytest
import structlog

from fedhive.errors import FailedPrecondition, LeaseNotHeld
from fedhive.state.memory_store import MemoryStateStore
from fedhive_services.job_runner.identity import (
    RunnerLease,
    claim,
    holder_dead,
    lease_name,
    new_holder,
)

HOST = socket.gethostname()
LOG = structlog.get_logger()


def dead_pid() -> int:
    """The pid of a process that has just ended (and was reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_holder_is_this_host_this_pid_and_a_random_part() -> None:
    host, pid, rand = new_holder().split(":")
    assert (host, int(pid)) == (HOST, os.getpid()) and len(rand) == 8
    assert new_holder() != new_holder()


@pytest.mark.parametrize(("holder", "dead"), [
    (f"{HOST}:{os.getpid()}:abcd", True),  # this very pid: an earlier life of this process
    (f"{HOST}:{os.getppid()}:abcd", False),  # a process that runs
    ("elsewhere:1:abcd", False),  # another host: only the lease's expiry tells
    (f"{HOST}:nopid", False),
], ids=["this-pid", "parent-pid", "another-host", "no-pid"])  # the same in every xdist worker
def test_which_holders_are_dead(holder: str, dead: bool) -> None:
    assert holder_dead(holder) is dead
    assert holder_dead(f"{HOST}:{dead_pid()}:abcd")


def test_a_free_id_is_claimed_and_a_renewing_holders_id_refused() -> None:
    store = MemoryStateStore()
    token = claim(store, "r1", "elsewhere:7:abcd", 30, LOG)

    def renewed_meanwhile(seconds: float) -> None:  # the live holder renews while we watch
        store.renew(lease_name("r1"), "elsewhere:7:abcd", token, 30)

    with pytest.raises(FailedPrecondition) as err:
        claim(store, "r1", new_holder(), 30, LOG, sleep=renewed_meanwhile)
    assert "runner id 'r1' is in use by the live job-runner elsewhere:7:abcd" in str(err.value)
    assert "--runner-id" in str(err.value) and err.value.field == "runner_id"
    lease = store.get_lease(lease_name("r1"))
    assert lease is not None and (lease.holder, lease.token) == ("elsewhere:7:abcd", token)


def test_an_id_another_host_stopped_renewing_is_taken_once_it_lapsed() -> None:
    store = MemoryStateStore()
    old = claim(store, "r1", "elsewhere:7:abcd", 0.3, LOG)
    me = new_holder()
    new = claim(store, "r1", me, 30, LOG)  # waits for the lapse, about 0.3 s
    assert new > old
    lease = store.get_lease(lease_name("r1"))
    assert lease is not None and lease.holder == me


def test_a_dead_holders_id_is_taken_over_and_its_token_goes_stale() -> None:
    store = MemoryStateStore()
    dead = f"{HOST}:{dead_pid()}:abcd"
    old = claim(store, "r1", dead, 30, LOG)
    me = new_holder()
    new = claim(store, "r1", me, 30, LOG, sleep=_never)
    assert new > old
    with pytest.raises(LeaseNotHeld):
        store.renew(lease_name("r1"), dead, old, 30)
    lease = store.get_lease(lease_name("r1"))
    assert lease is not None and lease.holder == me


def test_a_runner_whose_id_is_taken_over_is_fenced() -> None:
    store = MemoryStateStore()
    fenced = threading.Event()
    lease = RunnerLease(store, "r1", 0.3, LOG, on_fenced=fenced.set)
    lease.start()
    try:
        assert lease.held() and not lease.fenced
        # another process took the id (this one was frozen past its lease, say)
        store.take_over(lease_name("r1"), "elsewhere:7:abcd", 30, previous=lease.holder)
        assert fenced.wait(5)
        assert lease.fenced and not lease.held()
    finally:
        lease.close()
    current = store.get_lease(lease_name("r1"))
    assert current is not None and current.holder == "elsewhere:7:abcd"  # not released


def test_a_runner_unsure_of_its_lease_pauses_and_a_clean_stop_releases_it() -> None:
    store = MemoryStateStore()
    now = [0.0]
    lease = RunnerLease(store, "r1", 30, LOG, on_fenced=lambda: None, clock=lambda: now[0])
    lease.start()
    now[0] = 19.9  # no renewal for almost two thirds of the TTL
    assert lease.held()
    now[0] = 20.0
    assert not lease.held() and not lease.fenced
    lease.close()
    assert store.get_lease(lease_name("r1")) is None
    claim(store, "r1", "elsewhere:8:abcd", 30, LOG, sleep=_never)  # the next starts at once


def _never(seconds: float) -> None:
    raise AssertionError("claim waited where it should not have")
