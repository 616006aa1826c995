"""The DXO on the wire: arrays become refs once, refs pass through a relay unchanged, and
whoever computes materialises them bit-exact (real S3)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from fedhive.blobs import BlobStore, PresignedFetcher, TensorCodec, TensorRef
from fedhive.config import Settings
from fedhive.errors import MalformedMessage
from fedhive.fl.dxo import DataKind, Dxo, MetaKey, dxo_from_proto, dxo_to_proto
from fedhive.names import Names
from fedhive.proto.v1 import task_pb2


@pytest.fixture
def codec(blob_store: BlobStore, settings: Settings) -> Iterator[TensorCodec]:
    codec = TensorCodec(blob_store, settings, inline_threshold=1024)
    yield codec
    codec.close()


def pack_with(codec: TensorCodec, settings: Settings):  # type: ignore[no-untyped-def]
    prefix = Names(settings.namespace).job_tensor_prefix("job-1")
    return lambda arrays: codec.pack(arrays, prefix)


def wire(message: task_pb2.Dxo) -> task_pb2.Dxo:
    return task_pb2.Dxo.FromString(message.SerializeToString())


def test_round_trip_is_lazy_then_bit_exact(codec: TensorCodec, settings: Settings,
                                           blob_store: BlobStore) -> None:
    small = np.arange(6, dtype=np.float32).reshape(2, 3)
    large = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float16)
    mask = torch.tensor([True, False, True])
    sent = Dxo(DataKind.WEIGHTS, {"small": small, "large": large, "mask": mask},
               {MetaKey.NUM_STEPS_CURRENT_ROUND: 32, MetaKey.METRICS: {"loss": 0.25}})

    received = dxo_from_proto(wire(dxo_to_proto(sent, pack_with(codec, settings))))

    assert received.is_lazy and received.data_kind is DataKind.WEIGHTS
    assert received.meta == {"NUM_STEPS_CURRENT_ROUND": 32, "metrics": {"loss": 0.25}}
    assert list(received.data) == ["small", "large", "mask"]
    large_ref = received.data["large"]
    assert isinstance(large_ref, TensorRef) and large_ref.key and not large_ref.inline_data
    for fetcher in (blob_store, PresignedFetcher()):
        arrays = received.materialized(fetcher).data
        np.testing.assert_array_equal(arrays["small"], small)
        assert arrays["large"].dtype == np.float16
        assert arrays["large"].tobytes() == large.tobytes()
        assert isinstance(arrays["mask"], torch.Tensor) and torch.equal(arrays["mask"], mask)


def test_a_relay_forwards_refs_without_packing_again(codec: TensorCodec,
                                                     settings: Settings) -> None:
    big = np.ones((64, 64), dtype=np.float32)
    first = dxo_from_proto(wire(dxo_to_proto(Dxo(DataKind.WEIGHTS, {"w": big}),
                                             pack_with(codec, settings))))

    def refuse(arrays: object) -> list[TensorRef]:
        raise AssertionError(f"a relay packed {arrays}")

    forwarded = dxo_from_proto(wire(dxo_to_proto(first, refuse)))
    assert forwarded.data["w"] == first.data["w"]


def test_mixed_refs_and_arrays_keep_their_order(codec: TensorCodec, settings: Settings) -> None:
    lazy = dxo_from_proto(wire(dxo_to_proto(
        Dxo(DataKind.WEIGHTS, {"a": np.zeros(3, np.int64)}), pack_with(codec, settings))))
    mixed = Dxo(DataKind.WEIGHT_DIFF, {"b": np.ones(2, np.int64), "a": lazy.data["a"]})
    back = dxo_from_proto(wire(dxo_to_proto(mixed, pack_with(codec, settings))))
    assert list(back.data) == ["b", "a"] and back.data["a"] == lazy.data["a"]


def test_bad_messages_name_the_problem() -> None:
    with pytest.raises(MalformedMessage, match="data_kind"):
        dxo_from_proto(task_pb2.Dxo())
    twice = task_pb2.Dxo(data_kind=task_pb2.DATA_KIND_METRICS)
    for _ in range(2):
        twice.tensors.add(name="x", dtype="int8", shape=[0], length=0,
                          checksum="sha256:" + "0" * 64, kind=1)
    with pytest.raises(MalformedMessage, match="'x'"):
        dxo_from_proto(twice)
