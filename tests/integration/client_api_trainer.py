"""A training script for the client-API tests, copied into an app's custom/ folder and launched
by `ClientAPIExecutor` (`python -m fh_trainer`). What it does with a task is chosen by the
task's meta "behaviour":

* "double" (default): every array doubled (bools negated), same kind, dtype and shape;
* "echo": the params sent back as received (nothing new to upload);
* "exit": exit with code 3 without sending; "raise": raise ValueError("bad batch");
* "hang": write its pid to the meta's "pid_file" and sleep (the test kills it).

Each result's metrics report what the trainer's transfers did (its pid, bytes downloaded and
reused through its TensorCache, URLs re-signed), and the filter in fh_filters stamps how often
it ran.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedhive import client as flare


def doubled(value: Any) -> Any:
    if value.dtype in (bool, np.bool_) or str(value.dtype) == "torch.bool":
        return ~value
    return value * 2


def main() -> None:
    flare.init()
    while flare.is_running():
        model = flare.receive()
        assert model is not None
        behaviour = model.meta.get("behaviour", "double")
        if behaviour == "exit":
            sys.exit(3)
        if behaviour == "raise":
            raise ValueError("bad batch")
        if behaviour == "hang":
            Path(model.meta["pid_file"]).write_text(str(os.getpid()))
            while True:
                time.sleep(1)
        params = dict(model.params) if behaviour == "echo" else {
            name: doubled(value) for name, value in model.params.items()}
        stats = flare.transfer_stats()
        metrics = {"pid": os.getpid(), "bytes_fetched": stats["bytes_downloaded"],
                   "bytes_reused": stats["bytes_reused"],
                   "urls_resigned": stats["urls_resigned"],
                   "site": flare.get_site_name(), "job_id": flare.get_job_id(),
                   "task": flare.get_task_name()}
        flare.send(flare.FLModel(params=params, params_type=model.params_type,
                                 current_round=model.current_round, metrics=metrics,
                                 meta={"NUM_STEPS_CURRENT_ROUND": 1}))


if __name__ == "__main__":
    main()
