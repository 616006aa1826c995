"""The code behind `fedhive.jobs.flare_paths.TABLE` where FLARE's arguments do not map one to
one: FLARE's paths, what an adapter may ask of the config its component is in (`Context`), and
the adapters, each taking the FLARE arguments it handles out of `args` and returning fedhive's.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from fedhive.text import clip


class Context(Protocol):
    """What an adapter may ask about the config its component is in."""

    def component(self, cid: Any) -> Mapping[str, Any] | None:
        """The config's component with this id, as written (None: no such component)."""
        ...

    def first_with(self, *paths: str) -> str | None:
        """The id of the config's first component with one of these paths."""
        ...

    def script_problem(self, script: str) -> str | None:
        """Why `custom/...` script `script` cannot run (missing, imports nvflare.client), or
        None (fine, or the app's files are not at hand)."""
        ...


class NoConfig:
    """The context of a component built on its own: it names no other component."""

    def component(self, cid: Any) -> Mapping[str, Any] | None:
        return None

    def first_with(self, *paths: str) -> str | None:
        return None

    def script_problem(self, script: str) -> str | None:
        return None


Report = Callable[[str], None]
# Takes the FLARE arguments it handles out of `args` and returns fedhive's arguments for them.
Adapter = Callable[[dict[str, Any], Context, Report], dict[str, Any]]


# paths ------------------------------------------------------------------------------------
AC = "nvflare.app_common."  # most of FLARE's paths start so
SAG = AC + "workflows.scatter_and_gather.ScatterAndGather"
FEDAVG = AC + "workflows.fedavg.FedAvg"
CSE = AC + "workflows.cross_site_model_eval.CrossSiteModelEval"
CYCLIC = AC + "workflows.cyclic_ctl.CyclicController"
INTIME = AC + "aggregators.intime_accumulate_model_aggregator.InTimeAccumulateWeightedAggregator"
ACCUMULATE = AC + "aggregators.accumulate_model_aggregator.AccumulateWeightedAggregator"
FULL_MODEL = (AC + "shareablegenerators.full_model_shareable_generator."
              "FullModelShareableGenerator")
NP_PERSISTOR = AC + "np.np_model_persistor.NPModelPersistor"
PT_PERSISTOR = "nvflare.app_opt.pt.file_model_persistor.PTFileModelPersistor"
NP_LOCATOR = AC + "np.np_model_locator.NPModelLocator"
PT_LOCATOR = "nvflare.app_opt.pt.file_model_locator.PTFileModelLocator"
LAUNCHER = AC + "launchers.subprocess_launcher.SubprocessLauncher"
LAUNCHER_EXECUTOR = AC + "executors.client_api_launcher_executor.ClientAPILauncherExecutor"
PT_LAUNCHER_EXECUTOR = "nvflare.app_opt.pt.client_api_launcher_executor.PTClientAPILauncherExecutor"
IN_PROCESS = AC + "executors.in_process_client_api_executor.InProcessClientAPIExecutor"
PT_IN_PROCESS = "nvflare.app_opt.pt.in_process_client_api_executor.PTInProcessClientAPIExecutor"
SCRIPT_RUNNER = "nvflare.job_config.script_runner.ScriptRunner"

_EXCHANGE_FORMATS = ("numpy", "pytorch")


def _exchange(args: dict[str, Any], report: Report) -> dict[str, Any]:
    """params_exchange_format and memory_gc_rounds, common to the client API executors."""
    fmt = args.pop("params_exchange_format", "numpy")
    if fmt not in _EXCHANGE_FORMATS:
        report(f"argument params_exchange_format {clip(fmt)} is not supported: arrays reach "
               "the script as numpy arrays or torch tensors, in the kind the server sent")
    rounds = args.pop("memory_gc_rounds", 0)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        report(f"argument memory_gc_rounds must be an integer >= 0, not {clip(rounds)}")
        return {}
    return {"memory_hygiene": True} if rounds > 0 else {}


def _script(ctx: Context, report: Report, script: str) -> None:
    problem = ctx.script_problem(script)
    if problem is not None:
        report(problem)


def launcher_executor(args: dict[str, Any], ctx: Context, report: Report) -> dict[str, Any]:
    out = _exchange(args, report)
    launcher_id = args.pop("launcher_id", None)
    spec = ctx.component(launcher_id) if isinstance(launcher_id, str) else None
    if spec is None or spec.get("path") != LAUNCHER:
        what = "no component" if spec is None else clip(spec.get("path"))
        report(f"launcher_id {clip(launcher_id)} must name a SubprocessLauncher component of "
               f"this config (it holds the command that starts the script), it names {what}")
        return out
    largs = dict(spec.get("args") or {})
    script = largs.pop("script", None)
    if not isinstance(script, str) or not script.strip():
        report(f"launcher {clip(launcher_id)}: script must be the command that starts the "
               f"trainer, not {clip(script)}")
        return out
    out["command"] = script.strip()
    out["launch_once"] = largs.pop("launch_once", True)
    grace = largs.pop("shutdown_timeout", None)
    if grace is not None:
        out["stop_grace"] = grace
    if largs.pop("clean_up_script", None) is not None:
        report(f"launcher {clip(launcher_id)}: clean_up_script is not supported (the trainer "
               "cleans up before it exits)")
    for name in largs:
        report(f"launcher {clip(launcher_id)}: argument {clip(name)} of SubprocessLauncher is "
               "not supported (it takes script, launch_once, shutdown_timeout)")
    for token in _split(script):
        if token.startswith("custom/"):
            _script(ctx, report, token)
            break
    return out


