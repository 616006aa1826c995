"""The base of fedhive's managers: reservations that expire, under one lock.

A scheduler that dies between check and allocate must not leak a site's GPUs, so a reservation
lives `expiration_period` seconds; expired ones are released lazily at the start of every call
(no timer thread: nothing can observe the pool without making a call, and a fake clock makes
expiry testable without sleeping).

Invariant, kept under `_lock`: every unit of the pool is in exactly one place: free (owned by
the subclass), one reservation in `_reserved`, or one allocation in `_allocated`. A token is in
at most one of the two tables. Subclass hooks are always called with the lock held.
"""

from __future__ import annotations

import copy
import time
import uuid
from abc import abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from threading import Lock
from typing import Any

import structlog

from fedhive.errors import ConfigError, FailedPrecondition, NotFound
from fedhive.resources.requirements import require_positive_seconds
from fedhive.resources.spec import CheckResult, Requirement, ResourceManagerSpec

Clock = Callable[[], float]
"""Monotonic seconds (`time.monotonic` by default)."""

DEFAULT_EXPIRATION_S = 60.0

# A reservation that holds nothing cannot leak, so it is not tracked and never expires: its
# token carries this prefix and allocates to `{}` whenever it is used.
EMPTY_TOKEN_PREFIX = "none-"

log = structlog.get_logger()


@dataclass
class _Reservation:
    held: dict[str, Any]
    deadline: float


class AutoCleanResourceManager(ResourceManagerSpec):
    def __init__(
        self, *, expiration_period: float = DEFAULT_EXPIRATION_S, clock: Clock = time.monotonic
    ) -> None:
        self._expiration = require_positive_seconds("expiration_period", expiration_period)
        if not callable(clock):
            raise ConfigError(f"clock must be callable, got {clock!r}", field="clock")
        self._clock = clock
        self._lock = Lock()
        self._reserved: dict[str, _Reservation] = {}
        self._allocated: dict[str, dict[str, Any]] = {}

    # -- hooks for subclasses (called with the lock held, except _invalid) ---------------------

    @abstractmethod
    def _invalid(self, requirement: Requirement) -> str | None:
        """Why the requirement is malformed (naming the key), or None. Pure: no lock needed."""

    @abstractmethod
    def _shortfall(self, requirement: Requirement) -> str | None:
        """What the free pool lacks for a valid requirement, or None when it suffices."""

    @abstractmethod
    def _take(self, requirement: Requirement) -> dict[str, Any]:
        """Remove what the requirement needs from the free pool; `{}` when it needs nothing."""

    @abstractmethod
    def _put_back(self, held: dict[str, Any]) -> None:
        """Return what `_take` took to the free pool."""

    @abstractmethod
    def _claim(self, held: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
        """Remove exactly the units of `held` (an allocation from before a restart) from the
        free pool: what was taken, in `_take`'s form, and None; or `{}` and why not (a unit
        unknown or not free, a malformed allocation), with nothing taken."""

    @abstractmethod
    def _totals(self) -> dict[str, Any]: ...

    @abstractmethod
    def _free(self) -> dict[str, Any]: ...

    # -- the spec -------------------------------------------------------------------------------

    def check_resources(self, requirement: Requirement) -> CheckResult:
        if not isinstance(requirement, Mapping):
            return CheckResult.no(f"requirement must be a dict, got {type(requirement).__name__}")
        if not requirement:
            return CheckResult.yes(EMPTY_TOKEN_PREFIX + uuid.uuid4().hex)
        if (reason := self._invalid(requirement)) is not None:
            return CheckResult.no(reason)
        with self._lock:
            self._expire()
            if (reason := self._shortfall(requirement)) is not None:
                log.info("resources.check.no", requirement=dict(requirement), reason=reason)
                return CheckResult.no(reason)
            held = self._take(requirement)
            if not held:
                return CheckResult.yes(EMPTY_TOKEN_PREFIX + uuid.uuid4().hex)
            token = uuid.uuid4().hex
            self._reserved[token] = _Reservation(held, self._clock() + self._expiration)
        log.info("resources.reserved", token=token, resources=held)
        return CheckResult.yes(token)

    def cancel_resources(self, token: str) -> bool:
        with self._lock:
            self._expire()
            reservation = self._reserved.pop(token, None)
            if reservation is None:
                return False
            self._put_back(reservation.held)
        log.info("resources.cancelled", token=token, resources=reservation.held)
        return True

    def allocate_resources(self, token: str) -> dict[str, Any]:
        if token.startswith(EMPTY_TOKEN_PREFIX):
            return {}
        with self._lock:
            self._expire()
            held = self._allocated.get(token)
            if held is None:
                reservation = self._reserved.pop(token, None)
                if reservation is None:
                    raise NotFound(
                        f"no reservation for token {token!r}: unknown, cancelled, freed or "
                        f"expired (reservations live {self._expiration:g} s)",
                        field="token",
                    )
                held = self._allocated[token] = reservation.held
                log.info("resources.allocated", token=token, resources=held)
            return copy.deepcopy(held)

    def free_resources(self, token: str) -> bool:
        with self._lock:
            self._expire()
            held = self._allocated.pop(token, None)
            if held is None:
                reservation = self._reserved.pop(token, None)
                if reservation is None:
                    return False
                held = reservation.held
            self._put_back(held)
        log.info("resources.freed", token=token, resources=held)
        return True

    def restore(self, token: str, allocation: Mapping[str, Any]) -> None:
        if token.startswith(EMPTY_TOKEN_PREFIX) or allocation == {}:
            return  # nothing was held: nothing to take again
        if not isinstance(allocation, Mapping):
            raise FailedPrecondition(f"allocation of token {token!r} must be a dict, got "
                                     f"{allocation!r}", field="allocation")
        with self._lock:
            self._expire()
            held = self._allocated.get(token)
            if held is not None:
                if held == allocation:
                    return  # restored before
                raise FailedPrecondition(
                    f"token {token!r} already holds {held}, not {dict(allocation)}", field="token")
            if token in self._reserved:
                raise FailedPrecondition(f"token {token!r} is a reservation, not an allocation",
                                         field="token")
            taken, problem = self._claim(allocation)
            if problem is not None:
                raise FailedPrecondition(f"cannot restore {dict(allocation)} of token {token!r}: "
                                         f"{problem}", field="allocation")
            self._allocated[token] = taken
        log.info("resources.restored", token=token, resources=taken)

    def report_resources(self) -> dict[str, Any]:
        with self._lock:
            self._expire()
            return {
                "total": self._totals(),
                "free": self._free(),
                "reservations": len(self._reserved),
                "allocations": len(self._allocated),
            }

    def _expire(self) -> None:
        now = self._clock()
        for token in [t for t, r in self._reserved.items() if r.deadline <= now]:
            reservation = self._reserved.pop(token)
            self._put_back(reservation.held)
            log.warning(
                "resources.reservation_expired",
                token=token,
                resources=reservation.held,
                after_s=self._expiration,
            )
