"""Checkpoints in real S3: what is written (refs to the job's content-addressed objects, no
bytes copied), what a resumed job reads, what is cleaned up."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from fedhive.blobs import bundle_to_proto, content_key
from fedhive.blobs.checksum import digest
from fedhive.errors import FailedPrecondition
from fedhive.fl.checkpoint import (
    Checkpoint,
    checkpoint_keys,
    load_checkpoint,
    save_checkpoint,
)
from fedhive.fl.dxo import DataKind, Dxo
from fedhive.names import Names
from tests.fixtures.fl import Federation, FederationFactory


def model(value: float) -> Dxo:
    return Dxo(DataKind.WEIGHTS, {"big": np.full(64, value, np.float32),
                                  "small": np.array([value], np.float32)}, {"note": "x"})


def objects(fed: Federation, prefix: str) -> list[str]:
    assert fed.ctx.store is not None
    store = fed.ctx.store
    client = store._client  # type: ignore[attr-defined]
    listed = client.list_objects_v2(Bucket=store.bucket, Prefix=prefix)
    return sorted(item["Key"] for item in listed.get("Contents", []))


def names_of(fed: Federation) -> Names:
    assert fed.ctx.names is not None
    return fed.ctx.names


def job_prefix(fed: Federation) -> str:
    return names_of(fed).job_prefix(fed.ctx.job_id)


def test_arrays_are_stored_at_content_keys_and_the_checkpoint_deletes_nothing(
        federation: FederationFactory) -> None:
    fed = federation(["a"])
    save_checkpoint(fed.ctx, Checkpoint("ScatterAndGather", 0, 5, model(1.0)))
    first = objects(fed, fed.ctx.tensor_prefix)
    assert len(first) == 1  # "big" in an object; "small" inline in the bundle
    assert first == [content_key(fed.ctx.tensor_prefix, digest(np.full(64, 1.0, np.float32)))]
    assert checkpoint_keys(fed.ctx) == set(first)
    save_checkpoint(fed.ctx, Checkpoint("ScatterAndGather", 1, 5, model(2.0)))
    # The first model's object is left for the round objects' collector (it may be the live
    # model's); the checkpoint now names only the second's.
    second = set(objects(fed, fed.ctx.tensor_prefix)) - set(first)
    assert len(second) == 1 and checkpoint_keys(fed.ctx) == second
    loaded = load_checkpoint(fed.ctx, fed.ctx.job_id)
    assert loaded is not None
    assert (loaded.workflow, loaded.round_, loaded.num_rounds) == ("ScatterAndGather", 1, 5)
    assert loaded.model.data_kind is DataKind.WEIGHTS and loaded.model.meta == {"note": "x"}
    assert loaded.model.is_lazy and all(not ref.url for ref in loaded.model.refs())
    arrays = fed.materialized(loaded.model).data
    np.testing.assert_array_equal(arrays["big"], np.full(64, 2.0, np.float32))
    np.testing.assert_array_equal(arrays["small"], [2.0])


def test_a_model_of_refs_is_kept_as_the_same_refs_no_bytes_copied(
        federation: FederationFactory) -> None:
    fed = federation(["a"])
    lazy = fed.wire(model(3.0))  # as a site's result: refs under the job's tensor prefix
    assert lazy.data["big"].key.startswith(fed.ctx.tensor_prefix)
    before = objects(fed, job_prefix(fed))
    save_checkpoint(fed.ctx, Checkpoint("Cyclic", 0, 2, lazy))
    assert objects(fed, job_prefix(fed)) == sorted(
        [*before, names_of(fed).job_checkpoint_key(fed.ctx.job_id)])
    loaded = load_checkpoint(fed.ctx, fed.ctx.job_id)
    assert loaded is not None
    assert {name: (ref.key, ref.checksum) for name, ref in loaded.model.data.items()} == {
        name: (ref.key, ref.checksum) for name, ref in lazy.data.items()}
    np.testing.assert_array_equal(fed.materialized(loaded.model).data["small"], [3.0])


class CountedGets:
    """A blob store that counts its `get` calls."""

    def __init__(self, store: Any) -> None:
        self.store, self.gets = store, 0

    def get(self, key: str) -> Any:
        self.gets += 1
        return self.store.get(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


@pytest.mark.parametrize("predecessor_wrote", [False, True])
def test_the_checkpoint_is_read_once_then_remembered(federation: FederationFactory,
                                                     predecessor_wrote: bool) -> None:
    """A job that checkpoints rarely or never asks S3 once (as a restarted server job would,
    finding its predecessor's checkpoint or none), not every round."""
    fed = federation(["a"])
    if predecessor_wrote:
        save_checkpoint(fed.ctx, Checkpoint("ScatterAndGather", 0, 5, model(1.0)))
    written = set(fed.ctx.checkpointed or ())
    store = CountedGets(fed.ctx.store)
    ctx = dataclasses.replace(fed.ctx, store=store, checkpointed=None)
    assert checkpoint_keys(ctx) == written and store.gets == 1
    assert checkpoint_keys(ctx) == written and store.gets == 1
    save_checkpoint(ctx, Checkpoint("ScatterAndGather", 1, 5, model(2.0)))
    assert checkpoint_keys(ctx) == ctx.checkpointed != written and store.gets == 1


def test_no_checkpoint_and_a_malformed_one(federation: FederationFactory) -> None:
    fed = federation(["a"])
    assert load_checkpoint(fed.ctx, "never-ran") is None
    assert fed.ctx.store is not None
    names = fed.ctx.names
    fed.ctx.store.put(names.job_checkpoint_key("broken"),
                      bundle_to_proto([], {"workflow": "X"}).SerializeToString())
    with pytest.raises(FailedPrecondition, match="is malformed"):
        load_checkpoint(fed.ctx, "broken")


def test_a_context_without_names_is_refused(federation: FederationFactory) -> None:
    fed = federation(["a"])
    ctx = dataclasses.replace(fed.ctx, names=None)
    with pytest.raises(FailedPrecondition, match="no names"):
        save_checkpoint(ctx, Checkpoint("ScatterAndGather", 0, 1, model(1.0)))
