"""Pure pieces of the blobs package: gather reads, read planning, dtypes, error translation."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedhive.blobs import BlobLocation, bfloat16_bits_to_float32
from fedhive.blobs.checksum import hasher_for
from fedhive.blobs.dtypes import bytes_to_numpy, numpy_to_bytes
from fedhive.blobs.failures import parse_error_document, s3_failure
from fedhive.blobs.transfer import GatherReader, Segment, plan_reads, slice_views
from fedhive.errors import (
    AlreadyExists,
    BlobAccessDenied,
    BlobNotFound,
    FedhiveError,
    InvalidArgument,
    Unavailable,
)


@given(st.lists(st.binary(max_size=50), max_size=6), st.lists(st.integers(1, 40), max_size=20))
def test_gather_reader_streams_the_concatenation(parts: list[bytes], sizes: list[int]) -> None:
    joined = b"".join(parts)
    reader = GatherReader([memoryview(p) for p in parts])
    assert len(reader) == len(joined)
    got = b"".join(reader.read(n) for n in sizes) + reader.read()
    assert got == joined
    reader.seek(0)
    assert reader.read() == joined
    reader.seek(-3, io.SEEK_END)
    assert reader.tell() == max(0, len(joined) - 3)


@given(st.lists(st.binary(max_size=30), max_size=5), st.integers(0, 100), st.integers(0, 100))
def test_slice_views_covers_exactly_the_range(parts: list[bytes], a: int, b: int) -> None:
    start, stop = sorted((a, b))
    pieces = slice_views([memoryview(p) for p in parts], start, stop)
    assert b"".join(bytes(p) for p in pieces) == b"".join(parts)[start:stop]


def test_plan_merges_neighbours_and_splits_at_part_size() -> None:
    shard, big = BlobLocation("ns/shard"), BlobLocation("ns/big")
    buffers = [bytearray(n) for n in (3, 4, 5, 0, 10)]
    segments = [
        Segment(shard, 8, memoryview(buffers[1]), 1),  # given out of object order
        Segment(shard, 0, memoryview(buffers[0]), 0),
        Segment(shard, 3, memoryview(buffers[3]), 3),  # empty: no bytes to read
        Segment(shard, 3, memoryview(buffers[2]), 2),  # 3..8 follows 0..3: merged
        Segment(big, 0, memoryview(buffers[4]), 4),
    ]
    reads = plan_reads(segments, part_size=6)
    layout = [(r.where.key, r.offset, r.size, [(len(p), t) for p, t in r.pieces]) for r in reads]
    assert layout == [
        ("ns/shard", 0, 6, [(3, 0), (3, 2)]),
        ("ns/shard", 6, 6, [(2, 2), (4, 1)]),
        ("ns/big", 0, 6, [(6, 4)]),
        ("ns/big", 6, 4, [(4, 4)]),
    ]


def test_plan_keeps_a_gap_as_two_reads() -> None:
    where = BlobLocation("k")
    segments = [Segment(where, at, memoryview(bytearray(2))) for at in (0, 5)]
    assert [(r.offset, r.size) for r in plan_reads(segments, 100)] == [(0, 2), (5, 2)]


def test_non_contiguous_and_big_endian_arrays_become_little_endian_c_order() -> None:
    array = np.arange(24, dtype=">i4").reshape(4, 6)[:, ::2].T
    flat, dtype = numpy_to_bytes("x", array)
    assert dtype == "int32"
    assert flat.tobytes() == np.ascontiguousarray(array, dtype="<i4").tobytes()
    back = bytes_to_numpy(flat, dtype, array.shape)
    assert np.array_equal(back, array)


def test_unsupported_numpy_dtype_is_rejected_by_name() -> None:
    with pytest.raises(InvalidArgument, match="'labels'"):
        numpy_to_bytes("labels", np.array(["a", "b"]))


def test_bfloat16_bits_widen_exactly() -> None:
    values = np.array([1.0, -2.5, 3.140625, np.inf], dtype=np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    assert np.array_equal(bfloat16_bits_to_float32(bits), values)


def test_checksum_format_is_checked() -> None:
    with pytest.raises(InvalidArgument, match="'w'"):
        hasher_for("crc32:abcd", "w")
    with pytest.raises(InvalidArgument):
        hasher_for("sha256", "w")


EXPIRED = (b'<?xml version="1.0"?><Error><Code>AccessDenied</Code>'
           b"<Message>Request has expired</Message></Error>")


@pytest.mark.parametrize(
    ("status", "code", "message", "kind", "words"),
    [
        (403, "AccessDenied", "Request has expired", BlobAccessDenied, "expired"),
        (403, "SignatureDoesNotMatch", "", BlobAccessDenied, "signature does not match"),
        (403, "AccessDenied", "Access Denied", BlobAccessDenied, "access denied"),
        (400, "ExpiredToken", "token", BlobAccessDenied, "expired"),
        (404, "NoSuchKey", "", BlobNotFound, "object not found"),
        (404, "NoSuchBucket", "", BlobNotFound, "bucket not found"),
        (416, "InvalidRange", "", InvalidArgument, "outside the object"),
        (503, "SlowDown", "", Unavailable, "503"),
        (500, "InternalError", "", Unavailable, "500"),
        (429, "", "", Unavailable, "429"),
        (409, "Conflict", "x", FedhiveError, "409"),
        (412, "PreconditionFailed", "", AlreadyExists, "exists already (a write-once write)"),
        (412, "", "", AlreadyExists, "exists already"),  # a HEAD-like answer without a body
        (409, "ConditionalRequestConflict", "", Unavailable, "409"),  # retried: then 412
        (404, "NoSuchUpload", "", InvalidArgument, "no such multipart upload"),
        (400, "InvalidPart", "etag mismatch", InvalidArgument, "InvalidPart: etag mismatch"),
    ],
)
def test_s3_failures_are_typed_and_name_the_key(
    status: int, code: str, message: str, kind: type[FedhiveError], words: str
) -> None:
    error = s3_failure(status, code, message, "ns/tensors/j/0.shard", "reading")
    assert type(error) is kind
    assert error.field == "ns/tensors/j/0.shard"
    assert "ns/tensors/j/0.shard" in str(error)
    assert words in str(error)


def test_error_document_parsing() -> None:
    assert parse_error_document(EXPIRED) == ("AccessDenied", "Request has expired")
    assert parse_error_document(b"not xml") == ("", "")
