"""Every job rule, each with a passing and a failing case, for folder and zip input alike.

`job_source` is the contract fixture: the same rule table runs against a job folder and against
the zip FLARE's client would upload (everything under one top folder).
"""

from __future__ import annotations

import copy
import io
import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fedhive.jobs.archive import Violations
from fedhive.jobs.definition import InvalidJobDefinition, JobDefinition, load_job

SERVER_CONFIG: dict[str, Any] = {"format_version": 2, "workflows": [], "components": []}
CLIENT_CONFIG: dict[str, Any] = {"format_version": 2, "executors": [], "components": []}
# app folder -> which config files it has
APPS = {"srv": "server", "cli": "client", "cli2": "client", "all": "both", "spare": "none"}
BASE_META: dict[str, Any] = {
    "name": "j1",
    "resource_spec": {"site-1": {"num_gpus": 1}},
    "deploy_map": {"srv": ["server"], "cli": ["site-1", "site-2"]},
    "min_clients": 2,
    "mandatory_clients": ["site-1"],
}


def write_app(folder: Path, kind: str) -> None:
    (folder / "config").mkdir(parents=True)
    (folder / "README").write_text("app\n")
    if kind in ("server", "both"):
        (folder / "config" / "config_fed_server.json").write_text(json.dumps(SERVER_CONFIG))
    if kind in ("client", "both"):
        (folder / "config" / "config_fed_client.json").write_text(json.dumps(CLIENT_CONFIG))


def write_job(root: Path, meta: dict[str, Any] | str, apps: dict[str, str] = APPS) -> Path:
    root.mkdir(parents=True)
    text = meta if isinstance(meta, str) else json.dumps(meta, indent=2)
    (root / "meta.json").write_text(text)
    for app, kind in apps.items():
        write_app(root / app, kind)
    return root


