"""`unpack` against an in-memory fetcher: large tensors land in buffers of their own (regular
pages, `_new_buffer`), bit-exact, writable, and a wrong byte still fails naming tensor and key."""

from __future__ import annotations

import dataclasses
import mmap
from collections.abc import Sequence

import numpy as np
import pytest

from fedhive.blobs import BlobLocation, TensorCache, TensorKind, TensorRef, inline_values, unpack
from fedhive.blobs.checksum import digest
from fedhive.blobs.codec import inline_refs
from fedhive.blobs.transfer import MiB
from fedhive.blobs.unpack import DOWNLOAD_PART_SIZE
from fedhive.errors import ChecksumMismatch


class MemoryFetcher:
    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects
        self.reads: list[tuple[str, int, int]] = []

    def fetch_range(self, where: BlobLocation, offset: int, dests: Sequence[memoryview]) -> None:
        data = self.objects[where.key]
        self.reads.append((where.key, offset, sum(len(d) for d in dests)))
        for dest in dests:
            dest[:] = data[offset : offset + len(dest)]
            offset += len(dest)


def ref_for(name: str, array: np.ndarray, key: str, algorithm: str = "blake3") -> TensorRef:
    return TensorRef(name=name, dtype=str(array.dtype), shape=array.shape, kind=TensorKind.NUMPY,
                     key=key, url="", length=array.nbytes, checksum=digest(array, algorithm))


def test_large_and_small_tensors_arrive_bit_exact_and_writable() -> None:
    rng = np.random.default_rng(0)
    large = rng.random((3 * DOWNLOAD_PART_SIZE // 4 + 5,), dtype=np.float32)  # 3 parts and a bit
    small = rng.integers(0, 100, size=(7, 3), dtype=np.int64)
    fetcher = MemoryFetcher({"k/large": large.tobytes(), "k/small": small.tobytes()})
    got = unpack([ref_for("large", large, "k/large"), ref_for("small", small, "k/small")],
                 fetcher)
    assert np.array_equal(got["large"], large) and np.array_equal(got["small"], small)
    assert got["large"].dtype == np.float32 and got["small"].shape == (7, 3)
    got["large"][0] += 1  # the trainer updates in place
    got["small"][0, 0] += 1
    assert sorted(n for _, _, n in fetcher.reads) == sorted(
        [DOWNLOAD_PART_SIZE] * 3 + [20, small.nbytes])


def test_a_large_buffer_is_its_own_page_aligned_mapping() -> None:
    large = np.arange(5 * MiB // 4, dtype=np.float32)
    got = unpack([ref_for("w", large, "k/w")], MemoryFetcher({"k/w": large.tobytes()}))["w"]
    assert got.ctypes.data % mmap.PAGESIZE == 0 and got.flags.writeable
    assert np.array_equal(got, large)


def test_a_corrupt_large_object_fails_naming_tensor_and_key() -> None:
    large = np.ones(5 * MiB // 4, dtype=np.float32)
    stored = bytearray(large.tobytes())
    stored[-1] ^= 1
    with pytest.raises(ChecksumMismatch, match=r"tensor 'w': bytes from blob k/w do not match"):
        unpack([ref_for("w", large, "k/w")], MemoryFetcher({"k/w": bytes(stored)}))


def test_a_cached_large_tensor_is_reused_and_refetched_once_changed() -> None:
    large = np.arange(5 * MiB // 4, dtype=np.float32)
    fetcher = MemoryFetcher({"k/w": large.tobytes()})
    cache = TensorCache()
    first = unpack([ref_for("w", large, "k/w")], fetcher, cache=cache)["w"]
    again = unpack([ref_for("w", large, "k/w")], fetcher, cache=cache)["w"]
    assert np.shares_memory(first, again) and cache.bytes_reused == large.nbytes
    again[0] = -1  # changed in place: the cached copy no longer matches its checksum
    fresh = unpack([ref_for("w", large, "k/w")], fetcher, cache=cache)["w"]
    assert np.array_equal(fresh, large) and not np.shares_memory(fresh, again)
    assert cache.bytes_stale == large.nbytes


def test_checksums_are_blake3_and_an_old_checkpoints_sha256_refs_still_verify() -> None:
    assert digest(b"abc") == (  # BLAKE3's published test vector for "abc"
        "blake3:6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85")
    large = np.arange(5 * MiB // 4, dtype=np.float32)
    old = ref_for("w", large, "k/sha256/w", algorithm="sha256")
    assert old.checksum.startswith("sha256:")
    got = unpack([old], MemoryFetcher({"k/sha256/w": large.tobytes()}))["w"]
    assert np.array_equal(got, large)
    stored = bytearray(large.tobytes())
    stored[0] ^= 1
    with pytest.raises(ChecksumMismatch, match="tensor 'w'"):
        unpack([old], MemoryFetcher({"k/sha256/w": bytes(stored)}))


def test_inline_bytes_are_copied_and_verified() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    ref = inline_refs({"w": array}, limit=MiB)[0]
    owned = unpack([ref], MemoryFetcher({}))["w"]
    assert np.array_equal(owned, array) and owned.flags.writeable
    assert not np.shares_memory(owned, np.frombuffer(ref.inline_data, np.uint8))
    tampered = dataclasses.replace(ref, inline_data=bytes(len(ref.inline_data)))
    with pytest.raises(ChecksumMismatch, match="'w': bytes from inline data"):
        unpack([tampered], MemoryFetcher({}))


def test_inline_values_are_a_read_only_view_of_the_bytes_as_they_came() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    ref = inline_refs({"w": array}, limit=MiB)[0]
    view = inline_values(ref)
    assert np.array_equal(view, array) and not view.flags.writeable
    assert np.shares_memory(view, np.frombuffer(ref.inline_data, np.uint8))  # no copy
    other = np.full((3, 4), 7, np.float32)  # other bytes under the same label: not checked
    relabelled = dataclasses.replace(ref, inline_data=bytearray(other.tobytes()))
    assert np.array_equal(inline_values(relabelled), other)
    assert not inline_values(relabelled).flags.writeable  # even over writable memory
    bits = inline_refs({"b": np.arange(4, dtype=np.uint16)}, limit=MiB)[0]
    bits = dataclasses.replace(bits, dtype="bfloat16")
    assert inline_values(bits).dtype == np.dtype("<u2")
