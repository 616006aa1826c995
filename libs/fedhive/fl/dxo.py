"""The DXO: what a task carries and what a site sends back (FLARE's Data Exchange Object).

    Dxo(DataKind.WEIGHTS, data={"w": array, ...}, meta={MetaKey.NUM_STEPS_CURRENT_ROUND: 32})

`data` maps names to numpy arrays / torch tensors, or to `TensorRef`s while the DXO is lazy:
a DXO decoded from the wire holds refs, and whoever computes on it calls `materialized` with a
fetcher (the SJ its credentialed store, a site the refs' presigned URLs). A hop that only
forwards a DXO (a relay, the cyclic workflow's next site, the CJ handing a task to a trainer)
passes the refs on unchanged and never touches the bytes. `meta` holds small JSON values.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from fedhive.blobs import (
    Attachment,
    RangeFetcher,
    TensorKind,
    TensorRef,
    add_ref,
    ref_from_proto,
    unpack,
)
from fedhive.errors import MalformedMessage
from fedhive.proto.v1 import task_pb2
from fedhive.structs import dict_to_struct, struct_to_dict


class DataKind(enum.StrEnum):
    WEIGHTS = "WEIGHTS"
    WEIGHT_DIFF = "WEIGHT_DIFF"
    METRICS = "METRICS"
    COLLECTION = "COLLECTION"


class MetaKey:
    """Well-known `meta` keys."""

    NUM_STEPS_CURRENT_ROUND = "NUM_STEPS_CURRENT_ROUND"  # the aggregation weight of a result
    CURRENT_ROUND = "current_round"
    TOTAL_ROUNDS = "total_rounds"
    METRICS = "metrics"  # {name: number} a site reports with its result
    MODEL_OWNER = "model_owner"  # cross-site evaluation: whose model this is


@dataclass
class Dxo:
    data_kind: DataKind
    data: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def is_lazy(self) -> bool:
        """Some values are still refs."""
        return any(isinstance(value, TensorRef) for value in self.data.values())

    def refs(self) -> list[TensorRef]:
        return [value for value in self.data.values() if isinstance(value, TensorRef)]

    def materialized(self, fetcher: RangeFetcher, *, kind: TensorKind | None = None) -> Dxo:
        """A copy whose refs are replaced by the arrays they point at (checksums verified);
        values that were arrays already are kept as they are."""
        refs = self.refs()
        if not refs:
            return replace(self, data=dict(self.data), meta=dict(self.meta))
        fetched = unpack(refs, fetcher, kind=kind)
        data = {name: fetched.get(name, value) if isinstance(value, TensorRef) else value
                for name, value in self.data.items()}
        return Dxo(self.data_kind, data, dict(self.meta))


Packer = Callable[[Mapping[str, Any]], list[TensorRef]]


def dxo_to_proto(dxo: Dxo, pack: Packer, into: task_pb2.Dxo | None = None,
                 attachment: Attachment | None = None) -> task_pb2.Dxo:
    """Refs go on the wire as they are; arrays are turned into refs by `pack` (one call for all
    of them, so small ones share a message and large ones go to storage). `into`: the (empty)
    field of the message being built, filled in place (assigning a built one copies it);
    `attachment`: where inline bytes go, when the message is sent with one."""
    arrays = {name: value for name, value in dxo.data.items() if not isinstance(value, TensorRef)}
    packed = {ref.name: ref for ref in pack(arrays)} if arrays else {}
    message = task_pb2.Dxo() if into is None else into
    message.data_kind = task_pb2.DataKind.Value(f"DATA_KIND_{dxo.data_kind.value}")
    message.meta.CopyFrom(dict_to_struct(dxo.meta))
    for name, value in dxo.data.items():
        add_ref(message.tensors, value if isinstance(value, TensorRef) else packed[name],
                attachment)
    return message


def dxo_from_proto(message: task_pb2.Dxo, attachment: bytes | memoryview = b"") -> Dxo:
    """A lazy DXO (values are refs; attached ones view `attachment`, the message's).
    MalformedMessage for an unset kind or repeated names."""
    kind_name = task_pb2.DataKind.Name(message.data_kind).removeprefix("DATA_KIND_")
    if kind_name not in DataKind.__members__:
        raise MalformedMessage(f"DXO has no valid data_kind ({kind_name})", field="data_kind")
    data: dict[str, Any] = {}
    for item in message.tensors:
        ref = ref_from_proto(item, attachment)
        if ref.name in data:
            raise MalformedMessage(f"DXO repeats tensor {ref.name!r}", field=ref.name)
        data[ref.name] = ref
    return Dxo(DataKind(kind_name), data, struct_to_dict(message.meta))
