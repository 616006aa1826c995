"""hello-large's trainer, run by the client-API executor (fedhive.client): per task it receives
the global model (downloaded straight from S3; tensors it already holds and whose content did
not change are reused, not fetched), does a cheap stand-in for training (adds a constant to
every tensor except the first `--frozen-fraction` of them, in place) and sends the result back
(uploaded straight to S3; a tensor that did not change is not uploaded again).

    python -u custom/train.py [--delta 1.0] [--frozen-fraction 0.0]

The constant differs a little from site to site (`site_delta`) so that sites' results differ,
as real training would make them. Metrics per round: the time spent updating and the client
library's transfer counters since the previous round's download (bytes downloaded and reused
for this round, bytes uploaded for the previous one).
"""

from __future__ import annotations

import argparse
import time
import zlib
from typing import Any

import numpy as np

import fedhive.client as flare


def site_delta(delta: float, site: str) -> float:
    """What a site adds: `delta` plus a site-specific part of less than 1/4096 of it."""
    return delta * (1 + (zlib.crc32(site.encode()) % 1024) / 2**22)


def frozen_names(names: list[str], fraction: float) -> set[str]:
    """The first `fraction` of the tensors in name order."""
    return set(sorted(names)[: round(len(names) * fraction)])


def since(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    return {key: float(after[key] - before.get(key, 0)) for key in after}


def train(params: dict[str, Any], delta: float, frozen: set[str]) -> None:
    for name, value in params.items():
        if name not in frozen:
            value += np.asarray(delta, dtype=value.dtype)  # in place: no second copy


def main() -> None:
    parser = argparse.ArgumentParser(description="hello-large trainer")
    parser.add_argument("--delta", type=float, default=1.0)
    parser.add_argument("--frozen-fraction", type=float, default=0.0)
    args = parser.parse_args()
    if not 0.0 <= args.frozen_fraction <= 1.0:
        parser.error("--frozen-fraction must be between 0 and 1")
    flare.init()
    delta = site_delta(args.delta, flare.get_site_name())
    previous = flare.transfer_stats()
    while flare.is_running():
        model = flare.receive()
        if model is None:
            break
        received = flare.transfer_stats()
        frozen = frozen_names(list(model.params), args.frozen_fraction)
        start = time.perf_counter()
        train(model.params, delta, frozen)
        metrics: dict[str, float] = {"train_s": time.perf_counter() - start,
                                     "tensors": len(model.params), "frozen_tensors": len(frozen)}
        # this round's download (and the previous round's upload, which ended before it)
        metrics.update(since(previous, received))
        flare.send(flare.FLModel(params=model.params, params_type=flare.ParamsType.FULL,
                                 metrics=metrics, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
        del model
        previous = received


if __name__ == "__main__":
    main()
