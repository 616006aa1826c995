"""FLARE's file forms: meta and app configs in JSON, HOCON or YAML parse into the same dict,
one code path; what only HOCON or YAML can say is refused in one line naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fedhive.errors import InvalidArgument
from fedhive.jobs import limits
from fedhive.jobs.definition import InvalidJobDefinition, load_job
from fedhive.jobs.documents import CLIENT_CONFIG, SERVER_CONFIG, load_app_config
from fedhive.jobs.formats import parse_document
from fedhive.jobs.jsontext import JsonProblem

CONFIG: dict[str, Any] = {
    "format_version": 2,
    "components": [{"id": "agg", "path": "fedhive.fl.aggregators.CollectAggregator",
                    "args": {"expected_data_kind": "WEIGHTS"}}],
    "workflows": [],
    "nested": {"a.b": [1, 2.5, None, True, "x"]},
}
HOCON = '''
# a comment
format_version = 2
components = [
  {
    id = "agg"
    path = "fedhive.fl.aggregators.CollectAggregator"
    args { expected_data_kind = WEIGHTS }
  }
]
workflows = []
nested { "a.b" = [1, 2.5, null, true, "x"] }
'''
YAML = '''
# a comment
format_version: 2
components:
  - id: agg
    path: fedhive.fl.aggregators.CollectAggregator
    args: {expected_data_kind: WEIGHTS}
workflows: []
nested:
  a.b: [1, 2.5, null, true, "x"]
'''


@pytest.mark.parametrize(("name", "text"), [
    ("c.json", json.dumps(CONFIG)), ("c.conf", HOCON), ("c.yml", YAML), ("c.yaml", YAML)])
def test_every_form_parses_into_the_same_dict(name: str, text: str) -> None:
    assert parse_document(name, text.encode(), max_depth=32) == CONFIG


@pytest.mark.parametrize(("name", "text", "message"), [
    ("m.conf", 'include "/etc/passwd"\n',
     "HOCON include at line 1 is not accepted (it would read files or URLs of the machine "
     "that reads the job)"),
    ("m.conf", "a = 1\nb = [include file(\"x\")]\n", "HOCON include at line 2"),
    ("m.conf", "a = ${HOME}\n", "HOCON substitution ${...} at line 1 is not accepted (it would "
                                "read the environment of the machine that reads the job; write "
                                "the value out)"),
    ("m.conf", 'a = x\\"\n include "y"\n', "HOCON include at line 2"),
    ("m.conf", "a = 10 seconds\n", "value at a is a relativedelta, which JSON has no type for"),
    ("m.conf", "a {\n", "invalid HOCON at line 2 column 1"),
    ("m.conf", "a = " + "[" * 40 + "]" * 40, "nested"),
    ("m.yml", "a: &x [1]\nb: *x\n", "YAML alias *x at line 2 column 4 is not accepted"),
    ("m.yml", "a: 2024-01-01\n", "value at a is a date, which JSON has no type for"),
    ("m.yml", "1: a\n", "key 1 is not a string"),
    ("m.yml", "a: .nan\n", "number nan at a is not a finite number"),
    ("m.yml", "a: !!binary aGk=\n", "value at a is a bytes"),
    ("m.yml", "a: !!python/object:os.system {}\n", "invalid YAML"),
    ("m.yml", "a: 1\n---\nb: 2\n", "invalid YAML at line 2 column 1: but found another "
                                    "document"),
    ("m.yml", "[" * 40 + "]" * 40, "is nested deeper than the limit of 32 levels"),
    ("m.yml", "a: " + "9" * 101 + "\n", "longer than the limit of 100 digits"),
    ("m.yaml", b"\xff".decode("latin-1"), "is not UTF-8 text"),
])
def test_what_only_hocon_or_yaml_can_say_is_refused(name: str, text: str, message: str) -> None:
    content = text.encode("latin-1") if text == "\xff" else text.encode()
    with pytest.raises(JsonProblem) as caught:
        parse_document(name, content, max_depth=32)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_hocon_keeps_quoted_strings_with_braces_and_dollars() -> None:
    text = b'a = "${HOME}"\nb = "include \\"x\\""\n# include "y" ${Z}\nc = """x ${y}"""\n'
    assert parse_document("m.conf", text, max_depth=8) == {
        "a": "${HOME}", "b": 'include "x"', "c": "x ${y}"}


# meta and configs in a job ---------------------------------------------------------------
META = {"name": "forms", "deploy_map": {"app": ["@ALL"]}, "min_clients": 1}


def _job(root: Path, meta: tuple[str, str], server: tuple[str, str],
         client: tuple[str, str]) -> Path:
    (root / "app" / "config").mkdir(parents=True)
    (root / meta[0]).write_text(meta[1])
    (root / "app" / "config" / server[0]).write_text(server[1])
    (root / "app" / "config" / client[0]).write_text(client[1])
    return root


SERVER_HOCON = "format_version = 2\ncomponents = []\nworkflows = []\n"
CLIENT_YAML = "format_version: 2\nexecutors: []\ncomponents: []\n"


@pytest.mark.parametrize(("meta_name", "meta_text"), [
    ("meta.json", json.dumps(META)),
    ("meta.conf", 'name = forms\ndeploy_map { app = ["@ALL"] }\nmin_clients = 1\n'),
    ("meta.yml", 'name: forms\ndeploy_map: {app: ["@ALL"]}\nmin_clients: 1\n'),
    ("meta.yaml", 'name: forms\ndeploy_map:\n  app: ["@ALL"]\nmin_clients: 1\n'),
])
def test_a_job_in_any_form_loads_and_is_stored_with_meta_json(
        tmp_path: Path, meta_name: str, meta_text: str) -> None:
    root = _job(tmp_path / "forms", (meta_name, meta_text),
                ("config_fed_server.conf", SERVER_HOCON), ("config_fed_client.yml", CLIENT_YAML))
    job = load_job(root)
    assert job.meta.name == "forms" and job.meta.deploy_map == {"app": ["@ALL"]}
    assert job.configs["app"].server == {"format_version": 2, "components": [],
                                         "workflows": []}
    assert job.configs["app"].client == {"format_version": 2, "executors": [], "components": []}
    # the stored archive has fedhive's meta.json only, the configs as they were written
    assert job.files.names() == ["app/config/config_fed_client.yml",
                                 "app/config/config_fed_server.conf"]
    assert load_job(job.to_zip()).meta == job.meta


def test_two_forms_of_one_file_are_refused_naming_both(tmp_path: Path) -> None:
    root = _job(tmp_path / "forms", ("meta.json", json.dumps(META)),
                ("config_fed_server.json", "{}"), ("config_fed_client.yaml", CLIENT_YAML))
    (root / "app" / "config" / "config_fed_server.conf").write_text(SERVER_HOCON)
    (root / "app" / "config" / "config_fed_client.yml").write_text(CLIENT_YAML)
    with pytest.raises(InvalidJobDefinition) as caught:
        load_job(root)
    assert caught.value.violations == [
        "job 'forms': app/config/config_fed_server.json: app/config/config_fed_server.conf is "
        "another form of the same file; keep one",
        "job 'forms': app/config/config_fed_client.yml: app/config/config_fed_client.yaml is "
        "another form of the same file; keep one",
    ]
    (root / "meta.yml").write_text("name: x\n")
    with pytest.raises(InvalidJobDefinition) as caught:
        load_job(root)
    assert caught.value.violations == [
        "job 'forms': meta.json: meta.yml is another form of the same file; keep one"]


def test_a_parse_error_names_the_file_and_line(tmp_path: Path) -> None:
    root = _job(tmp_path / "forms", ("meta.conf", 'name = forms\ndeploy_map {\n'),
                ("config_fed_server.conf", SERVER_HOCON), ("config_fed_client.yml", CLIENT_YAML))
    with pytest.raises(InvalidJobDefinition, match=r"job 'forms': meta.conf: invalid HOCON at "
                                                   r"line 3 column 1"):
        load_job(root)
    (root / "meta.conf").unlink()
    (root / "meta.yml").write_text(json.dumps(META))
    (root / "app" / "config" / "config_fed_client.yml").write_text("executors: [\n")
    with pytest.raises(InvalidJobDefinition) as caught:
        load_job(root)
    (line,) = caught.value.violations
    assert line.startswith("job 'forms': app/config/config_fed_client.yml: invalid YAML at line")


def test_hocon_and_yaml_files_are_held_to_their_size_limits(tmp_path: Path) -> None:
    pad = "# " + "x" * 1000 + "\n"
    big = SERVER_HOCON + pad * (limits.MAX_TEXT_FORM_BYTES // len(pad) + 1)
    root = _job(tmp_path / "big", ("meta.json", json.dumps(META)),
                ("config_fed_server.conf", big), ("config_fed_client.yml", CLIENT_YAML))
    size = (root / "app" / "config" / "config_fed_server.conf").stat().st_size
    with pytest.raises(InvalidJobDefinition) as caught:
        load_job(root)
    assert caught.value.violations == [
        f"job 'forms': app/config/config_fed_server.conf: is {size} bytes, more than the limit "
        f"of {limits.MAX_TEXT_FORM_BYTES}"]
    # many files each under the limit: the job's total is bounded too
    meta = {"name": "many", "deploy_map": {f"a{i}": [f"site-{i}"] for i in range(6)}
            | {"srv": ["server"]}, "min_clients": 1}
    root = tmp_path / "many"
    (root / "srv" / "config").mkdir(parents=True)
    (root / "meta.json").write_text(json.dumps(meta))
    (root / "srv" / "config" / "config_fed_server.json").write_text("{}")
    half = CLIENT_YAML + pad * (limits.MAX_TEXT_FORM_BYTES // len(pad) - 4)
    for i in range(6):
        (root / f"a{i}" / "config").mkdir(parents=True)
        (root / f"a{i}" / "config" / "config_fed_client.yaml").write_text(half)
    with pytest.raises(InvalidJobDefinition) as caught:
        load_job(root)
    assert any("bytes of HOCON and YAML in the job, more than the limit of "
               f"{limits.MAX_TEXT_FORM_TOTAL}" in line for line in caught.value.violations)


def test_the_runtime_loader_reads_what_validation_read(tmp_path: Path) -> None:
    app = tmp_path / "app"
    (app / "config").mkdir(parents=True)
    (app / "config" / "config_fed_server.conf").write_text(SERVER_HOCON)
    (app / "config" / "config_fed_client.yaml").write_text(CLIENT_YAML)
    assert load_app_config(app, SERVER_CONFIG) == (
        "config/config_fed_server.conf", {"format_version": 2, "components": [],
                                          "workflows": []})
    assert load_app_config(app, CLIENT_CONFIG)[0] == "config/config_fed_client.yaml"
    (app / "config" / "config_fed_server.json").write_text("{}")
    with pytest.raises(InvalidArgument, match=r"config/config_fed_server\.json: config/"
                                              r"config_fed_server\.conf is another form"):
        load_app_config(app, SERVER_CONFIG)
    (app / "config" / "config_fed_client.yaml").write_text("a: [\n")
    with pytest.raises(InvalidArgument, match=r"config/config_fed_client\.yaml: invalid YAML"):
        load_app_config(app, CLIENT_CONFIG)
    (app / "config" / "config_fed_client.yaml").unlink()
    with pytest.raises(InvalidArgument, match=r"config/config_fed_client\.json: is missing"):
        load_app_config(app, CLIENT_CONFIG)
