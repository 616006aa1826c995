"""Parsing a job's JSON files within bounds: nesting depth, integer length, finite numbers.

Python's `json` accepts what a job must not carry: nesting deep enough to exhaust the
interpreter's recursion (a `RecursionError` instead of a message), integers too long to convert
(a `ValueError`), and `NaN`/`Infinity` (not JSON, and not storable in protobuf). `parse_json`
turns each into one `JsonProblem` line instead. The range of each number is the reader's to
check, where it can name the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

MAX_INT_DIGITS = 100  # a longer integer is refused unconverted (Python stops at 4300 digits)


class JsonProblem(ValueError):
    """Why a file is not acceptable JSON; `str()` is one line."""


def parse_json(content: bytes, *, max_depth: int) -> Any:
    """The parsed value; `JsonProblem` when the text is not UTF-8, not JSON, nested deeper than
    `max_depth` objects/lists, or has an integer of more than MAX_INT_DIGITS digits or a number
    that is not finite."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as err:
        raise JsonProblem(f"is not UTF-8 text (byte {err.start})") from None
    try:
        value = json.loads(
            text,
            parse_int=_integer,
            parse_float=_finite,
            parse_constant=_no_constant,
        )
    except json.JSONDecodeError as err:
        raise JsonProblem(
            f"invalid JSON at line {err.lineno} column {err.colno}: {err.msg}"
        ) from None
    except RecursionError:
        raise JsonProblem(f"is nested deeper than the limit of {max_depth} levels") from None
    found = depth(value)
    if found > max_depth:
        raise JsonProblem(f"is nested {found} levels deep, more than the limit of {max_depth}")
    return value


def depth(value: Any) -> int:
    """How deep objects and lists nest in `value` (a scalar: 0, `{}` or `[]`: 1); iterative,
    so no input can exhaust the recursion limit."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def _integer(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise JsonProblem(f"an integer of {digits} digits is longer than the limit of "
                          f"{MAX_INT_DIGITS}")
    return int(text)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonProblem(f"number {text[:20]}{'...' if len(text) > 20 else ''} is too large "
                          "for a double")
    return value


def _no_constant(name: str) -> Any:
    raise JsonProblem(f"{name} is not a JSON number")
