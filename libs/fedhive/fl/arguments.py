"""Checks of the arguments a job's config gives an FL component (workflows, aggregators), and of
the numbers a result's meta carries: each returns the value in the form the component keeps, or
raises an InvalidArgument naming the argument and the value it got."""

from __future__ import annotations

import math
import re
from typing import Any

from fedhive.errors import InvalidArgument
from fedhive.fl.dxo import DataKind


def check_kind(value: Any, field_name: str, allowed: tuple[DataKind, ...]) -> DataKind:
    if value not in {kind.value for kind in allowed}:
        raise InvalidArgument(f"{field_name} must be one of "
                              f"{', '.join(kind.value for kind in allowed)}, not {value!r}",
                              field=field_name)
    return DataKind(value)


def check_weights(value: Any, field_name: str) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
            isinstance(site, str) and isinstance(weight, int | float)
            and not isinstance(weight, bool) and math.isfinite(weight) and weight >= 0
            for site, weight in value.items()):
        raise InvalidArgument(f"{field_name} must map site names to numbers >= 0, "
                              f"not {value!r}", field=field_name)
    return {site: float(weight) for site, weight in value.items()}


def check_number(value: Any, field_name: str, unit: str = "") -> float:
    """A finite number >= 0 (of `unit`, " of MiB", as the message says)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value) or value < 0:
        raise InvalidArgument(f"{field_name} must be a number{unit} >= 0, not {value!r}",
                              field=field_name)
    return float(value)


def check_int(value: Any, field_name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(f"{field_name} must be an integer >= {minimum}, not {value!r}",
                              field=field_name)
    return value


def check_regex(value: Any, field_name: str) -> re.Pattern[str] | None:
    """The compiled pattern; None for none (None or empty)."""
    if value is not None and not isinstance(value, str):
        raise InvalidArgument(f"{field_name} must be a regex string, not {value!r}",
                              field=field_name)
    try:
        return re.compile(value) if value else None
    except re.error as err:
        raise InvalidArgument(f"{field_name} is not a valid regex: {err}",
                              field=field_name) from None


def check_flag(value: Any, field_name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{field_name} must be true or false", field=field_name)
    return value


def check_seconds(value: Any, field_name: str) -> float:
    return check_number(value, field_name, " of seconds")


def check_str(value: Any, field_name: str, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty):
        raise InvalidArgument(f"{field_name} must be a {'' if empty else 'non-empty '}string, "
                              f"not {value!r}", field=field_name)
    return value
