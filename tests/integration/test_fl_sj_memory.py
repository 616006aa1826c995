"""The server job's memory with a large model does not grow with the model: peak RSS of the
server side of ScatterAndGather (streaming aggregation, the persistor writing the model every
round, checkpoints) in a process of its own, for two model sizes made of same-size tensors."""

from __future__ import annotations

import json

from fedhive.config import Settings
from tests.fixtures.sj_memory import measure, s3_of

MiB = 1024 * 1024


def test_server_memory_is_bounded_by_tensors_not_by_the_model(settings: Settings) -> None:
    s3 = s3_of(settings)
    small = measure(s3, size_mib=32, tensors=8, sites=2, rounds=2)
    large = measure(s3, size_mib=128, tensors=32, sites=2, rounds=2)
    print(json.dumps({"small": small, "large": large}))
    largest = large["largest_tensor_mib"]
    assert small["largest_tensor_mib"] == largest == 4
    # The aggregation works on `stream_memory_mb` (64 MiB) at most, here its 4 workers on a
    # tensor of 4 MiB and its sum each (32 MiB); the persistor and the packer on one tensor
    # each. (Measured: 32-36 MiB; 256 MiB in 16 tensors: 68 MiB, 512 MiB in 16: 69 MiB.)
    for run in (small, large):
        assert run["growth_mib"] < 32 + 3 * largest + 24, run
    assert abs(large["growth_mib"] - small["growth_mib"]) < 4 * largest, (small, large)
