"""TensorRef <-> protobuf round trips and the validation of refs that enter a process."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedhive.blobs import (
    DTYPES,
    Attachment,
    TensorKind,
    TensorRef,
    add_ref,
    bundle_from_proto,
    bundle_to_proto,
    ref_from_proto,
    ref_to_proto,
)
from fedhive.blobs.dtypes import itemsize
from fedhive.errors import InvalidArgument, MalformedMessage
from fedhive.proto.v1 import common_pb2


@st.composite
def refs(draw: st.DrawFn) -> TensorRef:
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=4)))
    length = math.prod(shape) * itemsize(dtype, "t")
    inline = draw(st.booleans())
    return TensorRef(
        name=draw(st.text(min_size=1, max_size=20)),
        dtype=dtype,
        shape=shape,
        kind=draw(st.sampled_from(list(TensorKind))),
        key="" if inline else draw(st.text(min_size=1, max_size=40)),
        url="" if inline else "http://s3.example/b/k?X-Amz-Signature=abc",
        url_expires_at_ms=0 if inline else draw(st.integers(0, 2**62)),
        offset=0 if inline else draw(st.integers(0, 2**40)),
        length=length,
        checksum="sha256:" + draw(st.text("0123456789abcdef", min_size=64, max_size=64)),
        inline_data=draw(st.binary(min_size=length, max_size=length)) if inline else b"",
    )


@given(refs())
def test_ref_round_trips_through_proto(ref: TensorRef) -> None:
    wire = ref_to_proto(ref).SerializeToString()
    assert ref_from_proto(common_pb2.TensorRef.FromString(wire)) == ref


@given(st.lists(refs(), max_size=5))
def test_bundle_round_trips_with_meta(items: list[TensorRef]) -> None:
    meta = {"round": 3.0, "site": "site-1", "metrics": {"loss": 0.5}}
    wire = bundle_to_proto(items, meta).SerializeToString()
    back, back_meta = bundle_from_proto(common_pb2.TensorBundle.FromString(wire))
    assert back == items
    assert back_meta == meta


def _message(**changes: object) -> common_pb2.TensorRef:
    fields: dict[str, object] = {
        "name": "w", "dtype": "float32", "shape": [2, 3], "kind": common_pb2.TENSOR_KIND_NUMPY,
        "key": "ns/tensors/j/x.shard", "url": "http://h/b/k", "length": 24,
        "checksum": "sha256:" + "0" * 64,
    }
    fields.update(changes)
    return common_pb2.TensorRef(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"kind": common_pb2.TENSOR_KIND_UNSPECIFIED}, "kind"),
        ({"dtype": "float8"}, "dtype"),
        ({"length": 25}, "length"),
        ({"shape": [2, -3]}, "shape"),
        ({"offset": -1}, "offset"),
        ({"inline_data": b"x" * 24}, "inline_data"),
        ({"key": "", "url": ""}, "inline_data"),
        ({"name": ""}, "name"),
    ],
)
def test_malformed_ref_names_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(MalformedMessage) as caught:
        ref_from_proto(_message(**changes))
    assert caught.value.field == field
    assert "\n" not in str(caught.value)


def test_dataclass_rejects_inconsistent_length() -> None:
    with pytest.raises(InvalidArgument, match="'w'"):
        TensorRef(name="w", dtype="int64", shape=(3,), kind=TensorKind.NUMPY, key="k",
                  length=8, checksum="sha256:00")


@given(st.lists(refs(), max_size=5))
def test_refs_with_an_attachment_round_trip_their_inline_bytes_through_it(
    items: list[TensorRef],
) -> None:
    """Inline bytes go to the attachment (stored refs are unchanged); the receiver's refs view
    the attachment it got, copying nothing."""
    bundle, attachment = common_pb2.TensorBundle(), Attachment()
    for ref in items:
        add_ref(bundle.tensors, ref, attachment)
    assert not any(tensor.inline_data for tensor in bundle.tensors)
    received = b"".join(attachment.parts)
    assert len(received) == attachment.size == sum(r.length for r in items if r.is_inline)
    wire = common_pb2.TensorBundle.FromString(bundle.SerializeToString())
    back = [ref_from_proto(tensor, received) for tensor in wire.tensors]
    assert back == items
    assert all(isinstance(ref.inline_data, memoryview) and ref.inline_data.obj is received
               for ref in back if ref.is_inline and ref.length)


@pytest.mark.parametrize(("offset", "length"), [(20, 24), (-4, 24), (0, 44)])
def test_attached_bytes_outside_the_attachment_are_malformed_naming_the_tensor(
    offset: int, length: int,
) -> None:
    """A site's result naming bytes past its attachment (or before it) is refused."""
    message = _message(key="", url="", attached=True, offset=offset, length=length,
                       shape=[length // 4])
    with pytest.raises(MalformedMessage, match="tensor ref 'w': attached bytes .* not within "
                                               r"the message's attachment \(40 bytes\)"):
        ref_from_proto(message, b"x" * 40)
