"""GPUResourceManager's host detection and GPU rules, GPUResourceConsumer, ListResourceManager's
own rules, and the NVML-absent path for real (this machine has no libnvidia-ml)."""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml
import pytest

from fedhive.errors import ConfigError, FailedPrecondition, InvalidArgument
from fedhive.resources import (
    GPUResourceConsumer,
    GPUResourceManager,
    ListResourceManager,
    NvmlDevices,
    NvmlUnavailable,
)
from tests.unit.test_resources_contract import FakeClock, FakeDevices


def _nvml_library_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


no_nvml = pytest.mark.skipif(_nvml_library_present(), reason="this machine has libnvidia-ml")


def gpus(n: int, mem: float = 8, **kwargs: Any) -> GPUResourceManager:
    return GPUResourceManager(n, mem, devices=FakeDevices([16.0] * 4), **kwargs)


def test_refuses_more_gpus_than_the_machine_has() -> None:
    with pytest.raises(ConfigError) as err:
        GPUResourceManager(3, 8, devices=FakeDevices([16.0, 16.0]))
    assert err.value.field == "num_of_gpus"
    assert str(err.value) == "num_of_gpus=3 needs GPU 2 but this machine has 2 GPU(s)"


def test_refuses_more_memory_than_a_gpu_has() -> None:
    with pytest.raises(ConfigError) as err:
        GPUResourceManager(2, 16, devices=FakeDevices([16.0, 15.5]))
    assert err.value.field == "mem_per_gpu_in_GiB"
    assert str(err.value) == "mem_per_gpu_in_GiB=16 but GPU 1 has 15.50 GiB"


def test_device_ids_choose_which_gpus_are_managed() -> None:
    manager = GPUResourceManager(2, 8, device_ids=[3, 1], devices=FakeDevices([8.0] * 4))
    token = manager.check_resources({"num_of_gpus": 2}).token
    assert manager.allocate_resources(token) == {"gpu": [1, 3], "mem_per_gpu_in_GiB": 0.0}
    with pytest.raises(ConfigError, match="needs GPU 4 but this machine has 4"):
        GPUResourceManager(1, 8, device_ids=[4], devices=FakeDevices([8.0] * 4))


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"num_of_gpus": -1}, "num_of_gpus"),
        ({"num_of_gpus": True}, "num_of_gpus"),
        ({"num_of_gpus": "2"}, "num_of_gpus"),
        ({"mem_per_gpu_in_GiB": "8"}, "mem_per_gpu_in_GiB"),
        ({"mem_per_gpu_in_GiB": -0.5}, "mem_per_gpu_in_GiB"),
        ({"device_ids": [0, 0]}, "device_ids"),
        ({"device_ids": [0]}, "device_ids"),
        ({"device_ids": "0,1"}, "device_ids"),
        ({"expiration_period": 0}, "expiration_period"),
        ({"expiration_period": True}, "expiration_period"),
        ({"clock": 5}, "clock"),
    ],
)
def test_bad_constructor_arguments_name_the_argument(args: dict[str, Any], field: str) -> None:
    full: dict[str, Any] = {"num_of_gpus": 2, "mem_per_gpu_in_GiB": 8, **args}
    with pytest.raises(ConfigError) as err:
        GPUResourceManager(**full, devices=FakeDevices([16.0] * 4))
    assert err.value.field == field and field in str(err.value)


def test_memory_requirement_is_per_gpu() -> None:
    manager = gpus(2, 8)
    assert manager.check_resources({"num_of_gpus": 1, "mem_per_gpu_in_GiB": 8}).ok
    result = manager.check_resources({"num_of_gpus": 1, "mem_per_gpu_in_GiB": 8.5})
    assert result.reason == "mem_per_gpu_in_GiB 8.5 > 8 per GPU on this site"


def test_restore_of_gpus_names_the_device_and_keeps_the_others_free() -> None:
    manager = GPUResourceManager(2, 8, device_ids=[1, 3], devices=FakeDevices([8.0] * 4))
    with pytest.raises(FailedPrecondition, match=r"GPU 0 is not managed on this site "
                                                 r"\(managed: \[1, 3\]\)"):
        manager.restore("t1", {"gpu": [0]})
    with pytest.raises(FailedPrecondition, match=r"a GPU allocation is \{'gpu': \[device ids\], "
                                                 r"'mem_per_gpu_in_GiB': GiB on each\}"):
        manager.restore("t1", {"gpu": [3], "port": [1]})
    with pytest.raises(FailedPrecondition, match="mem_per_gpu_in_GiB must be a number >= 0"):
        manager.restore("t1", {"gpu": [3], "mem_per_gpu_in_GiB": "8"})
    manager.restore("t1", {"gpu": [3.0], "mem_per_gpu_in_GiB": 6.0})  # as from a Struct
    assert manager.report_resources()["free"] == {
        "num_of_gpus": 1, "gpu": [1], "mem_in_GiB": {"1": 8.0, "3": 2.0}}
    with pytest.raises(FailedPrecondition, match=r"3 GiB of GPU 3 are not free \(2 GiB are\)"):
        manager.restore("t2", {"gpu": [1, 3], "mem_per_gpu_in_GiB": 3})
    assert manager.report_resources()["free"]["mem_in_GiB"] == {"1": 8.0, "3": 2.0}
    token = manager.check_resources({"num_of_gpus": 2, "mem_per_gpu_in_GiB": 2}).token
    assert manager.allocate_resources(token) == {"gpu": [1, 3], "mem_per_gpu_in_GiB": 2.0}


