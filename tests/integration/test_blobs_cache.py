"""`TensorCache` against real S3: a trainer that lives across rounds downloads only the tensors
whose content changed, and never reuses a cached array that training changed in place."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from fedhive.blobs import BlobStore, PresignedFetcher, TensorCache, TensorCodec, TensorKind, unpack
from fedhive.config import Settings


@pytest.fixture
def codec(blob_store: BlobStore, settings: Settings) -> Iterator[TensorCodec]:
    tensor_codec = TensorCodec(blob_store, settings, inline_threshold=1024)
    yield tensor_codec
    tensor_codec.close()


def layer(seed: int, n: int = 20_000) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def model(round_no: int) -> dict[str, Any]:
    """Four stored layers, two frozen (same bytes every round), and an inline scalar."""
    return {
        "frozen.0": layer(0), "frozen.1": layer(1),
        "head.0": layer(100 + round_no), "head.1": layer(200 + round_no),
        "step": np.array(round_no, dtype=np.int64),
    }


def test_unchanged_tensors_are_not_downloaded_again(
    codec: TensorCodec, tensor_prefix: str
) -> None:
    fetcher, cache = PresignedFetcher(), TensorCache()
    first = unpack(codec.pack(model(0), tensor_prefix), fetcher, cache=cache)
    stored = 4 * layer(0).nbytes
    assert cache.bytes_fetched == fetcher.bytes_fetched == stored
    assert len(cache) == 4
    second = unpack(codec.pack(model(1), tensor_prefix), fetcher, cache=cache)
    changed = 2 * layer(0).nbytes
    assert cache.bytes_fetched == fetcher.bytes_fetched == stored + changed  # heads only
    assert cache.bytes_reused == changed and cache.bytes_stale == 0
    for name, value in model(1).items():
        assert np.array_equal(second[name], value)
    assert np.shares_memory(second["frozen.0"], first["frozen.0"])  # reused, not copied
    assert not np.shares_memory(second["head.0"], first["head.0"])
    fetcher.close()


def test_a_cached_array_changed_in_place_is_downloaded_again(
    codec: TensorCodec, tensor_prefix: str
) -> None:
    fetcher, cache = PresignedFetcher(), TensorCache()
    refs = codec.pack(model(0), tensor_prefix)
    trained = unpack(refs, fetcher, cache=cache)
    trained["frozen.1"] += 1.0  # training updates the received arrays in place
    trained["head.0"][7] = np.nan
    before = fetcher.bytes_fetched
    again = unpack(refs, fetcher, cache=cache)
    mutated = 2 * layer(0).nbytes
    assert fetcher.bytes_fetched - before == cache.bytes_stale == mutated
    for name, value in model(0).items():
        assert np.array_equal(again[name], value)  # the stored content, not the trained one
    assert np.array_equal(trained["frozen.1"], layer(1) + 1.0)  # its memory was not reused
    assert np.shares_memory(again["frozen.0"], trained["frozen.0"])
    fetcher.close()


def test_cache_serves_torch_and_names_sharing_content_get_their_own_memory(
    codec: TensorCodec, tensor_prefix: str
) -> None:
    fetcher, cache = PresignedFetcher(), TensorCache()
    weights = torch.from_numpy(layer(5))
    refs = codec.pack({"a": weights, "b": weights.clone()}, tensor_prefix)
    assert refs[0].key == refs[1].key
    first = unpack(refs, fetcher, cache=cache)
    assert fetcher.bytes_fetched == weights.numel() * 4  # one download for both names
    assert isinstance(first["a"], torch.Tensor)
    second = unpack(refs, fetcher, cache=cache, kind=TensorKind.NUMPY)
    assert fetcher.bytes_fetched == weights.numel() * 4 == cache.bytes_reused  # from memory
    assert all(np.array_equal(second[n], weights.numpy()) for n in "ab")
    second["a"] += 1  # "b" is a copy of "a"'s bytes, not an alias
    assert np.array_equal(second["b"], weights.numpy()) and torch.equal(first["b"], weights)
    fetcher.close()


def test_cache_keeps_only_the_last_unpack(codec: TensorCodec, tensor_prefix: str) -> None:
    fetcher, cache = PresignedFetcher(), TensorCache()
    unpack(codec.pack(model(0), tensor_prefix), fetcher, cache=cache)
    unpack(codec.pack({"other": layer(9)}, tensor_prefix), fetcher, cache=cache)
    assert len(cache) == 1  # the first model's tensors were dropped
    cache.clear()
    assert len(cache) == 0
    fetcher.close()
