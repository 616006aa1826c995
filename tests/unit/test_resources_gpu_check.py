"""deploy/gpu_check.py: its checks run against a fake device table here, and the script itself
exits 2 with one line on this machine, which has no NVML library."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.unit.test_resources_contract import FakeDevices
from tests.unit.test_resources_gpu import no_nvml

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_gpus_go_to_two_reservations_and_reach_the_child(gpu_check: ModuleType) -> None:
    report = gpu_check.check(FakeDevices([16.0, 24.0]))
    assert report["ok"] and report["failures"] == []
    assert report["detection"]["count"] == 2
    assert report["detection"]["memory_total_GiB"] == [16.0, 24.0]
    assert "mem_per_gpu_in_GiB=17 but GPU 0 has 16.00 GiB" in report["oversized_config_refused"]
    assert sorted(i for r in report["reservations"] for i in r["gpu"]) == [0, 1]
    seen = sorted(child["seen"]["CUDA_VISIBLE_DEVICES"] for child in report["children"])
    assert seen == ["0", "1"]
    assert report["after_free"]["free"]["num_of_gpus"] == 2


def test_one_gpu_refuses_the_second_reservation(gpu_check: ModuleType) -> None:
    report = gpu_check.check(FakeDevices([16.0]))
    assert report["ok"]
    refused = [r for r in report["reservations"] if not r["ok"]]
    assert [r["reason"] for r in refused] == ["num_of_gpus 1 > 0 with mem_per_gpu_in_GiB 16 free"]
    assert [c["seen"]["CUDA_VISIBLE_DEVICES"] for c in report["children"]] == ["0"]


def test_a_failing_child_fails_the_check(gpu_check: ModuleType) -> None:
    false = shutil.which("false")
    assert false is not None
    report = gpu_check.check(FakeDevices([16.0]), python=false)
    assert not report["ok"]
    assert report["failures"] == ["child exited 1: "]


@no_nvml
def test_script_without_nvml_exits_2_with_one_line() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        "gpu-check: NVML is not available on this machine "
        "(NVML nvmlInit failed: NVML Shared Library Not Found)\n"
    )
