"""FLARE's built-in component paths and what each is in fedhive: one table for app configs.

A FLARE config names FLARE's own classes (`nvflare.app_common.workflows.fedavg.FedAvg`). Each
`nvflare.` path in `TABLE` is one of:

* `Equivalent`: fedhive's class that does the same, built with the same arguments. Its fields
  say what differs: `renamed` (FLARE's name -> fedhive's), `ignored` (FLARE-only arguments with
  no meaning here, each with why: accepted and dropped), `only` (arguments fedhive supports at
  FLARE's default value only: another value is refused), `adapt` (arguments turned into
  fedhive's in code: two FLARE components folded into one, a component id resolved). Any other
  argument fedhive's class does not take is refused, naming it.
* `Absorbed`: a component fedhive needs no object for (pipes, launchers, model locators, event
  relays): its work is done by fedhive itself or by the component that names it, so it is
  dropped from the config, with why.
* `Refused`: no equivalent, with why and what to do instead.

Any other `nvflare.` path is refused too. `map_component` applies an entry to one component;
`fedhive.jobs.flare_config` applies it to a whole config (where components name each other),
both when a job is validated and when its server and client jobs build it, so what validates
is what starts. docs/migrating.md walks a FLARE job through it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedhive.jobs.flare_adapters import (
    AC,
    ACCUMULATE,
    CSE,
    CYCLIC,
    FEDAVG,
    FULL_MODEL,
    IN_PROCESS,
    INTIME,
    LAUNCHER,
    LAUNCHER_EXECUTOR,
    NP_LOCATOR,
    NP_PERSISTOR,
    PT_IN_PROCESS,
    PT_LAUNCHER_EXECUTOR,
    PT_LOCATOR,
    PT_PERSISTOR,
    SAG,
    SCRIPT_RUNNER,
    Adapter,
    Context,
    NoConfig,
    aggregator,
    cross_site_eval,
    fedavg,
    in_process,
    launcher_executor,
    np_persistor,
    pt_persistor,
    script_runner,
)
from fedhive.text import clip

FLARE_PREFIX = "nvflare."


@dataclass(frozen=True)
class Equivalent:
    path: str  # fedhive's class
    renamed: Mapping[str, str] = field(default_factory=dict)  # FLARE's argument -> fedhive's
    ignored: Mapping[str, str] = field(default_factory=dict)  # argument -> why it means nothing
    only: Mapping[str, tuple[Any, str]] = field(default_factory=dict)  # arg -> (default, why)
    adapt: Adapter | None = None


@dataclass(frozen=True)
class Absorbed:
    why: str


@dataclass(frozen=True)
class Refused:
    why: str


Entry = Equivalent | Absorbed | Refused

_WORKFLOWS = "fedhive.fl.workflows."
_CLIENT_API = "fedhive.fl.client_api_executor.ClientAPIExecutor"
_NO_GC = "fedhive's server job holds no model between rounds (it stays in object storage)"
_STREAMED = ("fedhive streams every result tensor by tensor from object storage; nothing is "
             "held in memory to offload")
_POLL = "fedhive's workflows wait on events, not by polling"
_PIPE = "fedhive's client job talks to the trainer over its own local pipe"


def _only_default(value: Any) -> tuple[Any, str]:
    return value, "fedhive's equivalent has no other behaviour"


# client API executors: what their FLARE arguments mean for fedhive's ClientAPIExecutor ------
_CLIENT_API_IGNORED = {
    "pipe_id": _PIPE + " (the pipe components are dropped)",
    "launch_timeout": ("the script is started directly; the time it has to call init() is "
                       "external_pre_init_timeout"),
    "last_result_transfer_timeout": "the trainer uploads its result itself before it exits",
    "peer_read_timeout": _PIPE + ", which needs no read timeout",
    "monitor_interval": _PIPE + ", which tells at once when the trainer exits",
    "read_interval": _PIPE + ", which is not polled",
    "heartbeat_interval": _PIPE + ", which tells at once when the trainer exits",
    "heartbeat_timeout": _PIPE + ", which tells at once when the trainer exits",
    "workers": "the client job needs no worker threads for the pipe",
    "train_with_evaluation": "the script evaluates when it wants; every metric it sends is kept",
    "server_expected_format": ("arrays travel in the kind the server's persistor keeps them "
                               "(numpy or torch)"),
    "config_file_name": "the script gets its configuration through the pipe, not a file",
    "cuda_empty_cache": "memory_hygiene (set by memory_gc_rounds) empties torch's CUDA cache",
}
_IN_PROCESS_IGNORED = {
    "train_with_evaluation": _CLIENT_API_IGNORED["train_with_evaluation"],
    "result_pull_interval": _PIPE + ", which is not polled",
    "log_pull_interval": _PIPE + ", which is not polled",
}
_CLIENT_API_ONLY = {
    "train_task_name": ("train", "fedhive.client.is_train() means the task 'train'"),
    "evaluate_task_name": ("validate", "fedhive.client.is_evaluate() means the task 'validate'"),
    "submit_model_task_name": ("submit_model",
                               "fedhive.client.is_submit_model() means the task 'submit_model'"),
    "from_nvflare_converter_id": _only_default(None),
    "to_nvflare_converter_id": _only_default(None),
    "params_transfer_type": ("FULL", "fedhive sends what the script sends; a script that "
                                     "sends a difference says so (FLModel params_type DIFF)"),
}
_IN_TIME = Equivalent("fedhive.fl.aggregators.InTimeAccumulateWeightedAggregator",
                      adapt=aggregator)
_LAUNCHER_EXECUTOR = Equivalent(
    _CLIENT_API,
    renamed={"task_wait_timeout": "task_timeout", "external_pre_init_timeout": "launch_timeout"},
    ignored=_CLIENT_API_IGNORED, only=_CLIENT_API_ONLY, adapt=launcher_executor)
_IN_PROCESS = Equivalent(
    _CLIENT_API, renamed={"task_wait_time": "task_timeout"},
    ignored=_IN_PROCESS_IGNORED, only=_CLIENT_API_ONLY, adapt=in_process)
_TB = Refused("fedhive writes no TensorBoard files: each round's metrics are in the result's "
              "metrics.json and shown by `fedhive metrics`; remove it")

TABLE: dict[str, Entry] = {
    # workflows
    SAG: Equivalent(_WORKFLOWS + "ScatterAndGather", ignored={
        "memory_gc_rounds": _NO_GC, "enable_tensor_disk_offload": _STREAMED}),
    FEDAVG: Equivalent(_WORKFLOWS + "FedAvg", ignored={
        "task_check_period": _POLL, "memory_gc_rounds": _NO_GC,
        "enable_tensor_disk_offload": _STREAMED, "stream_to_disk": _STREAMED,
        "persist_every_n_rounds": "fedhive's FedAvg saves the model every round"}, only={
        "model": (None, "the initial model comes from the persistor (persistor_id)"),
        "save_filename": ("FL_global_model.pt", "the persistor names the saved model"),
        "aggregator": (None, "give an aggregator component's id as aggregator_id"),
        "exclude_vars": (None, "use an aggregator component (aggregator_id) with exclude_vars"),
        "aggregation_weights": (None, "use an aggregator component (aggregator_id) with "
                                      "aggregation_weights"),
        "fedprox_mu": (None, "fedhive's FedAvg has no FedProx term"),
        "ignore_result_error": (False, "a site's error result ends the workflow"),
        "allow_empty_global_weights": _only_default(False)}, adapt=fedavg),
    CSE: Equivalent(_WORKFLOWS + "CrossSiteModelEval", ignored={
        "task_check_period": _POLL,
        "formatter_id": ("the table is cross_val_results.json in the result; a formatter only "
                         "logs it"),
        "cleanup_models": "submitted models are deleted from object storage once validated",
        "wait_for_clients_timeout": "the participants are the job's sites, there from the start",
    }, adapt=cross_site_eval),
    CYCLIC: Equivalent(_WORKFLOWS + "Cyclic", ignored={
        "task_check_period": _POLL, "memory_gc_rounds": _NO_GC}),
    # server components
    INTIME: _IN_TIME,
    ACCUMULATE: _IN_TIME,
    FULL_MODEL: Equivalent("fedhive.fl.shareables.FullModelShareableGenerator"),
    NP_PERSISTOR: Equivalent("fedhive.fl.persistors.NumpyModelPersistor", adapt=np_persistor),
    PT_PERSISTOR: Equivalent(
        "fedhive.fl.persistors.TorchModelPersistor",
        renamed={"global_model_file_name": "final_file"},
        ignored={
            "best_global_model_file_name": "fedhive keeps no best model (no model selector)",
            "load_weights_only": "fedhive loads no checkpoint (source_ckpt_file_full_name)",
            "allow_numpy_conversion": "the model travels as torch tensors, as it is kept"},
        only={"exclude_vars": (None, "every variable of the module is saved"),
              "source_ckpt_file_full_name": (None, "the initial model is the module's own "
                                                   "weights; load a checkpoint in its code"),
              "filter_id": _only_default(None)},
        adapt=pt_persistor),
    NP_LOCATOR: Absorbed("CrossSiteModelEval's model_locator_id becomes persistor_id: the "
                         "persistor's model is the one validated"),
    PT_LOCATOR: Absorbed("CrossSiteModelEval's model_locator_id becomes persistor_id: the "
                         "persistor's model is the one validated"),
    AC + "np.np_formatter.NPFormatter": Absorbed(
        "CrossSiteModelEval writes cross_val_results.json; a formatter only logs the table"),
    AC + "widgets.validation_json_generator.ValidationJsonGenerator": Absorbed(
        "CrossSiteModelEval writes cross_val_results.json itself"),
    AC + "widgets.intime_model_selector.IntimeModelSelector": Refused(
        "fedhive keeps no best model: the final model is the persistor's and each round's "
        "metrics are in metrics.json; remove it"),
    "nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver": _TB,
    "nvflare.app_common.pt.tb_receiver.TBAnalyticsReceiver": _TB,
    AC + "workflows.scatter_and_gather_scaffold.ScatterAndGatherScaffold": Refused(
        "fedhive has no SCAFFOLD workflow"),
    # site components
    LAUNCHER_EXECUTOR: _LAUNCHER_EXECUTOR,
    PT_LAUNCHER_EXECUTOR: _LAUNCHER_EXECUTOR,
    IN_PROCESS: _IN_PROCESS,
    PT_IN_PROCESS: _IN_PROCESS,
    SCRIPT_RUNNER: Equivalent(_CLIENT_API, ignored={
        "launch_external_process": "fedhive always runs the script in a process of its own",
        "server_expected_format": _CLIENT_API_IGNORED["server_expected_format"],
        "pipe_connect_type": _PIPE}, only={
        "params_transfer_type": _CLIENT_API_ONLY["params_transfer_type"]},
        adapt=script_runner),
    LAUNCHER: Absorbed("its script becomes the command of the executor that names it "
                       "(launcher_id)"),
    "nvflare.fuel.utils.pipe.cell_pipe.CellPipe": Absorbed(_PIPE),
    "nvflare.fuel.utils.pipe.file_pipe.FilePipe": Absorbed(_PIPE),
    AC + "widgets.metric_relay.MetricRelay": Absorbed(
        "metrics the script sends travel with its result"),
    AC + "widgets.external_configurator.ExternalConfigurator": Absorbed(
        "the script gets its configuration through fedhive's pipe"),
    AC + "widgets.convert_to_fed_event.ConvertToFedEvent": Absorbed(
        "fedhive sends no events between sites: metrics travel with each result"),
    AC + "np.np_trainer.NPTrainer": Refused(
        "fedhive has no built-in numpy trainer: write an executor in custom/ (docs/jobs.md, "
        "Executors) or a client API script"),
    AC + "np.np_validator.NPValidator": Refused(
        "fedhive has no built-in numpy validator: write an executor in custom/ (docs/jobs.md, "
        "Executors) or a client API script"),
}
BY_NAME = {path.rpartition(".")[2]: path for path in reversed(TABLE)}  # FLARE's `name` form


def is_flare(path: object) -> bool:
    return isinstance(path, str) and path.startswith(FLARE_PREFIX)


def map_component(spec: Mapping[str, Any],
                  ctx: Context | None = None) -> tuple[dict[str, Any] | None, list[str]]:
    """The fedhive component for a `{id, path: "nvflare...", args}` entry (None: absorbed,
    nothing to build) and the problems found, one line each (empty: it maps)."""
    path = spec.get("path")
    entry = TABLE.get(path) if isinstance(path, str) else None
    if isinstance(entry, Absorbed):
        return None, []
    if isinstance(entry, Refused):
        return None, [f"{path}: {entry.why}"]
    if entry is None:
        return None, [f"{clip(path, quote=False)} has no fedhive equivalent (the FLARE "
                      "components fedhive maps are listed in docs/migrating.md)"]
    problems: list[str] = []

    def report(message: str) -> None:
        problems.append(f"{path}: {message}")

    raw = spec.get("args", {})
    if raw is not None and not isinstance(raw, dict):
        return None, [f"{path}: args must be an object, not {clip(raw)}"]
    args = dict(raw or {})
    out = entry.adapt(args, ctx or NoConfig(), report) if entry.adapt else {}
    accepted, takes_any = parameters(entry.path)
    for name, value in args.items():
        if name in entry.renamed:
            if value is not None:  # FLARE's None is fedhive's default
                out[entry.renamed[name]] = value
        elif name in entry.ignored:
            continue
        elif name in entry.only:
            default, why = entry.only[name]
            if value != default:
                report(f"argument {name} {clip(value)} is not supported, only {clip(default)} "
                       f"({why})")
        elif name in accepted or takes_any:
            out[name] = value
        else:
            report(f"argument {clip(name)} is not supported: fedhive's equivalent "
                   f"{entry.path} takes {', '.join(sorted(accepted)) or 'none'}")
    mapped = {"path": entry.path, "args": out}
    if "id" in spec:
        mapped = {"id": spec["id"], **mapped}
    return mapped, problems


@functools.cache
def parameters(path: str) -> tuple[frozenset[str], bool]:
    """The keyword arguments fedhive's class at `path` takes, and whether it takes any."""
    module_name, _, class_name = path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    params = inspect.signature(cls).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return frozenset(named), any(p.kind is p.VAR_KEYWORD for p in params)


