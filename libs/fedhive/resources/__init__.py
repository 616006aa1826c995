"""Site resources: managers that reserve/allocate/free, consumers that turn allocations into
the started job's environment, and the resources.json loader (seed 001, FLARE's spec)."""

from fedhive.resources.auto_clean import (
    DEFAULT_EXPIRATION_S,
    EMPTY_TOKEN_PREFIX,
    AutoCleanResourceManager,
    Clock,
)
from fedhive.resources.gpu import GPUResourceConsumer, GPUResourceManager
from fedhive.resources.listed import ListResourceManager
from fedhive.resources.loader import SiteResources, build_resources, load_resources
from fedhive.resources.nvml import GpuDevices, NvmlDevices, NvmlUnavailable
from fedhive.resources.spec import (
    CheckResult,
    Requirement,
    ResourceConsumerSpec,
    ResourceManagerSpec,
)

__all__ = [
    "DEFAULT_EXPIRATION_S",
    "EMPTY_TOKEN_PREFIX",
    "AutoCleanResourceManager",
    "CheckResult",
    "Clock",
    "GPUResourceConsumer",
    "GPUResourceManager",
    "GpuDevices",
    "ListResourceManager",
    "NvmlDevices",
    "NvmlUnavailable",
    "Requirement",
    "ResourceConsumerSpec",
    "ResourceManagerSpec",
    "SiteResources",
    "build_resources",
    "load_resources",
]
