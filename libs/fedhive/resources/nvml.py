"""GPU detection: a two-method port and its NVML adapter (the `nvidia-ml-py` package).

Device indices are NVML's, which follow PCI bus order; the consumer sets
`CUDA_DEVICE_ORDER=PCI_BUS_ID` so CUDA numbers the devices the same way.
"""

from __future__ import annotations

from typing import Any, Protocol


class GpuDevices(Protocol):
    def device_count(self) -> int: ...

    def memory_total_bytes(self, index: int) -> int: ...

    def memory_free_bytes(self, index: int) -> int:
        """Memory not in use right now, by any process (NVML's `free`)."""
        ...


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here: no driver library, no driver, or no permission."""


class NvmlDevices:
    """Initialises NVML on first use (so merely building one needs no GPU); `close()` shuts it
    down again."""

    def __init__(self) -> None:
        self._initialised = False

    def device_count(self) -> int:
        self._init()
        return int(self._call("nvmlDeviceGetCount"))

    def memory_total_bytes(self, index: int) -> int:
        self._init()
        handle = self._call("nvmlDeviceGetHandleByIndex", index)
        return int(self._call("nvmlDeviceGetMemoryInfo", handle).total)

    def memory_free_bytes(self, index: int) -> int:
        self._init()
        handle = self._call("nvmlDeviceGetHandleByIndex", index)
        return int(self._call("nvmlDeviceGetMemoryInfo", handle).free)

    def close(self) -> None:
        if self._initialised:
            self._initialised = False
            self._call("nvmlShutdown")

    def _init(self) -> None:
        if not self._initialised:
            self._call("nvmlInit")
            self._initialised = True

    @staticmethod
    def _call(name: str, *args: Any) -> Any:
        import pynvml  # on first use: the many processes that never read a GPU skip its import

        try:
            return getattr(pynvml, name)(*args)
        except pynvml.NVMLError as err:
            raise NvmlUnavailable(f"NVML {name} failed: {err}") from err
