"""TensorRef / TensorBundle <-> protobuf (`fedhive.v1.TensorRef`, `fedhive.v1.TensorBundle`).

Decoding validates (through `TensorRef.__post_init__`) and reports a bad ref as
`MalformedMessage` naming the field, so nothing downstream sees an inconsistent ref.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from google.protobuf import json_format
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from fedhive.blobs.ref import TensorKind, TensorRef
from fedhive.errors import InvalidArgument, MalformedMessage
from fedhive.proto.v1 import common_pb2

_TO_PROTO = {
    TensorKind.NUMPY: common_pb2.TENSOR_KIND_NUMPY,
    TensorKind.TORCH: common_pb2.TENSOR_KIND_TORCH,
}
_FROM_PROTO = {wire: kind for kind, wire in _TO_PROTO.items()}


def ref_to_proto(ref: TensorRef) -> common_pb2.TensorRef:
    return common_pb2.TensorRef(**_ref_fields(ref), offset=ref.offset,
                                inline_data=bytes(ref.inline_data))


class Attachment:
    """The buffers that a message's attached refs name, in order: sent after the message
    (`fedhive.bus.Encoded.attaching`) instead of inside it."""

    def __init__(self) -> None:
        self.parts: list[bytes | memoryview] = []
        self.size = 0

    def add(self, data: bytes | memoryview) -> int:
        """Append `data`; its offset in the attachment."""
        offset = self.size
        self.parts.append(data)
        self.size += len(data)
        return offset


def add_ref(tensors: RepeatedCompositeFieldContainer[common_pb2.TensorRef], ref: TensorRef,
            attachment: Attachment | None = None) -> None:
    """Append `ref` to a repeated TensorRef field, built in place: appending a built message
    copies it, inline bytes included (upb: about 1 ms per MiB, per copy). With `attachment`,
    inline bytes go there instead (the ref says where: `attached`, `offset`)."""
    if attachment is not None and ref.is_inline and ref.length:
        tensors.add(**_ref_fields(ref), attached=True, offset=attachment.add(ref.inline_data))
    else:
        tensors.add(**_ref_fields(ref), offset=ref.offset, inline_data=bytes(ref.inline_data))


def _ref_fields(ref: TensorRef) -> dict[str, Any]:
    """The fields of `ref` but where its bytes are (`offset`, `inline_data`)."""
    return dict(
        name=ref.name, dtype=ref.dtype, shape=list(ref.shape), kind=_TO_PROTO[ref.kind],
        key=ref.key, url=ref.url, url_expires_at_ms=ref.url_expires_at_ms, length=ref.length,
        checksum=ref.checksum,
    )


def ref_from_proto(message: common_pb2.TensorRef,
                   attachment: bytes | memoryview = b"") -> TensorRef:
    """`message` as a TensorRef; an attached one's bytes are a view of `attachment` (the
    attachment of the message it came in)."""
    kind = _FROM_PROTO.get(message.kind)
    if kind is None:
        raise MalformedMessage(
            f"tensor ref {message.name!r} has no kind (numpy or torch)", field="kind"
        )
    offset = message.offset
    data: bytes | memoryview = message.inline_data
    if message.attached:
        end = offset + message.length
        if message.key or data or not 0 <= offset <= end <= len(attachment):
            raise MalformedMessage(
                f"tensor ref {message.name!r}: attached bytes [{offset}, {end}) are not within "
                f"the message's attachment ({len(attachment)} bytes)", field="offset")
        offset, data = 0, memoryview(attachment)[offset:end]
    try:
        return TensorRef(
            name=message.name, dtype=message.dtype, shape=tuple(message.shape), kind=kind,
            key=message.key, url=message.url, url_expires_at_ms=message.url_expires_at_ms,
            offset=offset, length=message.length, checksum=message.checksum,
            inline_data=data,
        )
    except InvalidArgument as err:
        raise MalformedMessage(err.message, field=err.field) from err


def bundle_to_proto(
    refs: Iterable[TensorRef], meta: Mapping[str, Any] | None = None
) -> common_pb2.TensorBundle:
    """`meta` must be JSON-like (a google.protobuf.Struct: numbers come back as floats)."""
    bundle = common_pb2.TensorBundle()
    for ref in refs:
        add_ref(bundle.tensors, ref)
    if meta:
        bundle.meta.update(dict(meta))
    return bundle


def bundle_from_proto(
    message: common_pb2.TensorBundle,
) -> tuple[list[TensorRef], dict[str, Any]]:
    meta: dict[str, Any] = json_format.MessageToDict(message.meta)
    return [ref_from_proto(ref) for ref in message.tensors], meta
