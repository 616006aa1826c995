"""GPUs shared by memory, as FLARE's GPUResourceManager and GPUResourceConsumer share them.

The manager holds `num_of_gpus` GPUs with `mem_per_gpu_in_GiB` each (checked with NVML at
start, then assumed, as in FLARE: other processes' use of the memory is not tracked). A
requirement `{"num_of_gpus": n, "mem_per_gpu_in_GiB": m}` is met by n distinct GPUs that each
have at least m GiB not yet reserved: the first n such GPUs in id order get m GiB reserved on
each, and the allocation is `{"gpu": [ids], "mem_per_gpu_in_GiB": m}`. So two jobs whose memory
fits one GPU share it: both get its device id, hence the same CUDA_VISIBLE_DEVICES. The memory
comes back when the job's resources are freed, or when its reservation expires unallocated.
`m` missing or 0 asks for no memory: such a request takes the first n GPUs and never uses up
capacity, so any number of them share without limit (FLARE's semantics; a job that wants a
device to itself asks for all of its memory). Amounts are added and subtracted exactly
(as decimal fractions: ten jobs of 0.1 GiB fit in 1 GiB, and memory never drifts however
many jobs came and went).

The consumer turns an allocation into `CUDA_VISIBLE_DEVICES`. For the manager's allocations
(which carry their memory amount) it first checks the host with NVML, as FLARE's consumer does
with nvidia-smi: a device id the host does not have → "GPU ID <id> does not exist"; less memory
free on a device right now than the amount → "GPU free mem is not enough" (`FailedPrecondition`:
the job fails to start). A plain list of ids, ListResourceManager's `{"gpu": [0, 1]}`, is used
as given, as FLARE's ListResourceConsumer does.

An allocation from before memory sharing, `{"gpu": [ids]}` without an amount (whole devices),
is restored after a site-agent restart as the whole memory of each of its devices.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from fractions import Fraction
from typing import Any

import structlog

from fedhive.errors import ConfigError, FailedPrecondition, InvalidArgument
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
MEM_FREE = "mem_in_GiB"  # report key: {device id as a string: GiB not reserved}
GiB = 1024**3

log = structlog.get_logger()


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
        self._capacity = _gib(self._mem)
        self._unreserved = {index: self._capacity for index in self._ids}  # GiB, exact

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
        fitting = len(self._fitting(_gib(mem)))
        if wanted > fitting:
            return f"{NUM_GPUS} {wanted} > {fitting} with {MEM_PER_GPU} {mem:g} free"
        return None

    def _take(self, requirement: Requirement) -> dict[str, Any]:
        wanted: int = requirement[NUM_GPUS]
        if wanted == 0:
            return {}
        mem = float(requirement.get(MEM_PER_GPU, 0))
        ids = self._fitting(_gib(mem))[:wanted]
        for index in ids:
            self._unreserved[index] -= _gib(mem)
        return {GPU_KEY: ids, MEM_PER_GPU: mem}

    def _put_back(self, held: dict[str, Any]) -> None:
        amount = _gib(held.get(MEM_PER_GPU, self._mem))  # no amount: whole devices
        for index in held[GPU_KEY]:
            self._unreserved[index] += amount

    def _claim(self, held: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
        ids = held.get(GPU_KEY)
        if not set(held) <= {GPU_KEY, MEM_PER_GPU} or not isinstance(ids, list) or not ids or (
            not all(_is_device_id(i) for i in ids)
        ):
            return {}, (f"a GPU allocation is {{{GPU_KEY!r}: [device ids], "
                        f"{MEM_PER_GPU!r}: GiB on each}}")
        mem = held.get(MEM_PER_GPU, self._mem)
        if (problem := amount_problem(MEM_PER_GPU, mem)) is not None:
            return {}, problem
        wanted = [int(i) for i in ids]
        if len(set(wanted)) != len(wanted):
            return {}, f"it lists a GPU twice: {wanted}"
        amount = _gib(mem)
        for index in wanted:
            if index not in self._unreserved:
                return {}, f"GPU {index} is not managed on this site (managed: {self._ids})"
            if self._unreserved[index] < amount:
                return {}, (f"{mem:g} GiB of GPU {index} are not free "
                            f"({float(self._unreserved[index]):g} GiB are)")
        for index in wanted:
            self._unreserved[index] -= amount
        if MEM_PER_GPU not in held:
            return {GPU_KEY: wanted}, None  # kept as it was: restoring it again is a no-op
        return {GPU_KEY: wanted, MEM_PER_GPU: float(mem)}, None

    def _fitting(self, mem: Fraction) -> list[int]:
        """The managed GPUs, in id order, with at least `mem` GiB not reserved."""
        return [index for index in self._ids if self._unreserved[index] >= mem]

    def _totals(self) -> dict[str, Any]:
        return {NUM_GPUS: self._num, MEM_PER_GPU: self._mem, GPU_KEY: list(self._ids)}

    def _free(self) -> dict[str, Any]:
        """`num_of_gpus` and `gpu`: the GPUs with none of their memory reserved; `mem_in_GiB`:
        what is not reserved on each GPU."""
        whole = [i for i in self._ids if self._unreserved[i] == self._capacity]
        return {
            NUM_GPUS: len(whole),
            GPU_KEY: whole,
            MEM_FREE: {str(i): float(self._unreserved[i]) for i in self._ids},
        }


class GPUResourceConsumer(ResourceConsumerSpec):
    def __init__(self, isolate: bool = False, *, devices: GpuDevices | None = None) -> None:
        """With `isolate`, a job allocated no GPU gets `CUDA_VISIBLE_DEVICES=""` so it cannot
        use GPUs held by other jobs; by default (as in FLARE) its environment is left alone.
        `devices` stands in for NVML (tests); by default NVML is opened for each check."""
        if not isinstance(isolate, bool):
            raise ConfigError(f"isolate must be true or false, got {isolate!r}", field="isolate")
        self._isolate = isolate
        self._devices = devices

    def consume(self, resources: Mapping[str, Any]) -> dict[str, str]:
        ids = resources.get(GPU_KEY) or []
        if not isinstance(ids, list) or not all(_is_device_id(i) for i in ids):
            raise InvalidArgument(
                f"allocation key {GPU_KEY!r} must be a list of device ids, got {ids!r}",
                field=GPU_KEY,
            )
        if not ids:
            return {"CUDA_VISIBLE_DEVICES": ""} if self._isolate else {}
        if MEM_PER_GPU in resources:  # GPUResourceManager's: check the host as FLARE does
            mem = resources[MEM_PER_GPU]
            if (problem := amount_problem(MEM_PER_GPU, mem)) is not None:
                raise InvalidArgument(f"allocation key {problem}", field=MEM_PER_GPU)
            _check_free(self._devices, [int(i) for i in ids], float(mem))
        return {
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": ",".join(str(int(i)) for i in ids),
        }


def _gib(amount: float) -> Fraction:
    """An amount of GiB as the decimal number it was written as (`0.1` is 1/10, not the binary
    float nearest to it), so that sums and differences are exact."""
    return Fraction(repr(float(amount)))


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


@contextmanager
def _opened(devices: GpuDevices | None) -> Iterator[GpuDevices]:
    """`devices`, or NVML opened for the block and shut down after it."""
    if devices is not None:
        yield devices
        return
    nvml = NvmlDevices()
    try:
        yield nvml
    finally:
        nvml.close()


def _check_host(devices: GpuDevices | None, ids: list[int], mem_gib: float) -> None:
    try:
        with _opened(devices) as probe:
            present = probe.device_count()
            for index in ids:
                if index >= present:
                    raise ConfigError(
                        f"{NUM_GPUS}={len(ids)} needs GPU {index} but this machine has "
                        f"{present} GPU(s)",
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


def _check_free(devices: GpuDevices | None, ids: list[int], mem_gib: float) -> None:
    """FLARE's consumer checks, with its messages: every device exists on this host and has
    `mem_gib` free right now."""
    try:
        with _opened(devices) as probe:
            present = probe.device_count()
            for index in ids:
                if index >= present:
                    raise FailedPrecondition(f"GPU ID {index} does not exist", field=GPU_KEY)
                free = probe.memory_free_bytes(index)
                if mem_gib * GiB > free:
                    log.warning("resources.gpu_memory_short", gpu=index,
                                free_GiB=round(free / GiB, 2), wanted_GiB=mem_gib)
                    raise FailedPrecondition("GPU free mem is not enough", field=GPU_KEY)
    except NvmlUnavailable as err:
        raise FailedPrecondition(f"GPUs cannot be detected: {err}", field=GPU_KEY) from err
