"""GPUResourceManager shares GPUs by memory (FLARE's semantics) and GPUResourceConsumer checks
the host as FLARE's consumer does; NVML is a fake device table, expiry a fake clock."""

from __future__ import annotations

import importlib.util
import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fedhive.errors import FailedPrecondition, InvalidArgument, NotFound
from fedhive.resources import GPUResourceConsumer, GPUResourceManager
from tests.unit.test_resources_contract import FakeClock, FakeDevices
from tests.unit.test_resources_gpu import no_nvml

EXPIRY_S = 60.0


def manager(n: int = 1, mem: float = 16, clock: FakeClock | None = None) -> GPUResourceManager:
    return GPUResourceManager(n, mem, devices=FakeDevices([16.0] * 4), expiration_period=EXPIRY_S,
                              clock=clock or FakeClock())


def need(n: int, mem: float | None = None) -> dict[str, Any]:
    return {"num_of_gpus": n} if mem is None else {"num_of_gpus": n, "mem_per_gpu_in_GiB": mem}


def take(gpus: GPUResourceManager, requirement: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    result = gpus.check_resources(requirement)
    assert result.ok, result.reason
    return result.token, gpus.allocate_resources(result.token)


def free_mem(gpus: GPUResourceManager) -> dict[str, float]:
    mem: dict[str, float] = gpus.report_resources()["free"]["mem_in_GiB"]
    return mem


def test_two_jobs_that_fit_one_gpu_share_it_and_a_third_waits() -> None:
    gpus = manager(1, 16)
    token_a, held_a = take(gpus, need(1, 8))
    token_b, held_b = take(gpus, need(1, 8))
    assert held_a == held_b == {"gpu": [0], "mem_per_gpu_in_GiB": 8.0}
    report = gpus.report_resources()
    assert report["free"] == {"num_of_gpus": 0, "gpu": [], "mem_in_GiB": {"0": 0.0}}
    assert report["allocations"] == 2
    third = gpus.check_resources(need(1, 8))
    assert not third.ok and third.token == ""
    assert third.reason == "num_of_gpus 1 > 0 with mem_per_gpu_in_GiB 8 free"
    assert not gpus.check_resources(need(1, 0.5)).ok  # not even a little is left

    assert gpus.free_resources(token_a)  # freeing gives the memory back
    assert free_mem(gpus) == {"0": 8.0}
    assert gpus.free_resources(token_a) is False  # and only once
    assert free_mem(gpus) == {"0": 8.0}
    assert take(gpus, need(1, 8))[1] == {"gpu": [0], "mem_per_gpu_in_GiB": 8.0}
    gpus.free_resources(token_b)
    assert free_mem(gpus) == {"0": 8.0}


def test_jobs_share_while_memory_lasts_then_go_to_the_next_gpu() -> None:
    gpus = manager(2, 16)
    ids = [take(gpus, need(1, 6))[1]["gpu"] for _ in range(4)]
    assert ids == [[0], [0], [1], [1]]
    assert gpus.check_resources(need(1, 6)).reason == (
        "num_of_gpus 1 > 0 with mem_per_gpu_in_GiB 6 free")
    assert take(gpus, need(1, 3))[1]["gpu"] == [0]  # first fit in id order
    assert free_mem(gpus) == {"0": 1.0, "1": 4.0}
    assert take(gpus, need(1, 3))[1]["gpu"] == [1]


def test_several_gpus_are_distinct_and_each_has_the_memory() -> None:
    gpus = manager(3, 16)
    take(gpus, need(1, 12))  # GPU 0 keeps 4 GiB
    refused = gpus.check_resources(need(3, 8))
    assert refused.reason == "num_of_gpus 3 > 2 with mem_per_gpu_in_GiB 8 free"
    token, held = take(gpus, need(2, 8))
    assert held == {"gpu": [1, 2], "mem_per_gpu_in_GiB": 8.0}
    assert take(gpus, need(3, 4))[1]["gpu"] == [0, 1, 2]
    assert free_mem(gpus) == {"0": 0.0, "1": 4.0, "2": 4.0}
    gpus.free_resources(token)
    assert free_mem(gpus) == {"0": 0.0, "1": 12.0, "2": 12.0}


def test_more_memory_than_a_gpu_has_is_refused_as_such() -> None:
    result = manager(2, 16).check_resources(need(1, 16.5))
    assert result.reason == "mem_per_gpu_in_GiB 16.5 > 16 per GPU on this site"


@pytest.mark.parametrize("requirement", [need(1), need(1, 0), need(1, 0.0)])
def test_zero_memory_requests_share_without_limit(requirement: dict[str, Any]) -> None:
    gpus = manager(2, 16)
    take(gpus, need(2, 16))  # every GPU's memory is reserved
    held = [take(gpus, requirement)[1] for _ in range(50)]
    assert all(h == {"gpu": [0], "mem_per_gpu_in_GiB": 0.0} for h in held)  # the first GPU
    assert take(gpus, need(2, 0))[1]["gpu"] == [0, 1]
    assert gpus.check_resources(need(3, 0)).reason == "num_of_gpus 3 > 2 on this site"
    assert free_mem(gpus) == {"0": 0.0, "1": 0.0}


def test_a_pool_of_zero_memory_takes_only_zero_memory_requests() -> None:
    gpus = manager(1, 0)  # FLARE's provisioned default: GPUs counted, memory not
    assert take(gpus, need(1))[1] == {"gpu": [0], "mem_per_gpu_in_GiB": 0.0}
    assert take(gpus, need(1))[1] == {"gpu": [0], "mem_per_gpu_in_GiB": 0.0}
    assert gpus.check_resources(need(1, 1)).reason == (
        "mem_per_gpu_in_GiB 1 > 0 per GPU on this site")
    assert gpus.report_resources()["free"]["num_of_gpus"] == 1


def test_an_unconfirmed_reservation_expires_and_its_memory_comes_back() -> None:
    clock = FakeClock()
    gpus = manager(1, 16, clock)
    running, _ = take(gpus, need(1, 8))
    reserved = gpus.check_resources(need(1, 8)).token
    assert not gpus.check_resources(need(1, 8)).ok
    clock.now += EXPIRY_S - 0.001
    assert free_mem(gpus) == {"0": 0.0}
    clock.now += 0.001
    assert free_mem(gpus) == {"0": 8.0}  # the allocation keeps its memory: it never expires
    assert gpus.report_resources()["reservations"] == 0
    with pytest.raises(NotFound, match="expired"):
        gpus.allocate_resources(reserved)
    assert take(gpus, need(1, 8))[1]["gpu"] == [0]
    assert gpus.free_resources(running)


def test_cancel_gives_the_memory_back_but_not_a_running_jobs() -> None:
    gpus = manager(1, 16)
    reserved = gpus.check_resources(need(1, 10)).token
    assert gpus.cancel_resources(reserved)
    assert free_mem(gpus) == {"0": 16.0}
    running, _ = take(gpus, need(1, 10))
    assert gpus.cancel_resources(running) is False
    assert free_mem(gpus) == {"0": 6.0}


def test_memory_is_counted_exactly_however_many_jobs_came_and_went() -> None:
    gpus = manager(1, 1)
    tokens = [take(gpus, need(1, 0.1))[0] for _ in range(10)]  # 10 x 0.1 is not 1.0 in floats
    assert not gpus.check_resources(need(1, 0.1)).ok
    for token in tokens:
        gpus.free_resources(token)
    assert gpus.report_resources()["free"] == {"num_of_gpus": 1, "gpu": [0],
                                               "mem_in_GiB": {"0": 1.0}}
    assert take(gpus, need(1, 1))[1] == {"gpu": [0], "mem_per_gpu_in_GiB": 1.0}


def test_concurrent_checks_never_reserve_more_memory_than_a_gpu_has() -> None:
    gpus = manager(4, 16)
    barrier = threading.Barrier(20)
    held: list[dict[str, Any]] = []
    lock = threading.Lock()

    def worker() -> None:
        barrier.wait()
        result = gpus.check_resources(need(1, 5))
        if result.ok:
            with lock:
                held.append(gpus.allocate_resources(result.token))

    threads = [threading.Thread(target=worker) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert Counter(h["gpu"][0] for h in held) == {0: 3, 1: 3, 2: 3, 3: 3}  # 3 x 5 GiB fit in 16
    assert free_mem(gpus) == {"0": 1.0, "1": 1.0, "2": 1.0, "3": 1.0}


def test_restore_after_a_restart_takes_the_memory_again() -> None:
    before = manager(1, 16)
    allocations = [take(before, need(1, 8)) for _ in range(2)]
    after = manager(1, 16)  # the restarted agent's manager knows nothing of them
    for token, held in allocations:
        after.restore(token, held)
        after.restore(token, held)  # again: a no-op
    assert free_mem(after) == {"0": 0.0}
    assert not after.check_resources(need(1, 8)).ok
    assert after.allocate_resources(allocations[0][0]) == allocations[0][1]
    with pytest.raises(FailedPrecondition, match=r"8 GiB of GPU 0 are not free \(0 GiB are\)"):
        after.restore("t3", {"gpu": [0], "mem_per_gpu_in_GiB": 8})
    after.free_resources(allocations[1][0])
    assert free_mem(after) == {"0": 8.0}


def test_restore_of_a_whole_device_allocation_from_before_sharing() -> None:
    gpus = manager(2, 16)
    take(gpus, need(1, 4))  # on GPU 0
    with pytest.raises(FailedPrecondition, match=r"16 GiB of GPU 0 are not free"):
        gpus.restore("old", {"gpu": [0]})
    gpus.restore("old", {"gpu": [1]})  # the whole device, as it was held
    gpus.restore("old", {"gpu": [1.0]})  # again, as it comes back from a Struct: a no-op
    assert free_mem(gpus) == {"0": 12.0, "1": 0.0}
    assert gpus.allocate_resources("old") == {"gpu": [1]}
    assert gpus.free_resources("old")
    assert free_mem(gpus) == {"0": 12.0, "1": 16.0}


# -- the consumer ------------------------------------------------------------------------------

class Untouchable:
    """A device table that fails the test when the consumer looks at it."""

    def device_count(self) -> int:
        raise AssertionError("the host was checked")

    def memory_total_bytes(self, index: int) -> int:
        raise AssertionError("the host was checked")

    def memory_free_bytes(self, index: int) -> int:
        raise AssertionError("the host was checked")


def test_consumer_gives_jobs_sharing_a_gpu_the_same_visible_device() -> None:
    gpus = manager(1, 16)
    consumer = GPUResourceConsumer(devices=FakeDevices([16.0]))
    envs = [consumer.consume(take(gpus, need(1, 8))[1]) for _ in range(2)]
    assert envs == [{"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0"}] * 2


def test_consumer_refuses_a_gpu_the_host_does_not_have() -> None:
    consumer = GPUResourceConsumer(devices=FakeDevices([16.0, 16.0]))
    for mem in (4, 0):
        with pytest.raises(FailedPrecondition) as err:
            consumer.consume({"gpu": [1, 2], "mem_per_gpu_in_GiB": mem})
        assert str(err.value) == "GPU ID 2 does not exist" and err.value.field == "gpu"


def test_consumer_refuses_when_the_gpu_has_less_memory_free_now() -> None:
    consumer = GPUResourceConsumer(devices=FakeDevices([16.0, 16.0], free_gib=[16.0, 7.5]))
    assert consumer.consume({"gpu": [0, 1], "mem_per_gpu_in_GiB": 7.5})[
        "CUDA_VISIBLE_DEVICES"] == "0,1"
    with pytest.raises(FailedPrecondition) as err:
        consumer.consume({"gpu": [0, 1], "mem_per_gpu_in_GiB": 8})
    assert str(err.value) == "GPU free mem is not enough" and err.value.field == "gpu"
    full = GPUResourceConsumer(devices=FakeDevices([16.0], free_gib=[0.0]))
    assert full.consume({"gpu": [0], "mem_per_gpu_in_GiB": 0.0})["CUDA_VISIBLE_DEVICES"] == "0"


def test_consumer_takes_a_list_of_ids_as_given() -> None:
    consumer = GPUResourceConsumer(devices=Untouchable())
    assert consumer.consume({"gpu": [5, 7]})["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert consumer.consume({"gpu": [], "mem_per_gpu_in_GiB": 4}) == {}


@pytest.mark.parametrize("mem", [-1, "4", True, None, float("inf")])
def test_consumer_refuses_a_malformed_memory_amount(mem: Any) -> None:
    consumer = GPUResourceConsumer(devices=Untouchable())
    with pytest.raises(InvalidArgument) as err:
        consumer.consume({"gpu": [0], "mem_per_gpu_in_GiB": mem})
    assert err.value.field == "mem_per_gpu_in_GiB"
    assert "mem_per_gpu_in_GiB must be a number >= 0" in str(err.value)


@no_nvml
def test_consumer_without_nvml_refuses_a_memory_allocation() -> None:
    with pytest.raises(FailedPrecondition) as err:
        GPUResourceConsumer().consume({"gpu": [0], "mem_per_gpu_in_GiB": 1})
    assert str(err.value) == (
        "GPUs cannot be detected: NVML nvmlInit failed: NVML Shared Library Not Found")
    assert GPUResourceConsumer().consume({"gpu": [0]})["CUDA_VISIBLE_DEVICES"] == "0"


def test_the_real_gpu_script_passes_on_a_fake_device_table() -> None:
    """tests/gpu/nvml_share_check.py is run by hand on a GPU machine; its checks run here."""
    path = Path(__file__).resolve().parents[1] / "gpu" / "nvml_share_check.py"
    spec = importlib.util.spec_from_file_location("nvml_share_check", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    report = script.check(FakeDevices([16.0, 80.0], free_gib=[16.0, 79.5]), 1)
    assert report["failures"] == [] and report["ok"]
    assert [r["ok"] for r in report["reservations"]] == [True, True, False]
    assert [r["allocation"]["gpu"] for r in report["reservations"][:2]] == [[1], [1]]
    assert report["missing_device_refused"] == "GPU ID 2 does not exist"
    json.dumps(report)
