"""FLARE's component paths: each built-in fedhive has an equivalent for maps to it with the same
arguments, the rest is refused at validation naming the component and the argument; the
server and client jobs build what the validation checked (one table, `flare_paths.TABLE`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import structlog

from fedhive.fl.aggregators import InTimeAccumulateWeightedAggregator
from fedhive.fl.client_api_executor import ClientAPIExecutor
from fedhive.fl.components import ComponentError, build_component
from fedhive.fl.executor import Executors
from fedhive.fl.server_job import run_app
from fedhive.fl.shareables import FullModelShareableGenerator
from fedhive.fl.workflow import WorkflowContext
from fedhive.fl.workflows import ScatterAndGather
from fedhive.jobs import flare_paths as fp
from fedhive.jobs.archive import ArchiveLimits
from fedhive.jobs.components import check_components
from fedhive.jobs.custom_code import CustomCode
from fedhive.jobs.files import folder_files
from fedhive.jobs.flare_config import translate_config

DOCS = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"
FILE = "app/config/config_fed_server.json"


def translate(config: dict[str, Any], custom: CustomCode | None = None,
              ) -> tuple[dict[str, Any], list[str]]:
    """The translated config and its problems as `field: message` lines."""
    done = translate_config(config, FILE, custom)
    problems = [f"{f}: {m}" for f, m in done.problems]
    problems += [f"{f}: {m}" for f, m in check_components(done.config, FILE, custom)]
    return done.config, problems


def component(path: str, args: dict[str, Any] | None = None, cid: str = "c") -> dict[str, Any]:
    return {"id": cid, "path": path, "args": args or {}}


# the table ---------------------------------------------------------------------------------
def test_every_equivalent_names_a_fedhive_class_and_its_arguments() -> None:
    for path, entry in fp.TABLE.items():
        assert path.startswith("nvflare."), path
        if not isinstance(entry, fp.Equivalent):
            assert entry.why, path
            continue
        accepted, _ = fp.parameters(entry.path)
        assert set(entry.renamed.values()) <= accepted, path
        for name in [*entry.ignored, *entry.only]:
            # a FLARE argument named like one of fedhive's is dropped or checked, never passed
            # on: only one meaning the same (the target of a rename) may share the name
            assert name not in accepted or name in entry.renamed.values(), (path, name)
            assert name not in entry.renamed, path
        assert all(why for why in entry.ignored.values()), path


def test_every_path_and_ignored_argument_is_in_the_migration_guide() -> None:
    guide = DOCS.read_text()
    for path, entry in fp.TABLE.items():
        assert path.rpartition(".")[2] in guide, f"{path} is not in docs/migrating.md"
        if isinstance(entry, fp.Equivalent):
            for name in [*entry.ignored, *entry.only, *entry.renamed]:
                assert f"`{name}`" in guide, f"{path}'s argument {name} is not documented"


# workflows ---------------------------------------------------------------------------------
SAG_ARGS = {"min_clients": 2, "num_rounds": 3, "start_round": 0,
            "wait_time_after_min_received": 10, "aggregator_id": "aggregator",
            "persistor_id": "persistor", "shareable_generator_id": "shareable_generator",
            "train_task_name": "train", "train_timeout": 0, "ignore_result_error": None,
            "allow_empty_global_weights": False, "task_check_period": 0.5,
            "persist_every_n_rounds": 1, "snapshot_every_n_rounds": 1}


def test_scatter_and_gather_takes_flares_arguments_and_drops_the_documented_ones() -> None:
    config, problems = translate({"workflows": [component(
        fp.SAG, {**SAG_ARGS, "memory_gc_rounds": 1, "enable_tensor_disk_offload": True},
        "sag")]})
    assert problems == []
    assert config["workflows"] == [{"id": "sag", "path": "fedhive.fl.workflows.ScatterAndGather",
                                    "args": SAG_ARGS}]


def test_an_argument_the_equivalent_does_not_take_is_refused_naming_it() -> None:
    _, problems = translate({"workflows": [component(fp.SAG, {"num_round": 3}, "sag")]})
    assert len(problems) == 1
    assert problems[0].startswith(
        f"{FILE} component 'sag': {fp.SAG}: argument 'num_round' is not supported: fedhive's "
        "equivalent fedhive.fl.workflows.ScatterAndGather takes aggregator_id, ")


def test_fedavg_maps_and_refuses_what_fedhives_fedavg_cannot_do() -> None:
    config, problems = translate({"workflows": [component(fp.FEDAVG, {
        "num_clients": 2, "num_rounds": 3, "persistor_id": "p", "stop_cond": "accuracy >= 0.9",
        "patience": 2, "task_name": "train", "stream_to_disk": True, "aggregator": None})]})
    assert problems == []
    assert config["workflows"][0]["args"] == {
        "num_clients": 2, "num_rounds": 3, "persistor_id": "p", "stop_cond": "accuracy >= 0.9",
        "patience": 2, "task_name": "train"}
    config, problems = translate({"workflows": [component(fp.FEDAVG, {"min_clients": 2})]})
    assert problems == [] and config["workflows"][0]["args"] == {"num_clients": 2}
    _, problems = translate({"workflows": [component(fp.FEDAVG, {
        "fedprox_mu": 0.01, "aggregation_weights": {"site-1": 2.0}})]})
    assert problems == [
        f"{FILE} component 'c': {fp.FEDAVG}: argument fedprox_mu 0.01 is not supported, only "
        "null (fedhive's FedAvg has no FedProx term)",
        f"{FILE} component 'c': {fp.FEDAVG}: argument aggregation_weights {{\"site-1\": 2.0}} "
        "is not supported, only null (use an aggregator component (aggregator_id) with "
        "aggregation_weights)",
    ]


def test_cyclic_controller_and_cross_site_eval_with_its_model_locator() -> None:
    persistor = component(fp.NP_PERSISTOR, {}, "persistor")
    config, problems = translate({
        "components": [persistor, component(fp.NP_LOCATOR, {}, "locator"),
                       component("nvflare.app_common.np.np_formatter.NPFormatter", {}, "fmt")],
        "workflows": [
            component(fp.CYCLIC, {"num_rounds": 2, "task_check_period": 0.5,
                                  "order": "RANDOM"}, "cyc"),
            component(fp.CSE, {"model_locator_id": "locator", "formatter_id": "fmt",
                               "cleanup_models": True, "submit_model_timeout": 60}, "cse")]})
    assert problems == []
    assert [c["id"] for c in config["components"]] == ["persistor"]  # the locator is folded in
    assert config["workflows"] == [
        {"id": "cyc", "path": "fedhive.fl.workflows.Cyclic",
         "args": {"num_rounds": 2, "order": "RANDOM"}},
        {"id": "cse", "path": "fedhive.fl.workflows.CrossSiteModelEval",
         "args": {"persistor_id": "persistor", "submit_model_timeout": 60}}]
    pt = {"components": [component(fp.PT_LOCATOR, {"pt_persistor_id": "pt"}, "loc"),
                         component("net.Net", {}, "pt")],
          "workflows": [component(fp.CSE, {"model_locator_id": "loc"})]}
    config, problems = translate(pt)
    assert problems == [] and config["workflows"][0]["args"] == {"persistor_id": "pt"}
    _, problems = translate({"components": [component(fp.NP_LOCATOR, {}, "locator")],
                             "workflows": [component(fp.CSE, {"model_locator_id": "locator"})]})
    assert problems == [
        f"{FILE} component 'c': {fp.CSE}: model_locator_id 'locator': NPModelLocator finds the "
        "model an NPModelPersistor saved, and this config has none"]


# server components -------------------------------------------------------------------------
def test_numpy_persistor_starts_from_flares_default_array() -> None:
    config, problems = translate({"components": [
        component(fp.NP_PERSISTOR, {"model_dir": "m", "model_name": "g.npy"}, "p"),
        component(fp.INTIME, {"expected_data_kind": "WEIGHT_DIFF", "exclude_vars": "bn.*",
                              "aggregation_weights": {"site-1": 1.0}}, "agg"),
        component(fp.FULL_MODEL, {}, "gen")]})
    assert problems == []
    assert config["components"] == [
        {"id": "p", "path": "fedhive.fl.persistors.NumpyModelPersistor",
         "args": {"initial": {"numpy_key": [[1, 2, 3], [4, 5, 6], [7, 8, 9]]},
                  "dtype": "float32", "final_file": "m/g.npy"}},
        {"id": "agg", "path": "fedhive.fl.aggregators.InTimeAccumulateWeightedAggregator",
         "args": {"expected_data_kind": "WEIGHT_DIFF", "exclude_vars": "bn.*",
                  "aggregation_weights": {"site-1": 1.0}}},
        {"id": "gen", "path": "fedhive.fl.shareables.FullModelShareableGenerator", "args": {}}]
    _, problems = translate({"components": [component(fp.INTIME, {
        "expected_data_kind": {"model": "WEIGHTS"}}, "agg")]})
    assert problems == [f"{FILE} component 'agg': {fp.INTIME}: argument expected_data_kind: "
                        "the per-key (dict) form is not supported; give one value"]


def test_torch_persistor_resolves_its_model_component() -> None:
    config, problems = translate({"components": [
        component("net.Net", {"hidden": 8}, "model"),
        component(fp.PT_PERSISTOR, {"model": "model", "global_model_file_name": "g.pt",
                                    "best_global_model_file_name": "b.pt"}, "persistor")]})
    assert problems == []
    assert config["components"][1] == {
        "id": "persistor", "path": "fedhive.fl.persistors.TorchModelPersistor",
        "args": {"model": {"path": "net.Net", "args": {"hidden": 8}}, "final_file": "g.pt"}}
    _, problems = translate({"components": [component(fp.PT_PERSISTOR, {"model": "nope"})]})
    assert problems == [f"{FILE} component 'c': {fp.PT_PERSISTOR}: argument model names "
                        "component 'nope', which this config does not define"]
    _, problems = translate({"components": [component(fp.PT_PERSISTOR, {
        "model": {"path": "net.Net"}, "source_ckpt_file_full_name": "/tmp/x.pt"})]})
    assert len(problems) == 1 and "argument source_ckpt_file_full_name" in problems[0]


@pytest.mark.parametrize(("path", "message"), [
    ("nvflare.app_common.widgets.intime_model_selector.IntimeModelSelector",
     "fedhive keeps no best model"),
    ("nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver", "writes no TensorBoard"),
    ("nvflare.app_common.np.np_trainer.NPTrainer", "no built-in numpy trainer"),
    ("nvflare.app_common.ccwf.swarm_server_ctl.SwarmServerController",
     "nvflare.app_common.ccwf.swarm_server_ctl.SwarmServerController has no fedhive "
     "equivalent (the FLARE components fedhive maps are listed in docs/migrating.md)"),
])
def test_flare_paths_without_an_equivalent_are_refused_naming_the_component(
        path: str, message: str) -> None:
    _, problems = translate({"components": [component(path, {}, "widget")]})
    assert len(problems) == 1
    assert problems[0].startswith(f"{FILE} component 'widget': ") and message in problems[0]


def test_name_form_disabled_components_and_absorbed_ones_in_the_wrong_place() -> None:
    config, problems = translate({
        "components": [{"id": "gen", "name": "FullModelShareableGenerator"},
                       {"id": "off", "path": "nvflare.anything.Else", "disabled": True}],
        "workflows": [{"id": "v", "name": "ValidationJsonGenerator"}]})
    assert config["components"] == [
        {"id": "gen", "path": "fedhive.fl.shareables.FullModelShareableGenerator", "args": {}}]
    assert problems == [
        f"{FILE} component 'v': nvflare.app_common.widgets.validation_json_generator."
        "ValidationJsonGenerator cannot be one of the workflows (CrossSiteModelEval writes "
        "cross_val_results.json itself)"]
    _, problems = translate({"components": [{"id": "x", "name": "MyThing"}]})
    assert problems == [f"{FILE} component 'x': name 'MyThing': fedhive finds a class by its "
                        "'path' (the import path) only"]


def test_filters_are_refused() -> None:
    _, problems = translate({"task_data_filters": [], "task_result_filters": [
        {"tasks": ["train"], "filters": [{"path": "nvflare.app_common.filters.X"}]}]})
    assert problems == [f"{FILE} task_result_filters: FLARE filters do not run in fedhive, and "
                        "skipping one (a privacy filter) would change what leaves a site; "
                        "remove them, or transform the data in the trainer"]


# client API executors ----------------------------------------------------------------------
def launcher_config(executor_args: dict[str, Any], script: str = "python3 -u custom/train.py",
                    **launcher_args: Any) -> dict[str, Any]:
    return {
        "app_script": "train.py",
        "executors": [{"tasks": ["train"], "executor": {
            "path": fp.LAUNCHER_EXECUTOR,
            "args": {"launcher_id": "launcher", "pipe_id": "pipe", **executor_args}}}],
        "components": [
            component(fp.LAUNCHER, {"script": script, **launcher_args}, "launcher"),
            component("nvflare.fuel.utils.pipe.cell_pipe.CellPipe",
                      {"site_name": "{SITE_NAME}", "token": "{JOB_ID}"}, "pipe"),
            component("nvflare.app_common.widgets.metric_relay.MetricRelay",
                      {"pipe_id": "pipe"}, "relay")]}


def test_the_launcher_executor_becomes_client_api_executor_with_the_launchers_script() -> None:
    config, problems = translate(launcher_config(
        {"task_wait_timeout": None, "external_pre_init_timeout": 60, "heartbeat_timeout": 60,
         "params_exchange_format": "pytorch", "memory_gc_rounds": 1,
         "train_task_name": "train"},
        script="python3 -u custom/{app_script} --epochs 2", launch_once=False,
        shutdown_timeout=5))
    assert problems == []
    assert config["components"] == []
    assert config["executors"] == [{"tasks": ["train"], "executor": {
        "path": "fedhive.fl.client_api_executor.ClientAPIExecutor",
        "args": {"memory_hygiene": True, "command": "python3 -u custom/train.py --epochs 2",
                 "launch_once": False, "stop_grace": 5, "launch_timeout": 60}}}]


@pytest.mark.parametrize(("args", "message"), [
    ({"params_transfer_type": "DIFF"},
     "argument params_transfer_type 'DIFF' is not supported, only 'FULL'"),
    ({"params_exchange_format": "keras_layer_weights"},
     "argument params_exchange_format 'keras_layer_weights' is not supported"),
    ({"train_task_name": "fit"}, "argument train_task_name 'fit' is not supported, only 'train' "
                                 "(fedhive.client.is_train() means the task 'train')"),
    ({"launcher_id": "pipe"},
     "launcher_id 'pipe' must name a SubprocessLauncher component of this config"),
    ({"foo": 1}, "argument 'foo' is not supported: fedhive's equivalent "
                 "fedhive.fl.client_api_executor.ClientAPIExecutor takes command, filters, "),
])
def test_launcher_executor_refusals(args: dict[str, Any], message: str) -> None:
    _, problems = translate(launcher_config(args))
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{FILE} component at executors[0].executor: "
                                  f"{fp.LAUNCHER_EXECUTOR}: {message}")


def test_system_and_environment_variables_are_refused_where_they_would_be_used() -> None:
    config = launcher_config({}, script="python3 -u custom/train.py --out {WORKSPACE}")
    _, problems = translate(config)
    assert problems == [f"{FILE} executors[0].executor.args.command: refers to FLARE's system "
                        "variable WORKSPACE, which fedhive does not set; write the value out"]
    _, problems = translate(launcher_config({}, script="python3 custom/t.py {$DATA}"))
    assert problems == [f"{FILE} executors[0].executor.args.command: refers to the environment "
                        "variable DATA: fedhive does not put a site's environment into a job's "
                        "config; write the value out"]
    _, problems = translate({"a": "{b}", "b": "{a}", "components": []})
    assert problems == [f"{FILE}: variables a, b refer to each other in a circle"]


def test_variables_resolve_as_flares_configurator_does() -> None:
    config, problems = translate({
        "rounds": 3, "name": "sag", "flag": True, "prefix": "{name}-x",
        "workflows": [component(fp.SAG, {"num_rounds": "{rounds}",
                                         "train_task_name": "{prefix}-{rounds}",
                                         "ignore_result_error": "{flag}"}, "{name}")]})
    assert problems == []
    assert config["workflows"][0] == {"id": "sag", "path": "fedhive.fl.workflows.ScatterAndGather",
                                      "args": {"num_rounds": 3, "train_task_name": "sag-x-3",
                                               "ignore_result_error": True}}
    assert config["prefix"] == "sag-x"


def _app(tmp_path: Path, files: dict[str, str]) -> CustomCode:
    app = tmp_path / "job" / "app"
    for rel, text in files.items():
        (app / rel).parent.mkdir(parents=True, exist_ok=True)
        (app / rel).write_text(text)
    return CustomCode(folder_files(tmp_path / "job", ArchiveLimits()), "app")


def test_client_api_scripts_must_be_in_custom_and_speak_fedhives_client(tmp_path: Path) -> None:
    custom = _app(tmp_path, {"custom/ok.py": "from fedhive import client as flare\n",
                             "custom/old.py": "import os\nfrom nvflare import client\n"})
    in_process = {"executors": [{"tasks": ["train"], "executor": {
        "path": fp.PT_IN_PROCESS, "args": {"task_script_path": "ok.py",
                                           "task_script_args": "--lr 0.1"}}}]}
    config, problems = translate(in_process, custom)
    assert problems == []
    assert config["executors"][0]["executor"]["args"] == {
        "command": "python -u custom/ok.py --lr 0.1", "launch_once": True}
    in_process["executors"][0]["executor"]["args"]["task_script_path"] = "old.py"
    _, problems = translate(in_process, custom)
    assert problems == [f"{FILE} component at executors[0].executor: {fp.PT_IN_PROCESS}: "
                        "custom/old.py imports nvflare.client (line 2); a fedhive trainer uses "
                        "`from fedhive import client as flare`, the same API"]
    runner = {"executors": [{"tasks": ["*"], "executor": {
        "path": fp.SCRIPT_RUNNER, "args": {"script": "gone.py", "launch_external_process": True,
                                           "command": "python3"}}}]}
    _, problems = translate(runner, custom)
    assert problems == [f"{FILE} component at executors[0].executor: {fp.SCRIPT_RUNNER}: script "
                        "custom/gone.py is not in the app's custom/ folder"]


def test_custom_paths_must_name_what_custom_defines(tmp_path: Path) -> None:
    custom = _app(tmp_path, {
        "custom/trainer.py": "import numpy as np\ntry:\n    import torch\nexcept ImportError:\n"
                             "    torch = None\nclass Trainer:\n    pass\nHelper = Trainer\n",
        "custom/pkg/__init__.py": "", "custom/pkg/mod.py": "def make():\n    pass\n",
        "custom/ns/mod.py": "X = 1\n", "custom/star.py": "from os.path import *\n",
        "custom/broken.py": "def (:\n"})

    def problems(path: str) -> list[str]:
        config = {"components": [component(path)]}
        return [m for _, m in check_components(config, FILE, custom)]

    for ok in ("trainer.Trainer", "trainer.Helper", "trainer.torch", "pkg.mod.make",
               "ns.other.Thing", "star.Anything", "site_library.Trainer"):
        assert problems(ok) == [], ok
    assert problems("trainer.Missing") == ["path 'trainer.Missing': custom/trainer.py defines "
                                           "no Missing"]
    assert problems("pkg.nope.Thing") == [
        "path 'pkg.nope.Thing': module pkg.nope is not in custom/ (custom/pkg/ is, so it is the "
        "only pkg the app can import)"]
    assert problems("trainer.sub.Thing") == [
        "path 'trainer.sub.Thing': module trainer.sub is not in custom/ (custom/trainer.py is, "
        "so it is the only trainer the app can import)"]
    assert problems("broken.Thing") == [
        "path 'broken.Thing': custom/broken.py: Python syntax error at line 1: invalid syntax"]


# the server and client jobs build what validated --------------------------------------------
def test_build_component_maps_a_flare_path_on_its_own() -> None:
    built: dict[str, Any] = {}
    sag = build_component(component(fp.SAG, {"min_clients": 2, "memory_gc_rounds": 2}, "sag"),
                          "workflows[0]", built)
    assert isinstance(sag, ScatterAndGather) and built["sag"] is sag and sag.min_clients == 2
    agg = build_component(component(fp.ACCUMULATE, {"expected_data_kind": "WEIGHTS"}), "x", {})
    assert isinstance(agg, InTimeAccumulateWeightedAggregator)
    with pytest.raises(ComponentError, match=r"component 'c': .*ClientAPILauncherExecutor: "
                                             r"launcher_id 'l' must name a SubprocessLauncher"):
        build_component(component(fp.LAUNCHER_EXECUTOR, {"launcher_id": "l"}), "x", {})
    with pytest.raises(ComponentError, match="has no object of its own in fedhive"):
        build_component(component(fp.LAUNCHER, {"script": "x"}), "x", {})


def test_the_client_job_builds_a_yaml_client_api_job(tmp_path: Path) -> None:
    app = tmp_path / "app"
    (app / "config").mkdir(parents=True)
    (app / "custom").mkdir()
    (app / "custom" / "train.py").write_text("from fedhive import client\n")
    config = launcher_config({"params_exchange_format": "numpy"},
                             script="python3 -u custom/{app_script}")
    import yaml

    (app / "config" / "config_fed_client.yml").write_text(yaml.safe_dump(config))
    executors = Executors.load(app)
    trainer = executors.get("train")
    assert isinstance(trainer, ClientAPIExecutor) and trainer.argv[1:] == ["-u", "custom/train.py"]
    (app / "config" / "config_fed_client.yml").write_text(yaml.safe_dump(
        launcher_config({"params_transfer_type": "DIFF"})))
    with pytest.raises(ComponentError, match=r"config/config_fed_client\.yml component at "
                                             r"executors\[0\]\.executor: .*params_transfer_type"):
        Executors.load(app)


def test_the_server_job_builds_a_hocon_flare_config(tmp_path: Path) -> None:
    app = tmp_path / "app"
    (app / "config").mkdir(parents=True)
    (app / "config" / "config_fed_server.conf").write_text(f'''
        components = [
          {{ id = "gen", path = "{fp.FULL_MODEL}" }}
          {{ id = "loc", path = "{fp.NP_LOCATOR}" }}
        ]
        workflows = []
    ''')
    ctx = WorkflowContext(job_id="j1", sites=["site-1"], workspace=tmp_path,
                          log=structlog.get_logger())
    run_app(app, ctx)
    assert set(ctx.components) == {"gen"}
    assert isinstance(ctx.components["gen"], FullModelShareableGenerator)
    (app / "config" / "config_fed_server.json").write_text(json.dumps({"workflows": []}))
    with pytest.raises(Exception, match="is another form of the same file"):
        run_app(app, ctx)
