"""GPU sharing by memory on a real NVIDIA GPU: GPUResourceManager and GPUResourceConsumer over NVML.

Run on a machine with an NVIDIA driver (from the repository root, fedhive installed):

    .venv/bin/python tests/gpu/nvml_share_check.py [--device N]

It manages one GPU (NVML device N, default 0) with the whole GiB of its memory, then asks for
half of it three times: the first two reservations must land on the same device id and the
third must be refused; a 0-GiB request must still fit (it shares without limit); the consumer,
which checks with NVML that the device exists and has the memory free right now, must give both
jobs the same CUDA_VISIBLE_DEVICES and refuse a device id the host does not have; freeing one
job must let the third in. Prints one JSON object; exit 0 when every check passed, 1 when one
failed, 2 when NVML or the device is not available here. Never run by the test suite.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from fedhive.errors import FedhiveError
from fedhive.logging import configure as configure_logging
from fedhive.resources import (
    GpuDevices,
    GPUResourceConsumer,
    GPUResourceManager,
    NvmlDevices,
    NvmlUnavailable,
)

GiB = 1024**3


def check(devices: GpuDevices, device: int) -> dict[str, Any]:
    failures: list[str] = []
    count = devices.device_count()
    total = devices.memory_total_bytes(device)
    mem_gib = math.floor(total / GiB)
    half = mem_gib / 2
    report: dict[str, Any] = {
        "device": device,
        "device_count": count,
        "memory_total_GiB": round(total / GiB, 3),
        "memory_free_GiB": round(devices.memory_free_bytes(device) / GiB, 3),
        "managed_GiB": mem_gib,
        "asked_GiB_each": half,
    }
    manager = GPUResourceManager(1, mem_gib, device_ids=[device], devices=devices)
    consumer = GPUResourceConsumer(devices=devices)
    requirement = {"num_of_gpus": 1, "mem_per_gpu_in_GiB": half}

    granted: list[tuple[str, dict[str, Any]]] = []
    report["reservations"] = []
    for _ in range(3):
        result = manager.check_resources(requirement)
        entry: dict[str, Any] = {"ok": result.ok, "reason": result.reason}
        if result.ok:
            held = manager.allocate_resources(result.token)
            granted.append((result.token, held))
            entry["allocation"] = held
        report["reservations"].append(entry)
    oks = [r["ok"] for r in report["reservations"]]
    if oks != [True, True, False]:
        failures.append(f"expected two half-memory reservations granted and a third refused, "
                        f"got {oks}")
    ids = [held["gpu"] for _, held in granted]
    if ids != [[device], [device]]:
        failures.append(f"the two reservations did not land on device {device}: {ids}")
    report["after_two"] = manager.report_resources()

    shared = manager.check_resources({"num_of_gpus": 1, "mem_per_gpu_in_GiB": 0})
    report["zero_GiB_request"] = {"ok": shared.ok, "reason": shared.reason}
    if not shared.ok:
        failures.append(f"a 0-GiB request was refused: {shared.reason}")
    else:
        manager.cancel_resources(shared.token)

    report["consumer_env"] = []
    for _, held in granted:
        try:
            env = consumer.consume(held)
        except FedhiveError as err:
            failures.append(f"the consumer refused {held}: {err}")
            continue
        report["consumer_env"].append(env)
        if env.get("CUDA_VISIBLE_DEVICES") != str(device):
            failures.append(f"CUDA_VISIBLE_DEVICES is {env.get('CUDA_VISIBLE_DEVICES')!r}, "
                            f"expected {str(device)!r}")
    try:
        consumer.consume({"gpu": [count], "mem_per_gpu_in_GiB": 0})
        failures.append(f"the consumer accepted device {count}, which the host does not have")
    except FedhiveError as err:
        report["missing_device_refused"] = str(err)
        if str(err) != f"GPU ID {count} does not exist":
            failures.append(f"unexpected refusal of a missing device: {err}")

    if granted:
        manager.free_resources(granted[0][0])
        again = manager.check_resources(requirement)
        report["third_after_free"] = {"ok": again.ok, "reason": again.reason}
        if not again.ok:
            failures.append(f"the third reservation was refused after a free: {again.reason}")
        else:
            manager.free_resources(again.token)
        for token, _ in granted[1:]:
            manager.free_resources(token)
    report["after_free"] = manager.report_resources()
    if report["after_free"]["free"]["num_of_gpus"] != 1:
        failures.append(f"the GPU is not wholly free after freeing: {report['after_free']}")
    report["failures"] = failures
    report["ok"] = not failures
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", type=int, default=0, help="NVML device index (default 0)")
    args = parser.parse_args(argv)
    configure_logging("nvml-share-check", level="WARNING", json=False)  # logs to stderr
    devices = NvmlDevices()
    try:
        try:
            count = devices.device_count()
        except NvmlUnavailable as err:
            sys.stderr.write(f"nvml-share-check: NVML is not available here ({err})\n")
            return 2
        if not 0 <= args.device < count:
            sys.stderr.write(f"nvml-share-check: no NVML device {args.device} "
                             f"(this machine has {count})\n")
            return 2
        report = check(devices, args.device)
    finally:
        devices.close()
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