def test_gpu_less_site_answers_gpu_jobs_no_and_others_yes() -> None:
    manager = GPUResourceManager(0, 0)
    assert manager.check_resources({"num_of_gpus": 1}).reason == "num_of_gpus 1 > 0 on this site"
    assert manager.check_resources({"num_of_gpus": 0, "mem_per_gpu_in_GiB": 4}).ok
    assert manager.report_resources()["total"] == {
        "num_of_gpus": 0,
        "mem_per_gpu_in_GiB": 0.0,
        "gpu": [],
    }


@no_nvml
def test_nvml_library_is_really_absent_here() -> None:
    with pytest.raises(NvmlUnavailable, match="NVML Shared Library Not Found"):
        NvmlDevices().device_count()
    NvmlDevices().close()  # nothing was initialised: nothing to shut down


@no_nvml
def test_zero_gpus_never_initialises_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_init = pynvml.nvmlInit

    def counting_init() -> None:
        calls.append("init")
        real_init()

    monkeypatch.setattr(pynvml, "nvmlInit", counting_init)
    manager = GPUResourceManager(num_of_gpus=0, mem_per_gpu_in_GiB=0)
    token = manager.check_resources({}).token
    assert manager.allocate_resources(token) == {}
    assert calls == []
    with pytest.raises(ConfigError):  # the spy does see NVML being used when GPUs are wanted
        GPUResourceManager(num_of_gpus=1, mem_per_gpu_in_GiB=0)
    assert calls == ["init"]


@no_nvml
def test_gpus_configured_without_nvml_refuse_to_start() -> None:
    with pytest.raises(ConfigError) as err:
        GPUResourceManager(num_of_gpus=1, mem_per_gpu_in_GiB=1)
    assert err.value.field == "num_of_gpus"
    assert str(err.value) == (
        "num_of_gpus=1 but GPUs cannot be detected: NVML nvmlInit failed: "
        "NVML Shared Library Not Found"
    )


def test_consumer_sets_visible_devices_in_pci_order() -> None:
    consumer = GPUResourceConsumer()
    expected = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,2"}
    assert consumer.consume({"gpu": [0, 2]}) == expected
    assert consumer.consume({"gpu": [0.0, 2.0]}) == expected  # as it comes back from a Struct
    assert consumer.consume({}) == {}
    assert consumer.consume({"gpu": []}) == {}


def test_isolating_consumer_hides_gpus_from_a_job_given_none() -> None:
    consumer = GPUResourceConsumer(isolate=True)
    assert consumer.consume({}) == {"CUDA_VISIBLE_DEVICES": ""}
    assert consumer.consume({"gpu": [1]})["CUDA_VISIBLE_DEVICES"] == "1"
    with pytest.raises(ConfigError, match="isolate"):
        GPUResourceConsumer(isolate="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("ids", [[True], "0,1", [-1], [1.5], [None]])
def test_consumer_refuses_malformed_allocations(ids: Any) -> None:
    with pytest.raises(InvalidArgument) as err:
        GPUResourceConsumer().consume({"gpu": ids})
    assert err.value.field == "gpu"


def test_consumer_turns_list_manager_gpus_into_visible_devices() -> None:
    manager = ListResourceManager({"gpu": [4, 5, 6]})
    manager.free_resources(manager.check_resources({"gpu": 1}).token)
    token = manager.check_resources({"gpu": 2}).token
    env = GPUResourceConsumer().consume(manager.allocate_resources(token))
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5"


def test_list_manager_reserves_several_kinds_all_or_nothing() -> None:
    clock = FakeClock()
    manager = ListResourceManager({"gpu": [0, 1], "port": ["9000", "9001"]}, clock=clock)
    refused = manager.check_resources({"gpu": 1, "port": 3})
    assert refused.reason == "port 3 > 2 on this site"
    assert manager.report_resources()["free"] == {"gpu": 2, "port": 2}
    token = manager.check_resources({"gpu": 1, "port": 2}).token
    assert manager.allocate_resources(token) == {"gpu": [0], "port": ["9000", "9001"]}


def test_list_manager_restores_several_kinds_all_or_nothing() -> None:
    manager = ListResourceManager({"gpu": [0, 1], "port": ["9000", "9001"]})
    with pytest.raises(FailedPrecondition, match="port unit '9002' is not on this site"):
        manager.restore("t1", {"gpu": [1], "port": ["9002"]})
    with pytest.raises(FailedPrecondition, match="port unit 9000 is not on this site"):
        manager.restore("t1", {"port": [9000]})  # units keep their type: "9000" is not 9000
    assert manager.report_resources()["free"] == {"gpu": 2, "port": 2}
    manager.restore("t1", {"gpu": [1], "port": ["9001"]})
    token = manager.check_resources({"gpu": 1, "port": 1}).token
    assert manager.allocate_resources(token) == {"gpu": [0], "port": ["9000"]}
    assert manager.free_resources("t1")
    assert manager.report_resources()["free"] == {"gpu": 1, "port": 1}


@pytest.mark.parametrize(
    ("resources", "field"),
    [
        ([0, 1], "resources"),
        ({"gpu": 4}, "resources.gpu"),
        ({"gpu": [0, True]}, "resources.gpu"),
        ({"gpu": [0, 1.5]}, "resources.gpu"),
        ({"gpu": [0, 1, 0]}, "resources.gpu"),
        ({"": [0]}, "resources."),
    ],
)
def test_list_manager_refuses_bad_pools(resources: Any, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        ListResourceManager(resources)
    assert err.value.field == field