def in_process(args: dict[str, Any], ctx: Context, report: Report) -> dict[str, Any]:
    out = _exchange(args, report)
    path = args.pop("task_script_path", None)
    script_args = args.pop("task_script_args", "")
    if not isinstance(path, str) or not path.endswith(".py"):
        report(f"task_script_path must name the script's .py file in custom/, not {clip(path)}")
        return out
    if not isinstance(script_args, str):
        report(f"task_script_args must be a string, not {clip(script_args)}")
        return out
    _script(ctx, report, f"custom/{path}")
    out["command"] = f"python -u custom/{path} {script_args}".strip()
    out["launch_once"] = True
    return out


def script_runner(args: dict[str, Any], ctx: Context, report: Report) -> dict[str, Any]:
    script = args.pop("script", None)
    script_args = args.pop("script_args", "")
    command = args.pop("command", "python3 -u")
    framework = args.pop("framework", "pytorch")
    if framework not in _EXCHANGE_FORMATS:
        report(f"argument framework {clip(framework)} is not supported (pytorch or numpy: "
               "arrays reach the script in the kind the server sent)")
    texts = (("script", script), ("script_args", script_args), ("command", command))
    for name, value in texts:
        if not isinstance(value, str):
            report(f"argument {name} must be a string, not {clip(value)}")
            return {}
    if not script:
        report("argument script is required (the script's path in custom/)")
        return {}
    _script(ctx, report, f"custom/{script}")
    return {"command": f"{command} custom/{script} {script_args}".strip(), "launch_once": True}


# server components ------------------------------------------------------------------------
def np_persistor(args: dict[str, Any], ctx: Context, report: Report) -> dict[str, Any]:
    """FLARE's NPModelPersistor: one array under "numpy_key", [[1,2,3],[4,5,6],[7,8,9]] unless
    `initial_model` is given, saved to <model_dir>/<model_name> of the result."""
    model_dir = args.pop("model_dir", "models")
    model_name = args.pop("model_name", "server.npy")
    initial = args.pop("initial_model", None)
    for name, value in (("model_dir", model_dir), ("model_name", model_name)):
        if not isinstance(value, str) or not value:
            report(f"argument {name} must be a non-empty string, not {clip(value)}")
            return {}
    array = [[1, 2, 3], [4, 5, 6], [7, 8, 9]] if initial is None else initial
    return {"initial": {"numpy_key": array}, "dtype": "float32",
            "final_file": f"{model_dir}/{model_name}"}


def pt_persistor(args: dict[str, Any], ctx: Context, report: Report) -> dict[str, Any]:
    """FLARE's PTFileModelPersistor: `model` is a component id or a {path, args} object; the
    model is saved as FL_global_model.pt unless global_model_file_name says otherwise."""
    model = args.pop("model", None)
    if isinstance(model, str):
        spec = ctx.component(model)
        if spec is None:
            report(f"argument model names component {clip(model)}, which this config does not "
                   "define")
            return {}
        model = {"path": spec.get("path"), "args": spec.get("args", {})}
    elif not isinstance(model, dict) or "path" not in model:
        report("argument model is required: the torch module, as a component id or a "
               "{path, args} object")
        return {}
    return {"model": model, "final_file": "FL_global_model.pt"}


def cross_site_eval(args: dict[str, Any], ctx: Context, report: Report) -> dict[str, Any]:
    """model_locator_id -> persistor_id: FLARE's NPModelLocator and PTFileModelLocator find the
    model the persistor saved, which is what fedhive's persistor_id validates."""
    locator_id = args.pop("model_locator_id", "")
    if not locator_id:
        return {}
    spec = ctx.component(locator_id)
    path = spec.get("path") if spec is not None else None
    if path == PT_LOCATOR and spec is not None:
        persistor = (spec.get("args") or {}).get("pt_persistor_id", "persistor")
    elif path == NP_LOCATOR:
        persistor = ctx.first_with(NP_PERSISTOR)
        if persistor is None:
            report(f"model_locator_id {clip(locator_id)}: NPModelLocator finds the model an "
                   "NPModelPersistor saved, and this config has none")
            return {}
    else:
        report(f"model_locator_id {clip(locator_id)} must name an NPModelLocator or "
               f"PTFileModelLocator component of this config, not {clip(path)}")
        return {}
    if isinstance(persistor, str) and ctx.component(persistor) is None:
        report(f"model_locator_id {clip(locator_id)}: its persistor {clip(persistor)} is not "
               "a component of this config")
        return {}
    return {"persistor_id": persistor}


def aggregator(args: dict[str, Any], ctx: Context, report: Report) -> dict[str, Any]:
    """FLARE's per-DXO-key forms (a dict of kinds, of patterns, of weights per key) are for
    DXO collections, which fedhive's aggregator does not take."""
    for name in ("expected_data_kind", "exclude_vars"):
        if isinstance(args.get(name), dict):
            report(f"argument {name}: the per-key (dict) form is not supported; give one value")
            args.pop(name)
    weights = args.get("aggregation_weights")
    if isinstance(weights, dict) and any(isinstance(w, dict) for w in weights.values()):
        report("argument aggregation_weights: the per-key form (a dict of dicts) is not "
               "supported; give {site: weight}")
        args.pop("aggregation_weights")
    return {}


def fedavg(args: dict[str, Any], ctx: Context, report: Report) -> dict[str, Any]:
    """FLARE 2.4's FedAvg took `min_clients` where later ones take `num_clients`."""
    if "min_clients" in args:
        if "num_clients" in args:
            report("give num_clients or min_clients (FLARE 2.4's name for it), not both")
        return {"num_clients": args.pop("min_clients")}
    return {}


def _split(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()
