"""The tensor codec against real S3: every dtype, numpy and torch, inline and stored at content
keys, read with credentials and through presigned URLs only; content keys dedupe."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from fedhive.blobs import (
    BlobStore,
    PresignedFetcher,
    TensorCodec,
    TensorKind,
    TensorRef,
    bundle_to_proto,
    content_key,
    unpack,
)
from fedhive.config import Settings
from fedhive.errors import BlobAccessDenied, BlobNotFound, ChecksumMismatch, InvalidArgument
from tests.fixtures.infra import wait_for

Via = Literal["store", "url"]
NUMPY_DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
                "uint16", "uint32", "uint64", "complex64", "complex128", "bool"]
TORCH_DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
                "uint8", "complex64", "bool"]
# Small thresholds keep the suite fast while exercising both paths and multi-part reads.
INLINE, PART = 256, 4 * 1024
SHAPES = {"inline": (4, 4), "small": (10, 30), "stored": (70, 130)}


@pytest.fixture(params=["store", "url"])
def via(request: pytest.FixtureRequest) -> Via:
    mode: Via = request.param
    return mode


@pytest.fixture
def small_codec(blob_store: BlobStore, settings: Settings) -> Iterator[TensorCodec]:
    codec = TensorCodec(blob_store, settings, inline_threshold=INLINE, part_size=PART)
    yield codec
    codec.close()


def random_numpy(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    # any bit pattern: NaN payloads and subnormals too
    return rng.integers(0, 256, size, dtype=np.uint8).view(dtype).reshape(shape)


def random_torch(dtype: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    if dtype == "bool":
        return torch.from_numpy(random_numpy("bool", shape, seed))
    width = getattr(torch, dtype).itemsize
    raw = torch.from_numpy(random_numpy("uint8", (int(np.prod(shape)) * width,), seed))
    return raw.view(getattr(torch, dtype)).reshape(shape)


def raw_bytes(value: Any) -> bytes:
    if isinstance(value, torch.Tensor):
        return bytes(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return bytes(np.ascontiguousarray(value).tobytes())


def path_of(ref: TensorRef) -> str:
    return "inline" if ref.is_inline else "stored"


def assert_same(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert raw_bytes(got) == raw_bytes(want)  # bit-exact, NaN payloads included


def round_trip_every_path(codec: TensorCodec, prefix: str, make: Any, kind: TensorKind,
                          dtype: str) -> None:
    """One pack holding this dtype on each path, read back with credentials and by URL."""
    model = {path: make(dtype, shape, seed) for seed, (path, shape) in enumerate(SHAPES.items())}
    refs = codec.pack(model, prefix)
    assert [path_of(r) for r in refs] == ["inline", "stored", "stored"]
    assert all(r.kind is kind and r.dtype == dtype for r in refs)
    for via in ("store", "url"):
        back = codec.unpack(refs, via=via)
        for path, value in model.items():
            assert_same(back[path], value)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_round_trip(small_codec: TensorCodec, tensor_prefix: str, dtype: str) -> None:
    round_trip_every_path(small_codec, tensor_prefix, random_numpy, TensorKind.NUMPY, dtype)


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_round_trip(small_codec: TensorCodec, tensor_prefix: str, dtype: str) -> None:
    round_trip_every_path(small_codec, tensor_prefix, random_torch, TensorKind.TORCH, dtype)


def test_a_model_mixing_all_paths_in_one_pack(
    small_codec: TensorCodec, tensor_prefix: str, via: Via
) -> None:
    model: dict[str, Any] = {f"layer{i}.w": random_numpy("float32", (40, 50), i) for i in range(12)}
    model["tiny"] = np.float64(3.5)
    model["big"] = random_torch("bfloat16", (90, 100), 99)
    model["bias"] = torch.arange(7, dtype=torch.int64)
    refs = small_codec.pack(model, tensor_prefix)
    assert [r.name for r in refs] == list(model)
    stored = [r for r in refs if not r.is_inline]
    assert len({r.key for r in stored}) == len(stored) == 13  # one object per tensor
    assert all(r.offset == 0 and r.url for r in stored)
    back = small_codec.unpack(refs, via=via)
    for name, value in model.items():
        assert_same(back[name], np.asarray(value) if isinstance(value, np.generic) else value)


@pytest.mark.parametrize("inline_threshold", [0, INLINE])
def test_zero_d_and_empty_arrays(
    blob_store: BlobStore, settings: Settings, tensor_prefix: str, via: Via, inline_threshold: int
) -> None:
    codec = TensorCodec(blob_store, settings, inline_threshold=inline_threshold)
    model = {
        "np0d": np.array(2.5, dtype=np.float32),
        "t0d": torch.tensor(7, dtype=torch.int16),
        "np_empty": np.zeros((0, 3), dtype=np.float64),
        "t_empty": torch.zeros((2, 0), dtype=torch.bfloat16),
        "bool0d": np.array(True),
    }
    refs = codec.pack(model, tensor_prefix)
    by_name = {r.name: r for r in refs}
    assert by_name["np_empty"].is_inline and by_name["t_empty"].is_inline  # nothing to store
    assert by_name["np0d"].is_inline is (inline_threshold > 0)
    back = codec.unpack(refs, via=via)
    for name, value in model.items():
        assert_same(back[name], value)
    codec.close()


def test_non_contiguous_inputs(small_codec: TensorCodec, tensor_prefix: str, via: Via) -> None:
    base = random_numpy("float32", (80, 60), 5)
    tbase = random_torch("float16", (90, 70), 6)
    model: dict[str, Any] = {
        "transposed": base.T,
        "strided": base[::3, 1::2],
        "reversed": base[::-1],
        "fortran": np.asfortranarray(base),
        "t_transposed": tbase.t(),
        "t_strided": tbase[:, ::2],
    }
    assert not any(
        v.flags.c_contiguous if isinstance(v, np.ndarray) else v.is_contiguous()
        for k, v in model.items() if k != "fortran"
    )
    back = small_codec.unpack(small_codec.pack(model, tensor_prefix), via=via)
    for name, value in model.items():
        assert_same(back[name], np.ascontiguousarray(value) if isinstance(value, np.ndarray)
                    else value.contiguous())


@hsettings(max_examples=12, deadline=None,
           suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=4).map(tuple),
    dtype=st.sampled_from(["float32", "int8", "float64", "bool"]),
)
def test_any_shape_round_trips(
    small_codec: TensorCodec, tensor_prefix: str, shape: tuple[int, ...], dtype: str
) -> None:
    array = random_numpy(dtype, shape, seed=len(shape))
    refs = small_codec.pack({"x": array}, tensor_prefix)
    assert_same(small_codec.unpack(refs, via="url")["x"], array)


def test_torch_bfloat16_as_numpy_is_its_raw_bits(
    small_codec: TensorCodec, tensor_prefix: str
) -> None:
    tensor = random_torch("bfloat16", (50, 50))
    refs = small_codec.pack({"w": tensor}, tensor_prefix)
    as_numpy = small_codec.unpack(refs, kind=TensorKind.NUMPY)["w"]
    assert as_numpy.dtype == np.uint16 and as_numpy.shape == (50, 50)
    assert np.array_equal(as_numpy, tensor.view(torch.int16).numpy().view(np.uint16))


def test_trainer_process_unpacks_with_presigned_urls_only(
    small_codec: TensorCodec, tensor_prefix: str
) -> None:
    model = {"w": random_numpy("float32", (70, 130)), "b": random_numpy("int64", (100,))}
    wire = bundle_to_proto(small_codec.pack(model, tensor_prefix)).SerializeToString()
    script = (
        "import sys, hashlib\n"
        "from fedhive.blobs import PresignedFetcher, bundle_from_proto, unpack\n"
        "from fedhive.proto.v1 import common_pb2\n"
        "refs, _ = bundle_from_proto(common_pb2.TensorBundle.FromString(sys.stdin.buffer.read()))\n"
        "out = unpack(refs, PresignedFetcher())\n"
        "for name in sorted(out): print(name, hashlib.sha256(out[name].tobytes()).hexdigest())\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "."}  # no AWS_* variables
    done = subprocess.run([sys.executable, "-c", script], input=wire, env=env,
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    import hashlib

    expected = "".join(
        f"{n} {hashlib.sha256(model[n].tobytes()).hexdigest()}\n" for n in sorted(model)
    )
    assert done.stdout.decode() == expected


@pytest.mark.parametrize("shape", [SHAPES["small"], SHAPES["stored"]])
def test_object_overwritten_behind_the_ref_is_a_checksum_mismatch(
    blob_store: BlobStore, small_codec: TensorCodec, tensor_prefix: str, via: Via,
    shape: tuple[int, ...],
) -> None:
    array = random_numpy("float32", shape)
    (ref,) = small_codec.pack({"w": array}, tensor_prefix)
    original = blob_store.get(ref.key)
    blob_store.put(ref.key, original[:-1] + bytes([original[-1] ^ 1]))  # same size, one bit
    with pytest.raises(ChecksumMismatch) as caught:
        small_codec.unpack([ref], via=via)
    assert "'w'" in str(caught.value) and ref.key in str(caught.value)
    blob_store.put(ref.key, original[: len(original) // 2])  # shorter than the ref's range
    with pytest.raises(ChecksumMismatch, match=ref.key):
        small_codec.unpack([ref], via=via)


def test_tampered_inline_bytes_are_a_checksum_mismatch(
    small_codec: TensorCodec, tensor_prefix: str
) -> None:
    (ref,) = small_codec.pack({"w": np.arange(4, dtype=np.int32)}, tensor_prefix)
    forged = TensorRef(**{**ref.__dict__, "inline_data": b"\x00" * ref.length})
    with pytest.raises(ChecksumMismatch, match="'w'"):
        small_codec.unpack([forged])


def test_deleted_object_is_blob_not_found(
    blob_store: BlobStore, small_codec: TensorCodec, tensor_prefix: str, via: Via
) -> None:
    (ref,) = small_codec.pack({"w": random_numpy("float32", SHAPES["stored"])}, tensor_prefix)
    blob_store.delete(ref.key)
    with pytest.raises(BlobNotFound, match=ref.key):
        small_codec.unpack([ref], via=via)


def test_expired_ref_url_is_access_denied(
    blob_store: BlobStore, settings: Settings, tensor_prefix: str,
    presigned_fetcher: PresignedFetcher,
) -> None:
    codec = TensorCodec(blob_store, settings, inline_threshold=0, url_ttl=1)
    refs = codec.pack({"w": random_numpy("float32", (100,))}, tensor_prefix)
    errors: list[BlobAccessDenied] = []

    def denied() -> bool:
        try:
            unpack(refs, presigned_fetcher)
        except BlobAccessDenied as err:
            errors.append(err)
            return True
        return False

    wait_for(denied, timeout=30, interval=0.25, what="the ref's URL to expire")
    assert "expired" in str(errors[0]) and refs[0].key in str(errors[0])
    codec.close()


def test_bad_inputs_are_rejected(small_codec: TensorCodec, tensor_prefix: str) -> None:
    with pytest.raises(InvalidArgument, match="'w'"):
        small_codec.pack({"w": [1.0, 2.0]}, tensor_prefix)
    with pytest.raises(InvalidArgument, match="prefix"):
        small_codec.pack({"w": np.zeros(3)}, "")
    (ref,) = small_codec.pack({"w": np.zeros(3)}, tensor_prefix)
    with pytest.raises(InvalidArgument, match="repeat"):
        small_codec.unpack([ref, ref])


def test_default_codec_inlines_small_tensors_within_a_budget(
    codec: TensorCodec, tensor_prefix: str
) -> None:
    model = {f"t{i}": np.full(256 * 1024, i, dtype=np.float32) for i in range(20)}  # 1 MiB each
    refs = codec.pack(model, tensor_prefix)
    inline = [r for r in refs if r.is_inline]
    assert len(inline) == 16  # 16 MiB inline budget (8 x the 2 MiB threshold), rest stored
    assert all(path_of(r) == "stored" for r in refs if not r.is_inline)
    back = codec.unpack(refs)
    assert all(np.array_equal(back[n], v) for n, v in model.items())


def test_store_puts_inline_refs_at_their_content_keys_once(
    blob_store: BlobStore, small_codec: TensorCodec, tensor_prefix: str
) -> None:
    """What a broadcast to many sites sends past its fan-out budget: each inline ref's bytes
    stored once at its content key (no URL: the sender presigns); stored and empty refs kept."""
    model = {"w": random_numpy("float32", SHAPES["inline"]),
             "same": random_numpy("float32", SHAPES["inline"]),  # w's bytes: one object
             "v": random_numpy("int8", SHAPES["inline"], 1),
             "empty": np.zeros(0, dtype=np.float32),
             "big": random_numpy("float32", SHAPES["stored"], 2)}
    refs = small_codec.pack(model, tensor_prefix)
    assert [ref.is_inline for ref in refs] == [True, True, True, True, False]
    before = small_codec.stats.objects_uploaded
    stored = small_codec.store(refs, tensor_prefix)
    assert small_codec.stats.objects_uploaded == before + 2  # w (and same), v
    for ref, was in zip(stored[:3], refs[:3], strict=True):
        assert ref.key == content_key(tensor_prefix, was.checksum) and ref.url == ""
        assert not ref.inline_data and ref.length == was.length
    assert stored[3] == refs[3] and stored[4] == refs[4]
    back = small_codec.unpack(stored)
    for name, value in model.items():
        assert_same(back[name], value)
    small_codec.store(refs, tensor_prefix)  # the objects exist: nothing uploaded again
    assert small_codec.stats.objects_uploaded == before + 2


def test_store_refuses_inline_bytes_that_do_not_match_their_checksum(
    blob_store: BlobStore, small_codec: TensorCodec, tensor_prefix: str
) -> None:
    (ref,) = small_codec.pack({"w": random_numpy("float32", SHAPES["inline"], 3)}, tensor_prefix)
    forged = TensorRef(**{**ref.__dict__, "inline_data": b"\x00" * ref.length})
    with pytest.raises(InvalidArgument, match=r"'w'.*checksum"):
        small_codec.store([forged], tensor_prefix)
    assert not blob_store.exists(content_key(tensor_prefix, ref.checksum))


def test_keys_carry_the_content_hash(small_codec: TensorCodec, tensor_prefix: str) -> None:
    model = {f"t{i}": random_numpy("float32", (30, 40), i) for i in range(3)}
    refs = small_codec.pack(model, tensor_prefix)
    for ref in refs:
        digest = ref.checksum.removeprefix("blake3:")
        assert ref.checksum == f"blake3:{digest}" and len(digest) == 64
        assert ref.key == content_key(tensor_prefix, ref.checksum)
        assert ref.key == f"{tensor_prefix}blake3/{digest}"
    assert len({ref.key for ref in refs}) == 3


def test_packing_the_same_tensor_twice_uploads_it_once(
    blob_store: BlobStore, small_codec: TensorCodec, tensor_prefix: str, via: Via
) -> None:
    weights = random_numpy("float32", (70, 130), 7)
    refs = small_codec.pack({"a": weights, "b": weights.copy()}, tensor_prefix)
    assert refs[0].key == refs[1].key
    assert small_codec.stats.objects_uploaded == 1
    assert small_codec.stats.bytes_uploaded == weights.nbytes
    again = small_codec.pack({"c": weights}, tensor_prefix)
    assert again[0].key == refs[0].key
    stats = small_codec.stats
    assert (stats.objects_uploaded, stats.objects_present) == (1, 1)  # found by HEAD: skipped
    back = small_codec.unpack(refs + again, via=via)
    for name in "abc":
        assert_same(back[name], weights)
    back["a"][0, 0] += 1  # the names share one download, not one array
    assert back["b"][0, 0] == weights[0, 0] == back["c"][0, 0]


def test_two_packs_sharing_tensors_share_objects(
    blob_store: BlobStore, settings: Settings, small_codec: TensorCodec, tensor_prefix: str
) -> None:
    frozen = {f"frozen{i}": random_numpy("float32", (50, 60), i) for i in range(3)}
    round1 = small_codec.pack({**frozen, "head": random_numpy("float32", (50, 60), 10)},
                              tensor_prefix)
    other = TensorCodec(blob_store, settings, inline_threshold=INLINE)  # another process's codec
    try:
        round2 = other.pack({**frozen, "head": random_numpy("float32", (50, 60), 11)},
                            tensor_prefix)
        assert (other.stats.objects_uploaded, other.stats.objects_present) == (1, 3)
    finally:
        other.close()
    assert [r.key for r in round1[:3]] == [r.key for r in round2[:3]]
    assert round1[3].key != round2[3].key  # changed content: another object, the first kept
    assert_same(small_codec.unpack(round1)["head"], random_numpy("float32", (50, 60), 10))


def test_a_content_object_of_the_wrong_size_is_rewritten(
    blob_store: BlobStore, small_codec: TensorCodec, tensor_prefix: str
) -> None:
    weights = random_numpy("float32", (70, 130), 3)
    (ref,) = small_codec.pack({"w": weights}, tensor_prefix)
    blob_store.put(ref.key, b"truncated")  # what a broken upload could have left there
    (again,) = small_codec.pack({"w": weights}, tensor_prefix)
    assert again.key == ref.key
    assert small_codec.stats.objects_uploaded == 2
    assert_same(small_codec.unpack([again])["w"], weights)
