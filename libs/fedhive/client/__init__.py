"""The client API: what a training script launched by a client job calls (FLARE's `flare`).

    from fedhive import client as flare

    flare.init()
    while flare.is_running():
        model = flare.receive()            # FLModel: params as they were sent (numpy / torch)
        params = train(model.params)
        flare.send(flare.FLModel(params=params, metrics={"loss": loss},
                                 meta={"NUM_STEPS_CURRENT_ROUND": steps}))

The script runs as a subprocess of its site's client job (`ClientAPIExecutor` in
config_fed_client.json), which hands it a local pipe (`FEDHIVE_CLIENT_FD`) carrying only refs
and metadata. Tensor bytes never pass through the client job: `receive` downloads them straight
from S3 through presigned URLs (parallel ranged GETs, checksums verified; an expired URL is
re-signed through the pipe), and `send` uploads the result's arrays through the server job's
upload grants (multipart for large ones; arrays S3 already holds, like frozen layers, are not
sent again) and sends refs. Arrays come back as the kind they were sent, dtype and shape
bit-exact. A trainer launched once per job keeps what it downloaded: the next round fetches
only the tensors whose content changed.

* `init(rank=None)`: connect (rank from `RANK`, default "0"; only rank 0 talks to the client
  job); a repeated call is ignored with a warning.
* `receive(timeout=None) -> FLModel | None`: the current task's model, the same one until
  `send`; None once the job is over (END_RUN, abort) or after `timeout` seconds.
* `send(model, clear_cache=True)`: the result of the current task.
* `is_running()`: False once the job is over (it waits for the next task).
* `get_job_id()`, `get_site_name()`, `get_task_name()`, `is_train()`, `is_evaluate()`,
  `is_submit_model()`, `shutdown()`.
* `transfer_stats()`: what this trainer's transfers did so far (cumulative bytes downloaded,
  reused from its cache, uploaded; URLs re-signed).

Site filters configured on the executor run here, on real arrays: `process(params, "in")` after
download, `process(params, "out")` before upload. A task whose data cannot be loaded, a result
that cannot be sent and an uncaught exception in the script are reported to the client job as
the task's error before they propagate.
"""

from __future__ import annotations

import os
import threading
import warnings

from fedhive.client.api import ClientAPI, connect
from fedhive.client.pipe import ENV_JOB_ID, ENV_SITE
from fedhive.fl.model import FLModel, ParamsType

__all__ = [
    "FLModel",
    "ParamsType",
    "get_job_id",
    "get_site_name",
    "get_task_name",
    "init",
    "is_evaluate",
    "is_running",
    "is_submit_model",
    "is_train",
    "receive",
    "send",
    "shutdown",
    "transfer_stats",
]

TRAIN_TASK = "train"
EVALUATE_TASK = "validate"
SUBMIT_MODEL_TASK = "submit_model"
_NOT_INITIALIZED = ("APIContext is None. Did you call fedhive.client.init() before using the "
                    "Client API?")

_lock = threading.Lock()
_api: ClientAPI | None = None
_rank: str | None = None


def init(rank: str | int | None = None) -> None:
    global _api, _rank
    with _lock:
        if _rank is not None:
            warnings.warn("fedhive.client.init() was called already: ignored", stacklevel=2)
            return
        chosen = str(rank) if rank is not None else os.environ.get("RANK", "0")
        if chosen == "0":
            _api = connect(chosen)
        _rank = chosen


def receive(timeout: float | None = None) -> FLModel | None:
    return _rank0("receive").receive(timeout)


def send(model: FLModel, clear_cache: bool = True) -> None:
    _rank0("send").send(model, clear_cache)


def is_running() -> bool:
    return _rank0("is_running").is_running()


def get_job_id() -> str:
    api = _context()
    return api.config.job_id if api is not None else os.environ.get(ENV_JOB_ID, "")


def get_site_name() -> str:
    api = _context()
    return api.config.site if api is not None else os.environ.get(ENV_SITE, "")


def get_task_name() -> str:
    return _rank0("get_task_name").task_name


def is_train() -> bool:
    return get_task_name() == TRAIN_TASK


def is_evaluate() -> bool:
    return get_task_name() == EVALUATE_TASK


def is_submit_model() -> bool:
    return get_task_name() == SUBMIT_MODEL_TASK


def transfer_stats() -> dict[str, int]:
    """Cumulative: `bytes_downloaded` (from S3), `bytes_reused` (cached tensors whose content
    had not changed), `bytes_stale` (cached but changed since: downloaded again),
    `bytes_uploaded` (to S3), `urls_resigned`."""
    api = _rank0("transfer_stats")
    return {"bytes_downloaded": api.fetcher.bytes_fetched,
            "bytes_reused": api.cache.bytes_reused,
            "bytes_stale": api.cache.bytes_stale,
            "bytes_uploaded": api.uploader.bytes_sent,
            "urls_resigned": api.fetcher.urls_resigned}


def shutdown() -> None:
    """Close the pipe (the client job sees the trainer go); init() may be called again."""
    global _api, _rank
    with _lock:
        api, _api, _rank = _api, None, None
    if api is not None:
        api.close()


def _context() -> ClientAPI | None:
    if _rank is None:
        raise RuntimeError(_NOT_INITIALIZED)
    return _api


def _rank0(what: str) -> ClientAPI:
    api = _context()
    if api is None:
        raise RuntimeError(f"only rank 0 can call {what}!")
    return api
