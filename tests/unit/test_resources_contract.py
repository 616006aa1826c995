"""The ResourceManagerSpec contract, run against every manager (each with 4 units of "gpu").

Expiry is driven by a fake clock, never by sleeping.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from fedhive.errors import FailedPrecondition, NotFound
from fedhive.resources import (
    AutoCleanResourceManager,
    CheckResult,
    GPUResourceManager,
    ListResourceManager,
    ResourceManagerSpec,
)

EXPIRY_S = 60.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeDevices:
    """A device table standing in for NVML: `mem_gib[i]` is device i's memory, `free_gib[i]`
    how much of it is free right now (all of it by default)."""

    def __init__(self, mem_gib: list[float], free_gib: list[float] | None = None) -> None:
        self.mem_gib = mem_gib
        self.free_gib = list(mem_gib) if free_gib is None else free_gib

    def device_count(self) -> int:
        return len(self.mem_gib)

    def memory_total_bytes(self, index: int) -> int:
        return int(self.mem_gib[index] * 1024**3)

    def memory_free_bytes(self, index: int) -> int:
        return int(self.free_gib[index] * 1024**3)


@dataclass
class Impl:
    manager: AutoCleanResourceManager
    clock: FakeClock
    need: Callable[[int], dict[str, Any]]  # requirement for n units
    bad: list[tuple[Any, str]]  # (requirement, key its "no" reason must name)
    free_key: str  # key of report_resources()["free"] that counts free units
    restart: Callable[[], AutoCleanResourceManager]  # a new manager, as after an agent restart
    held: Callable[[list[int]], dict[str, Any]]  # the allocation of these units of need(n)
    short: Callable[[int, int], str]  # the "no" reason when n units are wanted and f are free


def _gpu(clock: FakeClock) -> Impl:
    def build() -> GPUResourceManager:
        return GPUResourceManager(
            4, 8, devices=FakeDevices([16.0] * 4), expiration_period=EXPIRY_S, clock=clock
        )

    manager = build()
    bad = [
        ({"num_of_gpus": -1}, "num_of_gpus"),
        ({"num_of_gpus": True}, "num_of_gpus"),
        ({"num_of_gpus": 1.5}, "num_of_gpus"),
        ({"num_of_gpus": "1"}, "num_of_gpus"),
        ({"num_of_gpus": 1, "mem_per_gpu_in_GiB": -2}, "mem_per_gpu_in_GiB"),
        ({"num_of_gpus": 1, "mem_per_gpu_in_GiB": False}, "mem_per_gpu_in_GiB"),
        ({"num_of_gpus": 1, "mem_per_gpu_in_GiB": float("nan")}, "mem_per_gpu_in_GiB"),
        ({"num_of_gpus": 1, "cpus": 2}, "cpus"),
        ({"mem_per_gpu_in_GiB": 2}, "num_of_gpus"),
    ]
    # Each unit is a whole GPU: all of its memory (sharing by memory: test_resources_gpu.py).
    return Impl(manager, clock, lambda n: {"num_of_gpus": n, "mem_per_gpu_in_GiB": 8}, bad,
                "num_of_gpus", build, lambda ids: {"gpu": ids, "mem_per_gpu_in_GiB": 8.0},
                lambda n, f: f"num_of_gpus {n} > {f} with mem_per_gpu_in_GiB 8 free")


def _list(clock: FakeClock) -> Impl:
    def build() -> ListResourceManager:
        return ListResourceManager(
            {"gpu": [0, 1, 2, 3], "port": [9000]}, expiration_period=EXPIRY_S, clock=clock
        )

    manager = build()
    bad = [
        ({"gpu": -1}, "gpu"),
        ({"gpu": True}, "gpu"),
        ({"gpu": 2.0}, "gpu"),
        ({"gpu": None}, "gpu"),
        ({"gpu": 1, "tpu": 1}, "tpu"),
    ]
    return Impl(manager, clock, lambda n: {"gpu": n}, bad, "gpu", build,
                lambda ids: {"gpu": ids}, lambda n, f: f"gpu {n} > {f} free")


@pytest.fixture(params=[_gpu, _list], ids=["gpu", "list"])
def impl(request: pytest.FixtureRequest) -> Impl:
    factory: Callable[[FakeClock], Impl] = request.param
    return factory(FakeClock())


def free(impl: Impl) -> int:
    count: int = impl.manager.report_resources()["free"][impl.free_key]
    return count


def test_resource_less_job_is_always_yes_and_holds_nothing(impl: Impl) -> None:
    for _ in range(3):
        impl.manager.check_resources(impl.need(4))  # exhaust the pool first
    for requirement in ({}, impl.need(0)):
        result = impl.manager.check_resources(requirement)
        assert result.ok and result.token and result.reason == ""
        impl.clock.now += 10 * EXPIRY_S  # nothing to expire: it still allocates
        assert impl.manager.allocate_resources(result.token) == {}
        assert impl.manager.free_resources(result.token) is False


def test_check_reserves_until_the_pool_is_exhausted(impl: Impl) -> None:
    first = impl.manager.check_resources(impl.need(3))
    assert first.ok and free(impl) == 1
    second = impl.manager.check_resources(impl.need(2))
    assert not second.ok and second.token == ""
    assert second.reason == impl.short(2, 1)
    assert impl.manager.check_resources(impl.need(1)).ok
    assert free(impl) == 0


def test_more_than_the_site_has_is_refused_as_such(impl: Impl) -> None:
    result = impl.manager.check_resources(impl.need(5))
    assert not result.ok and result.reason == f"{impl.free_key} 5 > 4 on this site"


def test_bad_requirement_is_no_naming_the_key(impl: Impl) -> None:
    for requirement, key in impl.bad:
        result = impl.manager.check_resources(requirement)
        assert not result.ok and result.token == "", requirement
        assert key in result.reason, (requirement, result.reason)
    assert free(impl) == 4


@pytest.mark.parametrize("requirement", [[("gpu", 1)], "num_of_gpus=1", 3, None])
def test_non_dict_requirement_is_no(impl: Impl, requirement: Any) -> None:
    result = impl.manager.check_resources(requirement)
    assert not result.ok and "must be a dict" in result.reason


def test_cancel_releases_a_reservation_once(impl: Impl) -> None:
    token = impl.manager.check_resources(impl.need(4)).token
    assert impl.manager.cancel_resources(token) is True
    assert free(impl) == 4
    assert impl.manager.cancel_resources(token) is False
    assert impl.manager.cancel_resources("no-such-token") is False
    assert impl.manager.cancel_resources("") is False
    with pytest.raises(NotFound, match="no reservation for token"):
        impl.manager.allocate_resources(token)
    assert free(impl) == 4


def test_unallocated_reservation_expires(impl: Impl) -> None:
    token = impl.manager.check_resources(impl.need(4)).token
    impl.clock.now += EXPIRY_S - 0.001
    assert free(impl) == 0
    impl.clock.now += 0.001
    assert free(impl) == 4
    assert impl.manager.report_resources()["reservations"] == 0
    with pytest.raises(NotFound) as err:
        impl.manager.allocate_resources(token)
    assert err.value.field == "token" and "expired" in str(err.value)
    assert impl.manager.check_resources(impl.need(4)).ok  # the units really came back


def test_allocated_resources_never_expire(impl: Impl) -> None:
    token = impl.manager.check_resources(impl.need(2)).token
    impl.clock.now += EXPIRY_S / 2
    held = impl.manager.allocate_resources(token)
    impl.clock.now += 100 * EXPIRY_S
    assert free(impl) == 2
    assert impl.manager.allocate_resources(token) == held


def test_allocate_returns_the_units_and_is_idempotent(impl: Impl) -> None:
    token = impl.manager.check_resources(impl.need(2)).token
    held = impl.manager.allocate_resources(token)
    assert held == impl.held([0, 1])
    held["gpu"].append(99)  # callers get a copy
    assert impl.manager.allocate_resources(token) == impl.held([0, 1])
    report = impl.manager.report_resources()
    assert (report["reservations"], report["allocations"]) == (0, 1)


def test_late_cancel_does_not_take_units_from_a_running_job(impl: Impl) -> None:
    token = impl.manager.check_resources(impl.need(4)).token
    impl.manager.allocate_resources(token)
    assert impl.manager.cancel_resources(token) is False
    assert free(impl) == 0


def test_free_releases_allocation_or_reservation_once(impl: Impl) -> None:
    allocated = impl.manager.check_resources(impl.need(2)).token
    impl.manager.allocate_resources(allocated)
    reserved = impl.manager.check_resources(impl.need(2)).token
    assert impl.manager.free_resources(allocated) is True
    assert impl.manager.free_resources(reserved) is True
    assert free(impl) == 4
    assert impl.manager.free_resources(allocated) is False  # a repeated free adds nothing
    assert free(impl) == 4
    with pytest.raises(NotFound):
        impl.manager.allocate_resources(allocated)


def test_freed_units_are_handed_out_lowest_first(impl: Impl) -> None:
    tokens = [impl.manager.check_resources(impl.need(1)).token for _ in range(4)]
    impl.manager.free_resources(tokens[2])
    impl.manager.free_resources(tokens[0])
    again = impl.manager.check_resources(impl.need(2)).token
    assert impl.manager.allocate_resources(again) == impl.held([0, 2])


def test_report_is_json_and_accounts_for_every_unit(impl: Impl) -> None:
    impl.manager.allocate_resources(impl.manager.check_resources(impl.need(1)).token)
    impl.manager.check_resources(impl.need(2))
    report = impl.manager.report_resources()
    assert json.loads(json.dumps(report)) == report
    assert report["free"][impl.free_key] == 1
    assert report["total"][impl.free_key] == 4
    assert (report["reservations"], report["allocations"]) == (1, 1)


def _race(impl: Impl, threads_n: int) -> list[tuple[str, dict[str, Any]]]:
    """Start `threads_n` threads at once, each checking for 1 or 2 units and allocating them."""
    barrier = threading.Barrier(threads_n)
    results: list[tuple[str, dict[str, Any]]] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        barrier.wait()
        result = impl.manager.check_resources(impl.need(n))
        if result.ok:
            held = impl.manager.allocate_resources(result.token)
            with lock:
                results.append((result.token, held))

    threads = [threading.Thread(target=worker, args=(1 + i % 2,)) for i in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_concurrent_checks_never_over_reserve_or_share_a_unit(impl: Impl) -> None:
    for _ in range(5):
        results = _race(impl, 12)
        units = [u for _, held in results for u in held["gpu"]]
        assert len(units) == len(set(units)) and set(units) <= {0, 1, 2, 3}
        assert free(impl) == 4 - len(units)
        assert len(units) >= 3  # 4 units; at worst a 2-request was refused with 1 left
        for token, _ in results:
            impl.manager.free_resources(token)
        assert free(impl) == 4


def test_concurrent_cancel_free_and_expiry_keep_the_pool_whole(impl: Impl) -> None:
    tokens = [impl.manager.check_resources(impl.need(1)).token for _ in range(4)]
    impl.manager.allocate_resources(tokens[0])
    impl.clock.now += EXPIRY_S  # tokens 1..3 expire under whichever thread looks first
    calls: list[Callable[[], object]] = [
        *(lambda t=t: impl.manager.cancel_resources(t) for t in tokens),
        *(lambda t=t: impl.manager.free_resources(t) for t in tokens),
        impl.manager.report_resources,
    ]
    threads = [threading.Thread(target=call) for call in calls * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert free(impl) == 4


def _restarted(impl: Impl, units: int) -> tuple[AutoCleanResourceManager, str, dict[str, Any]]:
    """A token and its allocation of `units` from `impl.manager`, and a new manager (the
    restarted agent's) that knows nothing of them."""
    token = impl.manager.check_resources(impl.need(units)).token
    return impl.restart(), token, impl.manager.allocate_resources(token)


def test_restore_takes_an_allocation_again_after_a_restart(impl: Impl) -> None:
    manager, token, held = _restarted(impl, 2)
    manager.restore(token, held)
    impl.manager = manager
    assert free(impl) == 2
    assert manager.report_resources()["allocations"] == 1
    manager.restore(token, held)  # restoring again is a no-op
    assert free(impl) == 2
    assert manager.allocate_resources(token) == held  # as if just allocated
    impl.clock.now += 100 * EXPIRY_S  # an allocation, not a reservation: it never expires
    assert free(impl) == 2
    assert not manager.check_resources(impl.need(3)).ok
    assert manager.cancel_resources(token) is False  # a late cancel takes nothing
    assert manager.free_resources(token) is True
    assert free(impl) == 4
    assert manager.free_resources(token) is False


def test_restore_of_units_not_free_or_unknown_takes_nothing(impl: Impl) -> None:
    manager, token, held = _restarted(impl, 2)
    other = manager.check_resources(impl.need(1)).token
    assert manager.allocate_resources(other) == impl.held([0])  # one of `held`'s units
    impl.manager = manager
    with pytest.raises(FailedPrecondition, match=r"cannot restore .* not free") as err:
        manager.restore(token, held)
    assert err.value.field == "allocation"
    for bad in ({"gpu": [7]}, {"gpu": [1, 1]}, {"gpu": []}, {"gpu": "1"}, {"gpu": [None]},
                {"tpu": [1]}):
        with pytest.raises(FailedPrecondition, match="cannot restore"):
            manager.restore(token, bad)
    assert free(impl) == 3  # unit 1 was not taken by the refused restores
    assert manager.report_resources()["allocations"] == 1


def test_restore_of_a_token_holding_something_else_is_refused(impl: Impl) -> None:
    manager, token, held = _restarted(impl, 1)
    manager.restore(token, held)
    with pytest.raises(FailedPrecondition, match="already holds") as err:
        manager.restore(token, {"gpu": [3]})
    assert err.value.field == "token"
    reserved = manager.check_resources(impl.need(1)).token
    with pytest.raises(FailedPrecondition, match="is a reservation"):
        manager.restore(reserved, {"gpu": [3]})
    impl.manager = manager
    assert free(impl) == 2


def test_restore_of_nothing_holds_nothing(impl: Impl) -> None:
    empty = impl.manager.check_resources({}).token
    manager = impl.restart()
    manager.restore(empty, {})
    manager.restore("any-token", {})
    assert manager.report_resources()["allocations"] == 0
    assert manager.allocate_resources(empty) == {}


class _OldManager(ResourceManagerSpec):
    """A manager written before `restore` existed."""

    def check_resources(self, requirement: Any) -> CheckResult:
        return CheckResult.yes("t")

    def cancel_resources(self, token: str) -> bool:
        return False

    def allocate_resources(self, token: str) -> dict[str, Any]:
        return {}

    def free_resources(self, token: str) -> bool:
        return False

    def report_resources(self) -> dict[str, Any]:
        return {}


def test_a_manager_without_restore_refuses_it() -> None:
    with pytest.raises(FailedPrecondition, match="_OldManager cannot restore an allocation"):
        _OldManager().restore("t", {"gpu": [0]})
