"""Checks of requirement values and constructor arguments shared by the managers.

Requirement checks return a reason (a "no" for the scheduler) instead of raising: a bad
resource_spec is the job author's mistake, reported back, not a site failure. Constructor
checks raise `ConfigError` naming the argument: they come from the operator's resources.json.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from fedhive.errors import ConfigError
from fedhive.resources.spec import Requirement


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # bool is an int in Python


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)  # type: ignore[arg-type]


def unknown_key(requirement: Requirement, known: Iterable[str]) -> str | None:
    allowed = sorted(known)
    for key in requirement:
        if key not in allowed:
            return f"unknown requirement key {key!r} (known: {', '.join(allowed) or 'none'})"
    return None


def count_problem(key: str, value: object) -> str | None:
    """Reason why `value` is not a count (an int >= 0), or None."""
    if _is_int(value) and value >= 0:  # type: ignore[operator]
        return None
    return f"{key} must be an integer >= 0, got {value!r}"


def amount_problem(key: str, value: object) -> str | None:
    """Reason why `value` is not an amount (a finite int or float >= 0), or None."""
    if _is_number(value) and value >= 0:  # type: ignore[operator]
        return None
    return f"{key} must be a number >= 0, got {value!r}"


def require_count(name: str, value: object) -> int:
    if (problem := count_problem(name, value)) is not None:
        raise ConfigError(problem, field=name)
    assert isinstance(value, int)
    return value


def require_amount(name: str, value: object) -> float:
    if (problem := amount_problem(name, value)) is not None:
        raise ConfigError(problem, field=name)
    assert isinstance(value, int | float)
    return float(value)


def require_positive_seconds(name: str, value: object) -> float:
    if not (_is_number(value) and value > 0):  # type: ignore[operator]
        raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}", field=name)
    assert isinstance(value, int | float)
    return float(value)
