"""FLARE-format jobs (tests/fixtures/flare_jobs/): the good ones validate as they are, the broken
ones are refused at validation with one exact line each; FLARE's deploy_map forms and
`resource_spec["@default"]`. tests/e2e/test_flare_jobs.py runs the good ones on a real system.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fedhive.cli.validate import validate
from fedhive.jobs.definition import InvalidJobDefinition, load_job
from fedhive.jobs.record import JobMeta
from tests.unit.test_jobs_validation import zip_folder

JOBS = Path(__file__).resolve().parents[1] / "fixtures" / "flare_jobs"
GOOD = ["hello-numpy-sag", "fedavg-yaml", "cyclic-sites-map"]
BROKEN = {
    "unknown-deploy-key":
        "job 'unknown-deploy-key': deploy_map['app']: Unknown keys {'clients'} in deploy_map "
        "entry for job unknown-deploy-key. Valid keys are: ['sites', 'targets']",
    "np-trainer":
        "job 'np-trainer': app/config/config_fed_client.json component at executors[0].executor:"
        " nvflare.app_common.np.np_trainer.NPTrainer: fedhive has no built-in numpy trainer: "
        "write an executor in custom/ (docs/jobs.md, Executors) or a client API script",
    "two-forms":
        "job 'two-forms': app/config/config_fed_server.json: app/config/config_fed_server.conf "
        "is another form of the same file; keep one",
    "fedprox":
        "job 'fedprox': app/config/config_fed_server.json component 'fedavg': "
        "nvflare.app_common.workflows.fedavg.FedAvg: argument fedprox_mu 0.01 is not supported,"
        " only null (fedhive's FedAvg has no FedProx term)",
    "missing-class":
        "job 'missing-class': app/config/config_fed_client.json component at "
        "executors[0].executor: path 'np_trainer.NPTrainer': custom/np_trainer.py defines no "
        "NPTrainer",
    "privacy-filter":
        "job 'privacy-filter': app/config/config_fed_client.json task_result_filters: FLARE "
        "filters do not run in fedhive, and skipping one (a privacy filter) would change what "
        "leaves a site; remove them, or transform the data in the trainer",
    "nvflare-client-script":
        "job 'nvflare-client-script': app/config/config_fed_client.json component at "
        "executors[0].executor: nvflare.app_opt.pt.in_process_client_api_executor."
        "PTInProcessClientAPIExecutor: custom/train.py imports nvflare.client (line 1); a "
        "fedhive trainer uses `from fedhive import client as flare`, the same API",
}


@pytest.mark.parametrize("name", GOOD)
def test_flare_jobs_validate_as_they_are(name: str) -> None:
    folder = JOBS / name
    job = load_job(folder)
    assert load_job(zip_folder(folder, top=name)).meta == job.meta  # as FLARE's client zips it
    result = CliRunner().invoke(_cli(), [str(folder)])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"valid: job '{name}'")
    for configs in job.configs.values():
        for config in (configs.server, configs.client):
            assert "nvflare." not in json.dumps(config)  # every FLARE path mapped


def test_what_the_good_jobs_become() -> None:
    sag = load_job(JOBS / "hello-numpy-sag").configs["app"]
    assert sag.server is not None
    assert [c["path"] for c in sag.server["components"]] == [
        "fedhive.fl.persistors.NumpyModelPersistor",
        "fedhive.fl.shareables.FullModelShareableGenerator",
        "fedhive.fl.aggregators.InTimeAccumulateWeightedAggregator"]
    assert sag.server["workflows"][1]["args"] == {
        "persistor_id": "persistor", "submit_model_timeout": 600, "validation_timeout": 6000}
    fedavg = load_job(JOBS / "fedavg-yaml").configs["app"].client
    assert fedavg is not None and fedavg["components"] == []
    assert fedavg["executors"][0]["executor"] == {
        "path": "fedhive.fl.client_api_executor.ClientAPIExecutor",
        "args": {"command": "python3 -u custom/train.py --delta 1.0", "launch_once": True}}
    cyclic = load_job(JOBS / "cyclic-sites-map")
    assert cyclic.meta.deploy_map == {"server_app": ["server"], "site_app": ["site-1", "site-2"]}
    assert cyclic.meta.resource_spec == {"site-1": {"gpu": 1}, "site-2": {"gpu": 1}}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_flare_jobs_are_refused_at_validation_in_one_line(name: str) -> None:
    with pytest.raises(InvalidJobDefinition) as caught:
        load_job(JOBS / "broken" / name)
    assert caught.value.violations == [BROKEN[name]]
    result = CliRunner().invoke(_cli(), [str(JOBS / "broken" / name)])
    assert result.exit_code != 0 and result.stdout == ""
    assert result.stderr.strip() == BROKEN[name]


def _cli() -> Any:
    import typer

    app = typer.Typer()
    app.command()(validate)
    return app


# deploy_map forms and @default --------------------------------------------------------------
def _job(tmp_path: Path, meta: dict[str, Any]) -> Path:
    root = tmp_path / "forms"
    for app in ("srv", "cli", "all"):
        (root / app / "config").mkdir(parents=True)
        (root / app / "config" / "config_fed_server.json").write_text("{}")
        (root / app / "config" / "config_fed_client.json").write_text("{}")
    (root / "meta.json").write_text(json.dumps({"name": "forms", **meta}))
    return root


@pytest.mark.parametrize(("deploy_map", "flat"), [
    ({"srv": "server", "cli": ["site-1", "site-2"]}, {"srv": ["server"],
                                                      "cli": ["site-1", "site-2"]}),
    ({"srv": {"targets": ["server"]}, "cli": {"sites": ["site-1", "site-2"]}},
     {"srv": ["server"], "cli": ["site-1", "site-2"]}),
    ({"srv": ["server", {"sites": ["site-1"]}], "cli": [{"targets": ["site-2"]}]},
     {"srv": ["server", "site-1"], "cli": ["site-2"]}),
    ({"srv": {"sites": ["server"], "targets": ["site-1"]}, "cli": "site-2"},
     {"srv": ["server", "site-1"], "cli": ["site-2"]}),
    ({"all": "@all"}, {"all": ["@ALL"]}),
])
def test_deploy_map_entries_take_flares_forms(tmp_path: Path, deploy_map: dict[str, Any],
                                              flat: dict[str, list[str]]) -> None:
    job = load_job(_job(tmp_path, {"deploy_map": deploy_map}))
    assert job.meta.deploy_map == flat


@pytest.mark.parametrize(("deploy_map", "message"), [
    ({"srv": {"sites": ["server"], "site": ["site-1"]}, "cli": ["site-2"]},
     "deploy_map['srv']: Unknown keys {'site'} in deploy_map entry for job forms. Valid keys "
     "are: ['sites', 'targets']"),
    ({"srv": {"sites": "server"}, "cli": ["site-2"]},
     "deploy_map['srv']: 'sites' must be a list of site names, 'server' or '@ALL', not "
     "\"server\""),
    ({"srv": ["server", {"sites": ["site-1"]}], "cli": {"targets": ["site-1"]}},
     "deploy_map: site 'site-1' gets more than one app: srv, cli"),
    ({"srv": "server", "cli": 3}, "deploy_map['cli']: must be a list of site names, 'server' "
                                  "or '@ALL', one of them, or {\"sites\": [...]}"),
])
def test_deploy_map_forms_refused(tmp_path: Path, deploy_map: dict[str, Any],
                                  message: str) -> None:
    with pytest.raises(InvalidJobDefinition) as caught:
        load_job(_job(tmp_path, {"deploy_map": deploy_map}))
    assert f"job 'forms': {message}" in caught.value.violations


def test_resource_spec_default_applies_to_every_site_without_its_own(tmp_path: Path) -> None:
    job = load_job(_job(tmp_path, {
        "deploy_map": {"srv": ["server"], "cli": ["site-1", "site-2", "site-3"]},
        "resource_spec": {"@default": {"num_of_gpus": 1}, "site-2": {"num_of_gpus": 2}}}))
    assert job.meta.resource_spec == {"site-1": {"num_of_gpus": 1}, "site-2": {"num_of_gpus": 2},
                                      "site-3": {"num_of_gpus": 1}}
    to_all = load_job(_job(tmp_path / "all", {
        "deploy_map": {"all": ["@ALL"]}, "resource_spec": {"@default": {"num_of_gpus": 1}}}))
    assert to_all.meta.resource_spec == {"@default": {"num_of_gpus": 1}}
    assert to_all.meta.resource_spec_for("site-9") == {"num_of_gpus": 1}
    meta = JobMeta("m", resource_spec={"@default": {"gpu": 1}, "a": {"gpu": 2}})
    assert meta.resource_spec_for("a") == {"gpu": 2} and meta.resource_spec_for("b") == {"gpu": 1}
    with pytest.raises(InvalidJobDefinition) as caught:
        load_job(_job(tmp_path / "bad", {
            "deploy_map": {"all": ["@ALL"]}, "resource_spec": {"@default": {"num_of_gpus": -1}}}))
    assert caught.value.violations == [
        "job 'forms': resource_spec['@default']['num_of_gpus']: must be a number between 0 and "
        "1000000000, got -1"]
