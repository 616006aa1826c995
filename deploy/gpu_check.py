"""`make gpu-check`: prove the NVML path of fedhive.resources on a machine with NVIDIA GPUs.

Prints one JSON object: what NVML detected (count, memory per device), two concurrent
reservations of one GPU each (distinct device ids; with a single GPU the second is refused), and
what a child process started with GPUResourceConsumer's environment sees: the variable itself
and, where the CUDA driver library is present, CUDA's own device count under it.
Exit 0 when every check passed, 1 when one failed, 2 when NVML or a GPU is not available here.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from typing import Any

from fedhive.errors import ConfigError
from fedhive.logging import configure as configure_logging
from fedhive.resources import (
    GpuDevices,
    GPUResourceConsumer,
    GPUResourceManager,
    NvmlDevices,
    NvmlUnavailable,
)

GiB = 1024**3

# Runs in the child: reports CUDA_VISIBLE_DEVICES and, through the driver API, how many devices
# CUDA exposes under it (None where libcuda is absent).
CHILD = """
import ctypes, json, os
seen = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), "cuda_device_count": None}
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    cuda = None
if cuda is not None:
    count = ctypes.c_int()
    rc = cuda.cuInit(0) or cuda.cuDeviceGetCount(ctypes.byref(count))
    seen["cuda_device_count"] = count.value if rc == 0 else "CUDA error %d" % rc
print(json.dumps(seen))
"""


def check(devices: GpuDevices, python: str = sys.executable) -> dict[str, Any]:
    failures: list[str] = []
    count = devices.device_count()
    memory = [devices.memory_total_bytes(i) for i in range(count)]
    mem_gib = math.floor(min(memory) / GiB)
    report: dict[str, Any] = {
        "detection": {
            "count": count,
            "memory_total_bytes": memory,
            "memory_total_GiB": [round(m / GiB, 2) for m in memory],
        }
    }
    try:
        GPUResourceManager(count, mem_gib + 1, devices=devices)
        failures.append(f"a manager claiming {mem_gib + 1} GiB per GPU was not refused")
    except ConfigError as err:
        report["oversized_config_refused"] = str(err)
    manager = GPUResourceManager(count, mem_gib, devices=devices)
    consumer = GPUResourceConsumer()

    barrier = threading.Barrier(2)
    results: list[dict[str, Any]] = []

    def reserve() -> None:
        barrier.wait()
        result = manager.check_resources({"num_of_gpus": 1, "mem_per_gpu_in_GiB": mem_gib})
        held = manager.allocate_resources(result.token) if result.ok else {}
        results.append({"ok": result.ok, "reason": result.reason, "token": result.token, **held})

    threads = [threading.Thread(target=reserve) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report["reservations"] = results
    granted = [r for r in results if r["ok"]]
    ids = [i for r in granted for i in r["gpu"]]
    if len(granted) != min(2, count):
        failures.append(f"{len(granted)} of 2 reservations granted with {count} GPU(s)")
    if len(ids) != len(set(ids)):
        failures.append(f"two reservations received the same GPU: {ids}")

    report["children"] = []
    for reservation in granted:
        env = consumer.consume({"gpu": reservation["gpu"]})
        # Only the consumer's variables: the child must not inherit a CUDA_VISIBLE_DEVICES.
        child = subprocess.run(
            [python, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60
        )
        if child.returncode != 0:
            failures.append(f"child exited {child.returncode}: {child.stderr.strip()[-300:]}")
            continue
        seen = json.loads(child.stdout)
        report["children"].append({"env": env, "seen": seen})
        if seen["CUDA_VISIBLE_DEVICES"] != env["CUDA_VISIBLE_DEVICES"]:
            failures.append(f"child saw {seen['CUDA_VISIBLE_DEVICES']!r}, expected {env}")
        cuda_count = seen["cuda_device_count"]
        if cuda_count is not None and cuda_count != len(reservation["gpu"]):
            failures.append(f"CUDA in the child exposes {cuda_count} device(s), expected 1")

    for reservation in granted:
        manager.free_resources(reservation["token"])
    report["after_free"] = manager.report_resources()
    if report["after_free"]["free"]["num_of_gpus"] != count:
        failures.append(f"not every GPU is free after freeing: {report['after_free']}")
    report["failures"] = failures
    report["ok"] = not failures
    return report


def main() -> int:
    configure_logging("gpu-check", level="WARNING", json=False)  # logs to stderr, JSON to stdout
    devices = NvmlDevices()
    try:
        try:
            count = devices.device_count()
        except NvmlUnavailable as err:
            sys.stderr.write(f"gpu-check: NVML is not available on this machine ({err})\n")
            return 2
        if count == 0:
            sys.stderr.write("gpu-check: NVML reports no GPU on this machine\n")
            return 2
        report = check(devices)
    finally:
        devices.close()
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
