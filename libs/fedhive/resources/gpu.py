"""GPUs as whole devices: each managed GPU is held by at most one job at a time.

Unlike FLARE's manager, which shares a GPU between jobs while their memory requests fit (and
lets `mem_per_gpu_in_GiB: 0` requests share without limit), a device id is handed to one job
only: concurrent jobs never receive the same GPU. `mem_per_gpu_in_GiB` in a requirement asks for
GPUs with at least that much memory; every managed GPU has the configured amount (checked with
NVML at start, then assumed, as in FLARE: other processes' use of the GPU is not tracked).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from fedhive.errors import ConfigError, InvalidArgument
from fedhive.resources.auto_clean import DEFAULT_EXPIRATION_S, AutoCleanResourceManager, Clock
from fedhive.resources.nvml import GpuDevices, NvmlDevices, NvmlUnavailable
from fedhive.resources.requirements import (
    amount_problem,
    count_problem,
    require_amount,
    require_count,
    unknown_key,
)
from fedhive.resources.spec import Requirement, ResourceConsumerSpec

NUM_GPUS = "num_of_gpus"
MEM_PER_GPU = "mem_per_gpu_in_GiB"
GPU_KEY = "gpu"  # allocation key: the list of device ids (the same key ListResourceManager uses)
GiB = 1024**3


class GPUResourceManager(AutoCleanResourceManager):
    def __init__(
        self,
        num_of_gpus: int,
        mem_per_gpu_in_GiB: float,  # FLARE's resources.json argument name
        *,
        device_ids: list[int] | None = None,
        expiration_period: float = DEFAULT_EXPIRATION_S,
        devices: GpuDevices | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        """Manage `num_of_gpus` GPUs with `mem_per_gpu_in_GiB` each: the NVML devices listed in
        `device_ids`, or the first `num_of_gpus`. Raises ConfigError when the machine has fewer
        or smaller GPUs. `num_of_gpus=0` never touches NVML."""
        super().__init__(expiration_period=expiration_period, clock=clock)
        self._num = require_count(NUM_GPUS, num_of_gpus)
        self._mem = require_amount(MEM_PER_GPU, mem_per_gpu_in_GiB)
        self._ids = _device_ids(device_ids, self._num)
        if self._num:
            _check_host(devices, self._ids, self._mem)
        self._free_ids = list(self._ids)

    def _invalid(self, requirement: Requirement) -> str | None:
        if (reason := unknown_key(requirement, (NUM_GPUS, MEM_PER_GPU))) is not None:
            return reason
        if NUM_GPUS not in requirement:
            return f"{MEM_PER_GPU} given without {NUM_GPUS}"
        if (reason := count_problem(NUM_GPUS, requirement[NUM_GPUS])) is not None:
            return reason
        return amount_problem(MEM_PER_GPU, requirement.get(MEM_PER_GPU, 0))

    def _shortfall(self, requirement: Requirement) -> str | None:
        wanted = requirement[NUM_GPUS]
        mem = requirement.get(MEM_PER_GPU, 0)
        if wanted == 0:
            return None
        if wanted > self._num:
            return f"{NUM_GPUS} {wanted} > {self._num} on this site"
        if mem > self._mem:
            return f"{MEM_PER_GPU} {mem:g} > {self._mem:g} per GPU on this site"
        if wanted > len(self._free_ids):
            return f"{NUM_GPUS} {wanted} > {len(self._free_ids)} free"
        return None

    def _take(self, requirement: Requirement) -> dict[str, Any]:
        wanted: int = requirement[NUM_GPUS]
        if wanted == 0:
            return {}
        taken, self._free_ids = self._free_ids[:wanted], self._free_ids[wanted:]
        return {GPU_KEY: taken}

    def _put_back(self, held: dict[str, Any]) -> None:
        self._free_ids = sorted([*self._free_ids, *held[GPU_KEY]])

    def _claim(self, held: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
        ids = held.get(GPU_KEY)
        if set(held) != {GPU_KEY} or not isinstance(ids, list) or not ids or not all(
            _is_device_id(i) for i in ids
        ):
            return {}, f"a GPU allocation is {{{GPU_KEY!r}: [device ids]}}"
        wanted = [int(i) for i in ids]
        if len(set(wanted)) != len(wanted):
            return {}, f"it lists a GPU twice: {wanted}"
        for index in wanted:
            if index not in self._ids:
                return {}, f"GPU {index} is not managed on this site (managed: {self._ids})"
            if index not in self._free_ids:
                return {}, f"GPU {index} is not free"
        self._free_ids = [i for i in self._free_ids if i not in wanted]
        return {GPU_KEY: wanted}, None

    def _totals(self) -> dict[str, Any]:
        return {NUM_GPUS: self._num, MEM_PER_GPU: self._mem, GPU_KEY: list(self._ids)}

    def _free(self) -> dict[str, Any]:
        return {NUM_GPUS: len(self._free_ids), GPU_KEY: list(self._free_ids)}


class GPUResourceConsumer(ResourceConsumerSpec):
    def __init__(self, isolate: bool = False) -> None:
        """With `isolate`, a job allocated no GPU gets `CUDA_VISIBLE_DEVICES=""` so it cannot
        use GPUs held by other jobs; by default (as in FLARE) its environment is left alone."""
        if not isinstance(isolate, bool):
            raise ConfigError(f"isolate must be true or false, got {isolate!r}", field="isolate")
        self._isolate = isolate

    def consume(self, resources: Mapping[str, Any]) -> dict[str, str]:
        ids = resources.get(GPU_KEY) or []
        if not isinstance(ids, list) or not all(_is_device_id(i) for i in ids):
            raise InvalidArgument(
                f"allocation key {GPU_KEY!r} must be a list of device ids, got {ids!r}",
                field=GPU_KEY,
            )
        if not ids:
            return {"CUDA_VISIBLE_DEVICES": ""} if self._isolate else {}
        return {
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": ",".join(str(int(i)) for i in ids),
        }


def _is_device_id(value: object) -> bool:
    # Integral floats are accepted: allocations that crossed a protobuf Struct come back as floats.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return value >= 0 and float(value).is_integer()


def _device_ids(device_ids: list[int] | None, num: int) -> list[int]:
    if device_ids is None:
        return list(range(num))
    if not isinstance(device_ids, list) or any(count_problem("", i) for i in device_ids):
        raise ConfigError(
            f"device_ids must be a list of integers >= 0, got {device_ids!r}", field="device_ids"
        )
    if len(set(device_ids)) != len(device_ids) or len(device_ids) != num:
        raise ConfigError(
            f"device_ids {device_ids} must list {num} distinct ids ({NUM_GPUS} is {num})",
            field="device_ids",
        )
    return sorted(device_ids)


def _check_host(devices: GpuDevices | None, ids: list[int], mem_gib: float) -> None:
    own = devices is None
    probe = NvmlDevices() if devices is None else devices
    try:
        present = probe.device_count()
        for index in ids:
            if index >= present:
                raise ConfigError(
                    f"{NUM_GPUS}={len(ids)} needs GPU {index} but this machine has {present} "
                    f"GPU(s)",
                    field=NUM_GPUS,
                )
            total = probe.memory_total_bytes(index)
            if mem_gib * GiB > total:
                raise ConfigError(
                    f"{MEM_PER_GPU}={mem_gib:g} but GPU {index} has {total / GiB:.2f} GiB",
                    field=MEM_PER_GPU,
                )
    except NvmlUnavailable as err:
        raise ConfigError(
            f"{NUM_GPUS}={len(ids)} but GPUs cannot be detected: {err}", field=NUM_GPUS
        ) from err
    finally:
        if own:
            assert isinstance(probe, NvmlDevices)
            probe.close()
