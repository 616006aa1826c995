"""Memory bound of the codec: a 512 MiB round trip costs less than 2x the tensor in peak RSS.

Measured in a fresh subprocess so the test runner's own memory does not blur the number. The
baseline is taken once the source tensor exists: what is measured is what pack + unpack add
(the destination buffer, about 1x, plus bounded transfer buffers), which must stay under 2x.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from fedhive.blobs import BlobStore
from fedhive.config import Settings

SCRIPT = r"""
import hashlib, json, sys
import numpy as np, psutil
from fedhive.blobs import S3BlobStore, TensorCodec
from fedhive.config import Settings

args = json.loads(sys.argv[1])
settings = Settings(**args["settings"])
store = S3BlobStore.from_settings(settings)
codec = TensorCodec(store, settings)
size = args["mib"] * 1024 * 1024
tensor = np.random.default_rng(0).random(size // 4, dtype=np.float32)  # touched: resident
baseline = psutil.Process().memory_info().rss
refs = codec.pack({"big": tensor}, args["prefix"])
back = codec.unpack(refs, via=args["via"])["big"]
# VmHWM, not ru_maxrss: on Linux ru_maxrss survives fork+exec and may be the parent's size.
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
            if line.startswith("VmHWM:"))
same = hashlib.sha256(back).digest() == hashlib.sha256(tensor).digest()
print(json.dumps({"baseline": baseline, "peak": peak, "size": size, "same": same,
                  "key": refs[0].key, "dtype": str(back.dtype), "shape": back.shape}))
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("via", ["url", "store"])
def test_512_mib_round_trip_peak_rss_under_twice_the_tensor(
    blob_store: BlobStore, settings: Settings, tensor_prefix: str, via: str
) -> None:
    args = {"settings": dataclasses.asdict(settings), "prefix": tensor_prefix, "mib": 512,
            "via": via}
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(args)], capture_output=True,
                          text=True, timeout=380)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["same"] and result["dtype"] == "float32"
    assert result["shape"] == [512 * 1024 * 1024 // 4]
    increase = result["peak"] - result["baseline"]
    assert increase < 2 * result["size"], f"peak RSS grew by {increase / result['size']:.2f}x"
    assert blob_store.exists(result["key"])  # an own (multipart) object
