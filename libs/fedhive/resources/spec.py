"""The resource manager and consumer ports (FLARE's `ResourceManagerSpec`, without `fl_ctx`).

A site's resource manager answers the scheduler's "can you run this?" with a reservation token,
turns the token into allocated resources when the job starts and takes them back when it ends.
The consumer turns allocated resources into environment variables for the started job process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedhive.errors import FailedPrecondition

Requirement = Mapping[str, Any]
"""One site's resource requirement from meta.json `resource_spec`, e.g. `{"num_of_gpus": 1}`."""


@dataclass(frozen=True)
class CheckResult:
    """`token` is set only when `ok`; `reason` says what was lacking only when not."""

    ok: bool
    token: str = ""
    reason: str = ""

    @classmethod
    def yes(cls, token: str) -> CheckResult:
        return cls(ok=True, token=token)

    @classmethod
    def no(cls, reason: str) -> CheckResult:
        return cls(ok=False, reason=reason)


class ResourceManagerSpec(ABC):
    """Reservations are identified by the token `check_resources` returns; every call is safe to
    repeat (RPCs may be redelivered) and safe to make from several threads."""

    @abstractmethod
    def check_resources(self, requirement: Requirement) -> CheckResult:
        """Reserve `requirement` if the site has it free. An empty requirement is always ok; a
        malformed one is a "no" whose reason names the key, never an exception."""

    @abstractmethod
    def cancel_resources(self, token: str) -> bool:
        """Release a reservation that was not allocated. Unknown, expired or already allocated
        tokens are a no-op (a late cancel must not take GPUs from a running job).
        Returns whether something was released."""

    @abstractmethod
    def allocate_resources(self, token: str) -> dict[str, Any]:
        """Turn a reservation into an allocation and return the allocated resources (e.g.
        `{"gpu": [0, 2]}`; `{}` for a resource-less job). Allocating the same token again returns
        the same resources. Raises `fedhive.errors.NotFound` for an unknown, cancelled, freed or
        expired token."""

    @abstractmethod
    def free_resources(self, token: str) -> bool:
        """Release whatever `token` holds, reserved or allocated. Repeating it is a no-op.
        Returns whether something was released."""

    @abstractmethod
    def report_resources(self) -> dict[str, Any]:
        """JSON-able totals and free amounts (string keys; goes into heartbeats)."""

    def restore(self, token: str, allocation: Mapping[str, Any]) -> None:
        """After a restart of the site agent, take `allocation` (what `allocate_resources(token)`
        returned before) again under `token`, for a job that is still running: from then on it
        is allocated, as if just allocated, and `free_resources(token)` gives it back. Restoring
        the same again is a no-op. Raises `FailedPrecondition`, holding nothing, when a unit is
        unknown here or not free, or the token holds something else.

        Not abstract, so that a manager written before it still loads: such a manager cannot
        restore, and the agent stops the job it would have re-adopted."""
        raise FailedPrecondition(
            f"resource manager {type(self).__name__} cannot restore an allocation",
            field="resource_manager",
        )


class ResourceConsumerSpec(ABC):
    @abstractmethod
    def consume(self, resources: Mapping[str, Any]) -> dict[str, str]:
        """Environment variables to set on the job process started with `resources` (what
        `allocate_resources` returned). Never touches this process's own environment."""
