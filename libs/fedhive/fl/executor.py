"""Executors: what a client job runs for each task it gets (FLARE's Executor).

    class Trainer:
        def execute(self, task: ExecTask) -> Dxo:
            model = task.load()                   # the task's arrays, fetched and verified
            ...                                   # watch task.abort in long loops
            return Dxo(DataKind.WEIGHTS, new_arrays, {MetaKey.NUM_STEPS_CURRENT_ROUND: 32})

An executor that raises makes an error result (`EXECUTION_EXCEPTION` with the error's one
line, or the return code of a `TaskError`), never a client-job crash. The returned DXO's arrays
go back to the server job inline or uploaded (see `fedhive.fl.worker`); refs it returns pass
through when they name content keys (what a trainer subprocess uploaded, or task data handed
back). `task.server` reaches the server job (upload grants, completing multipart uploads,
re-signing URLs) for an executor that relays them, like `ClientAPIExecutor`.

An executor may define `finalize()`: the worker calls it once when the run ends (END_RUN, or
the client job is stopped), e.g. to stop a trainer subprocess.

`config_fed_client.json` (or `.conf`, `.yml`, `.yaml`: any of FLARE's forms, read as the job
validation read it, FLARE's component paths mapped: `fedhive.jobs.documents.load_app_config`)
maps task names to executors; its `components` are built first, and an
executor reaches them by id through `task.components` (FLARE's `engine.get_component(id)`):

    {"executors": [{"tasks": ["train", "validate"], "executor": {"path": "my.Trainer",
                    "args": {"lr": 0.01}}}],
     "components": [{"id": "data", "path": "my.Data", "args": {}}]}

`"*"` in `tasks` matches every task name no other entry lists.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from fedhive.blobs import PresignedUrl, RangeFetcher, TensorKind
from fedhive.blobs.keys import blame_uploader
from fedhive.errors import FedhiveError, InvalidArgument
from fedhive.fl.components import ComponentError, build_component
from fedhive.fl.dxo import Dxo, MetaKey
from fedhive.fl.result_packer import UploadChannel
from fedhive.jobs import documents

CLIENT_CONFIG = "config/config_fed_client.json"
ANY_TASK = "*"


class ServerChannel(UploadChannel, Protocol):
    """A task's line to its server job (RPCs on the job's server queue, as this site)."""

    def resign(self, keys: list[str]) -> dict[str, PresignedUrl]:
        """Fresh presigned GET URLs for these keys of the job."""
        ...


class TaskError(Exception):
    """Raised by an executor: the task fails with `return_code` and this one-line message."""

    def __init__(self, return_code: str, message: str) -> None:
        super().__init__(" ".join(message.split()))
        self.return_code = return_code


@dataclass
class ExecTask:
    name: str
    data: Dxo  # lazy: values are refs until `load`
    props: dict[str, Any]
    job_id: str
    site: str
    workspace: Path  # the client job's folder (the deployed app)
    abort: threading.Event  # set when the client job is stopped: return soon
    log: Any  # structlog logger bound with job, site and task
    fetcher: RangeFetcher  # reads the refs' presigned URLs (no credentials)
    task_id: str = ""
    timeout: float = 0.0  # seconds the server gives the task (0: no limit)
    server: ServerChannel | None = None  # set by the worker
    inline_threshold: int = 2 * 1024 * 1024  # the site's: result arrays up to it go inline
    inline_budget: int | None = None  # inline bytes per result (None: 8 x the threshold)
    components: Mapping[str, Any] = field(default_factory=dict)  # the client config's, by id

    @property
    def round(self) -> int | None:
        """The task's `current_round` meta, when it has one."""
        value = self.data.meta.get(MetaKey.CURRENT_ROUND)
        return int(value) if isinstance(value, int | float) else None

    def load(self, kind: TensorKind | None = None) -> Dxo:
        """The task's DXO with its arrays downloaded and checksum-verified (numpy arrays or
        torch tensors per ref, or all of `kind`). An error about an object another site
        uploaded (the cyclic relay, a cross-site evaluation) names that site."""
        try:
            return self.data.materialized(self.fetcher, kind=kind)
        except FedhiveError as err:
            blamed = blame_uploader(err, self.data.refs())
            if blamed is None:
                raise
            raise blamed from err


@runtime_checkable
class Executor(Protocol):
    def execute(self, task: ExecTask) -> Dxo: ...


@dataclass
class Executors:
    """Task name -> executor, with the `"*"` fallback."""

    by_task: dict[str, Executor] = field(default_factory=dict)
    components: dict[str, Any] = field(default_factory=dict)

    def get(self, task_name: str) -> Executor | None:
        return self.by_task.get(task_name) or self.by_task.get(ANY_TASK)

    @classmethod
    def from_config(cls, config: Any, where: str = CLIENT_CONFIG) -> Executors:
        """Build from a parsed config_fed_client.json; ComponentError naming the entry."""
        if not isinstance(config, dict):
            raise ComponentError(f"{where}: must be a JSON object")
        table = cls()
        components = config.get("components", [])
        entries = config.get("executors", [])
        if not isinstance(components, list) or not isinstance(entries, list):
            raise ComponentError(f"{where}: 'components' and 'executors' must be lists")
        for index, spec in enumerate(components):
            build_component(spec, f"{where} components[{index}]", table.components)
        for index, entry in enumerate(entries):
            label = f"{where} executors[{index}]"
            tasks = entry.get("tasks") if isinstance(entry, dict) else None
            if not isinstance(tasks, list) or not tasks \
                    or not all(isinstance(name, str) and name for name in tasks):
                raise ComponentError(f"{label}: 'tasks' must be a non-empty list of task names")
            executor = build_component(entry.get("executor"), f"{label} executor",
                                       table.components)
            if not isinstance(executor, Executor):
                raise ComponentError(f"{label}: {type(executor).__name__} is not an executor "
                                     "(it has no execute(task) method)")
            for name in tasks:
                if name in table.by_task:
                    raise ComponentError(f"{label}: task {name!r} already has an executor")
                table.by_task[name] = executor
        return table

    @classmethod
    def load(cls, app_dir: Path) -> Executors:
        """From `APP/config/config_fed_client.<json|conf|yml|yaml>`, with `APP/custom`
        importable."""
        custom = app_dir / "custom"
        if custom.is_dir() and str(custom) not in sys.path:
            sys.path.insert(0, str(custom))
        try:
            name, config = documents.load_app_config(app_dir, documents.CLIENT_CONFIG)
        except InvalidArgument as err:
            raise ComponentError(err.message) from None
        return cls.from_config(config, name)