def zip_folder(root: Path, top: str | None = None) -> bytes:
    """Zip a folder the plain way (not fedhive's writer), optionally under one top folder."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root).as_posix()
            archive.write(path, f"{top}/{rel}" if top else rel)
    return buffer.getvalue()


Source = Callable[[Path], "Path | bytes"]


@pytest.fixture(params=["folder", "zip"])
def job_source(request: pytest.FixtureRequest) -> Source:
    if request.param == "folder":
        return lambda root: root
    return lambda root: zip_folder(root, top=root.name)


def load(tmp_path: Path, source: Source, meta: dict[str, Any] | str, **kw: Any) -> JobDefinition:
    return load_job(source(write_job(tmp_path / "j1", meta, **kw)))


def violations(tmp_path: Path, source: Source, meta: dict[str, Any] | str, **kw: Any) -> list[str]:
    with pytest.raises(InvalidJobDefinition) as caught:
        load(tmp_path, source, meta, **kw)
    return caught.value.violations


def meta_with(**changes: Any) -> dict[str, Any]:
    meta = copy.deepcopy(BASE_META)
    for key, value in changes.items():
        if value is _DROP:
            meta.pop(key)
        else:
            meta[key] = value
    return meta


_DROP = object()

VALID = {
    "base": meta_with(),
    "all_sites": meta_with(
        deploy_map={"all": ["@ALL"]},
        min_clients=5,
        mandatory_clients=["site-9"],
        resource_spec={"site-9": {"gpu": 1}},
    ),
    "all_lower_case_with_empty_app": meta_with(deploy_map={"all": ["@all"], "spare": []}),
    "server_and_site_in_one_app": meta_with(
        deploy_map={"all": ["server", "site-1"]}, min_clients=1
    ),
    "empty_list_app_beside": meta_with(deploy_map={**BASE_META["deploy_map"], "spare": []}),
    "optional_fields_absent": meta_with(
        resource_spec=_DROP, mandatory_clients=_DROP, min_clients=_DROP
    ),
    "resource_spec_of_named_site": meta_with(resource_spec={"site-2": {"mem": "1Gi"}}),
    "unused_app_folder": meta_with(),  # cli2/ and all/ exist but are not deployed
}


@pytest.mark.parametrize("meta", VALID.values(), ids=VALID.keys())
def test_valid_jobs_load(tmp_path: Path, job_source: Source, meta: dict[str, Any]) -> None:
    job = load(tmp_path, job_source, meta)
    assert job.meta.name == "j1"
    assert job.meta.deploy_map.keys() == meta["deploy_map"].keys()


INVALID: dict[str, tuple[dict[str, Any], str]] = {
    "deploy_map_missing": (meta_with(deploy_map=_DROP), "deploy_map: is missing"),
    "deploy_map_not_object": (meta_with(deploy_map=["srv"]), "deploy_map: must be an object"),
    "deploy_map_empty": (meta_with(deploy_map={}), "deploy_map: is empty"),
    "targets_not_list": (
        meta_with(deploy_map={"srv": 5, "cli": ["site-1"]}),
        "deploy_map['srv']: must be a list",
    ),
    "no_server_app": (
        meta_with(deploy_map={"cli": ["site-1", "site-2"]}),
        "no app is deployed to 'server'",
    ),
    "server_twice": (
        meta_with(deploy_map={"srv": ["server"], "all": ["server", "site-1", "site-2"]}),
        "'server' gets more than one app: srv, all",
    ),
    "site_gets_two_apps": (
        meta_with(deploy_map={"srv": ["server"], "cli": ["site-1", "site-2"], "cli2": ["site-1"]}),
        "site 'site-1' gets more than one app: cli, cli2",
    ),
    "site_listed_twice": (
        meta_with(deploy_map={"srv": ["server"], "cli": ["site-1", "site-2", "site-1"]}),
        "'site-1' is listed twice",
    ),
    "all_with_other_site": (
        meta_with(deploy_map={"all": ["@ALL", "site-1"]}),
        "'@ALL' cannot be combined with other sites",
    ),
    "all_beside_app_with_sites": (
        meta_with(deploy_map={"all": ["@ALL"], "cli": ["site-1"]}),
        "'@ALL' gives the server and every site to 'all', yet 'cli' also deploy(s)",
    ),
    "server_only": (
        meta_with(
            deploy_map={"srv": ["server"]},
            min_clients=_DROP,
            mandatory_clients=_DROP,
            resource_spec=_DROP,
        ),
        "no app is deployed to any site",
    ),
    "app_folder_missing": (
        meta_with(deploy_map={"srv": ["server"], "ghost": ["site-1", "site-2"]}),
        "deploy_map['ghost']: app folder 'ghost/' is not in the job",
    ),
    "empty_list_app_folder_missing": (
        meta_with(deploy_map={**BASE_META["deploy_map"], "ghost": []}),
        "app folder 'ghost/' is not in the job",
    ),
    "server_config_missing": (
        meta_with(deploy_map={"cli": ["server"], "srv": ["site-1", "site-2"]}),
        "cli/config/config_fed_server.json: is missing (app 'cli' is deployed to server)",
    ),
    "client_config_missing": (
        meta_with(deploy_map={"srv": ["server", "site-1", "site-2"]}),
        "srv/config/config_fed_client.json: is missing (app 'srv' is deployed to sites)",
    ),
    "bad_app_name": (
        meta_with(deploy_map={**BASE_META["deploy_map"], "bad app": []}),
        "deploy_map['bad app']: invalid app name",
    ),
    "bad_site_name": (
        meta_with(deploy_map={"srv": ["server"], "cli": ["site.1", "site-2"]}),
        "invalid site name 'site.1'",
    ),
    "site_name_too_long": (
        meta_with(deploy_map={"srv": ["server"], "cli": ["s" * 64]}),
        "invalid site name",
    ),
    "reserved_site_name": (
        meta_with(deploy_map={"srv": ["server"], "cli": ["Server"]}),
        "'Server' is reserved",
    ),
    "site_not_string": (
        meta_with(deploy_map={"srv": ["server"], "cli": [7, "site-1"]}),
        "site names are strings, got 7",
    ),
    "min_clients_string": (meta_with(min_clients="2"), 'min_clients: must be an integer, got "2"'),
    "min_clients_bool": (meta_with(min_clients=True), "min_clients: must be an integer"),
    "min_clients_float": (meta_with(min_clients=2.0), "min_clients: must be an integer"),
    "min_clients_zero": (meta_with(min_clients=0), "min_clients: must be positive, got 0"),
    "min_clients_above_sites": (
        meta_with(min_clients=3),
        "min_clients: 3 is more than the 2 site(s) deployed to",
    ),
    "mandatory_not_list": (
        meta_with(mandatory_clients="site-1"),
        "mandatory_clients: must be a list",
    ),
    "mandatory_not_deployed": (
        meta_with(mandatory_clients=["site-1", "site-9"]),
        "mandatory_clients: site 'site-9' is not in the deploy_map",
    ),
    "mandatory_server": (meta_with(mandatory_clients=["server"]), "'server' is reserved"),
    "resource_spec_not_object": (
        meta_with(resource_spec=[{"gpu": 1}]),
        "resource_spec: must be an object",
    ),
    "resource_spec_value_not_object": (
        meta_with(resource_spec={"site-1": 2}),
        "resource_spec['site-1']: must be an object",
    ),
    "resource_spec_unknown_site": (
        meta_with(resource_spec={"site-9": {"gpu": 1}}),
        "resource_spec['site-9']: is not a site in the deploy_map",
    ),
    "name_not_string": (meta_with(name=5), "job 'j1': name: must be a non-empty string"),
    "name_multi_line": (meta_with(name="a\nb"), "name: must be one line"),
}


@pytest.mark.parametrize(("meta", "expected"), INVALID.values(), ids=INVALID.keys())
def test_each_rule_rejects(
    tmp_path: Path, job_source: Source, meta: dict[str, Any], expected: str
) -> None:
    found = violations(tmp_path, job_source, meta)
    assert any(expected in line for line in found), found
    assert all(line.startswith("job '") and "\n" not in line for line in found)


def test_all_violations_are_reported_at_once(tmp_path: Path, job_source: Source) -> None:
    meta = meta_with(
        name="many",
        deploy_map={"srv": ["server"], "cli": ["site-1", "bad.site"], "ghost": []},
        min_clients=0,
        mandatory_clients=["site-7"],
        resource_spec={"site-1": 3},
    )
    with pytest.raises(InvalidJobDefinition) as caught:
        load(tmp_path, job_source, meta)
    err = caught.value
    fields = [
        "deploy_map['cli']",
        "min_clients",
        "mandatory_clients",
        "resource_spec['site-1']",
        "deploy_map['ghost']",
    ]
    for field in fields:
        assert any(f"job 'many': {field}:" in line for line in err.violations), (field, err)
    assert str(err) == "; ".join(err.violations)
    assert err.code == "INVALID_ARGUMENT" and err.field == "deploy_map['cli']"


def test_config_json_errors_name_file_and_line(tmp_path: Path, job_source: Source) -> None:
    root = write_job(tmp_path / "j1", meta_with())
    (root / "cli" / "config" / "config_fed_client.json").write_text('{\n  "a": 1,\n  oops\n}')
    (root / "srv" / "config" / "config_fed_server.json").write_text("[1, 2]")
    with pytest.raises(InvalidJobDefinition) as caught:
        load_job(job_source(root))
    lines = caught.value.violations
    assert any("cli/config/config_fed_client.json: invalid JSON at line 3" in v for v in lines)
    assert any("srv/config/config_fed_server.json: must be a JSON object" in v for v in lines)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"name": "j1",\n "deploy_map": {,}}', "meta.json: invalid JSON at line 2 column"),
        ('["not", "an", "object"]', "meta.json: must be a JSON object"),
        (b"\xff\xfe".decode("latin-1"), "meta.json: "),
    ],
)
def test_meta_json_must_parse(tmp_path: Path, job_source: Source, text: str, expected: str) -> None:
    assert any(expected in v for v in violations(tmp_path, job_source, text))


def test_missing_meta_without_single_app_is_rejected(tmp_path: Path, job_source: Source) -> None:
    root = tmp_path / "j1"
    write_app(root / "srv", "server")
    write_app(root / "cli", "client")
    with pytest.raises(InvalidJobDefinition, match=r"meta\.json: is missing"):
        load_job(job_source(root))


def test_unknown_keys_are_kept(tmp_path: Path, job_source: Source) -> None:
    meta = meta_with(launcher_spec={"site-1": {"process": {}}}, scope="public")
    job = load(tmp_path, job_source, meta)
    assert job.meta.extra == {"launcher_spec": {"site-1": {"process": {}}}, "scope": "public"}
    assert job.meta.resource_spec == {"site-1": {"num_gpus": 1}}
    assert (job.meta.min_clients, job.meta.mandatory_clients) == (2, ["site-1"])


def test_violations_are_invalid_argument(tmp_path: Path) -> None:
    with pytest.raises(Violations) as caught:
        load_job(tmp_path / "nope")
    assert caught.value.violations == [f"{tmp_path / 'nope'}: no such file or folder"]
