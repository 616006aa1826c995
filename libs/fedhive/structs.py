"""JSON-like dicts to and from `google.protobuf.Struct`, keeping whole numbers as ints.

Struct stores every number as a double; values that are whole (and exactly representable) come
back as `int`, so resource counts and similar fields keep their type across the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format, struct_pb2


def dict_to_struct(values: Mapping[str, Any]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(values)
    return struct


def struct_to_dict(struct: struct_pb2.Struct) -> dict[str, Any]:
    result: dict[str, Any] = _whole_numbers(json_format.MessageToDict(struct))
    return result


def _whole_numbers(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if isinstance(value, dict):
        return {key: _whole_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_whole_numbers(item) for item in value]
    return value
