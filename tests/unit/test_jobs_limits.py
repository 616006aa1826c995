"""Bad input is bounded before anything is stored (issue 16, point 5): integers to their wire
type and a sane maximum, meta.json to a size, nesting to a depth, echoed values clipped. Each
refusal is one line per problem naming the field; `fedhive validate` exits 1 without a
traceback. (The same inputs through the job-store and the gateway:
tests/integration/test_bad_input_bounds.py.)"""

from __future__ import annotations

import base64
import io
import json
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from fedhive.cli.main import app as fedhive_app
from fedhive.cli.validate import validate
from fedhive.errors import InvalidArgument
from fedhive.jobs import limits
from fedhive.jobs.archive import MAX_VIOLATIONS, STORED, MiB, UnsafeArchive, Violations
from fedhive.jobs.definition import InvalidJobDefinition, load_job
from fedhive.jobs.serde import meta_from_proto, meta_to_proto
from fedhive.proto.v1 import job_pb2
from fedhive.sdk import Session
from fedhive.text import clip
from tests.unit.test_jobs_validation import BASE_META, write_job

ALL = {"name": "j1", "deploy_map": {"all": ["@ALL"]}}
CONFIGS = {
    "all/config/config_fed_server.json": b'{"workflows": []}',
    "all/config/config_fed_client.json": b'{"executors": []}',
}
MAX_LINE = 600  # no refusal line may be longer, whatever the input held


def job_zip(meta: dict[str, Any] | str | bytes, files: dict[str, bytes] | None = None) -> bytes:
    text = meta if isinstance(meta, str | bytes) else json.dumps(meta)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("meta.json", text)
        for name, data in {**CONFIGS, **(files or {})}.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def refusal(data: bytes) -> list[str]:
    with pytest.raises(Violations) as caught:
        load_job(data)
    assert all(len(line) <= MAX_LINE for line in caught.value.violations), caught.value
    return caught.value.violations


def noise(size: int) -> str:
    """Text that does not compress (a zip of it passes the archive's ratio check)."""
    return base64.b64encode(os.urandom(size * 3 // 4 + 3)).decode()[:size]


def nested(levels: int) -> str:
    """JSON of `levels` lists inside each other."""
    return "[" * levels + "]" * levels


BOUNDS: dict[str, tuple[dict[str, Any], str]] = {
    "min_clients_1e30": ({"min_clients": 10**30}, "min_clients: must be at most 10000, got 1"),
    "min_clients_past_max": ({"min_clients": 10_001}, "min_clients: must be at most 10000"),
    "resource_negative": (
        {"resource_spec": {"site-1": {"num_of_gpus": -1}}},
        "resource_spec['site-1']['num_of_gpus']: must be a number between 0 and 1000000000",
    ),
    "resource_huge": (
        {"resource_spec": {"site-1": {"mem_per_gpu_in_GiB": 10**12}}},
        "resource_spec['site-1']['mem_per_gpu_in_GiB']: must be a number between 0 and",
    ),
    "resource_nested": (
        {"resource_spec": {"site-1": {"gpu": {"count": 10**10}}}},
        "resource_spec['site-1']['gpu']['count']: must be a number between 0 and",
    ),
    "max_runtime_text": ({"max_runtime": "1h"}, 'max_runtime: must be a number of seconds'),
    "max_runtime_zero": ({"max_runtime": 0}, "max_runtime: must be a number of seconds"),
    "max_runtime_past_max": ({"max_runtime": 10**9}, "max_runtime: must be a number of seconds"),
    "extra_integer": (
        {"tags": {"seed": [1, 2**53 + 1]}},
        "tags['seed'][1]: integer 9007199254740993 is beyond the limit of +-2**53",
    ),
}


@pytest.mark.parametrize(("change", "expected"), BOUNDS.values(), ids=BOUNDS.keys())
def test_numbers_past_their_bound_are_refused_naming_the_field(
    change: dict[str, Any], expected: str
) -> None:
    found = refusal(job_zip({**ALL, **change}))
    assert len(found) == 1 and expected in found[0], found


def test_numbers_at_their_bounds_are_accepted_and_survive_the_wire() -> None:
    meta = {**ALL, "min_clients": limits.MAX_MIN_CLIENTS, "max_runtime": limits.MAX_RUNTIME_S,
            "resource_spec": {"site-1": {"gpu": limits.MAX_RESOURCE_AMOUNT, "mem": 0.5}},
            "seed": limits.MAX_META_INTEGER, "low": -limits.MAX_META_INTEGER}
    job = load_job(job_zip(meta))
    wire = job_pb2.JobMeta.FromString(meta_to_proto(job.meta).SerializeToString())
    assert meta_from_proto(wire) == job.meta  # every number exactly as given


@pytest.mark.parametrize(("text", "expected"), [
    ('{"name": "j1", "deploy_map": {"all": ["@ALL"]}, "x": NaN}', "NaN is not a JSON number"),
    ('{"name": "j1", "deploy_map": {"all": ["@ALL"]}, "x": -Infinity}',
     "-Infinity is not a JSON number"),
    ('{"name": "j1", "deploy_map": {"all": ["@ALL"]}, "x": 1e400}',
     "number 1e400 is too large for a double"),
    ('{"name": "j1", "deploy_map": {"all": ["@ALL"]}, "x": ' + "7" * 5000 + "}",
     "an integer of 5000 digits is longer than the limit of 100"),
])
def test_numbers_json_cannot_hold_are_one_line(text: str, expected: str) -> None:
    assert refusal(job_zip(text)) == [f"job 'job': meta.json: {expected}"]


def test_meta_json_nesting_is_limited() -> None:
    ok = f'{{"name": "j1", "deploy_map": {{"all": ["@ALL"]}}, "x": {nested(15)}}}'
    assert load_job(job_zip(ok)).meta.extra["x"] is not None  # 16 levels with the top object
    deeper = ok.replace(nested(15), nested(16))
    assert refusal(job_zip(deeper)) == [
        "job 'job': meta.json: is nested 17 levels deep, more than the limit of 16"
    ]


@pytest.mark.parametrize("levels", [1_000, 100_000])
def test_json_nested_past_the_interpreter_is_one_line_not_a_traceback(levels: int) -> None:
    deep_meta = f'{{"name": "j1", "deploy_map": {{"all": ["@ALL"]}}, "x": {nested(levels)}}}'
    assert refusal(job_zip(deep_meta)) == [
        "job 'job': meta.json: is nested deeper than the limit of 16 levels"
    ]
    deep_config = {"all/config/config_fed_server.json": f'{{"x": {nested(levels)}}}'.encode()}
    assert refusal(job_zip(ALL, deep_config)) == [
        "job 'j1': all/config/config_fed_server.json: is nested deeper than the limit of 32 "
        "levels"
    ]


def test_config_nesting_is_limited_more_loosely_than_meta() -> None:
    config = {"all/config/config_fed_server.json": f'{{"x": {nested(31)}}}'.encode()}
    load_job(job_zip(ALL, config))
    config = {"all/config/config_fed_server.json": f'{{"x": {nested(32)}}}'.encode()}
    assert "is nested 33 levels deep" in refusal(job_zip(ALL, config))[0]


def test_a_20_mib_meta_field_is_refused_before_it_is_parsed() -> None:
    meta = json.dumps({**ALL, "notes": noise(20 * MiB)})
    assert refusal(job_zip(meta)) == [
        f"job 'job': meta.json: is {len(meta)} bytes, more than the limit of 2097152"
    ]


def test_meta_content_is_limited_as_compact_json() -> None:
    room = limits.MAX_META_BYTES - len(json.dumps({**ALL, "notes": ""}, separators=(",", ":")))
    fits = {**ALL, "notes": "x" * room}
    job = load_job(job_zip(json.dumps(fits, indent=8)))  # whitespace does not count
    assert len(job.meta.extra["notes"]) == room
    over = {**ALL, "notes": "x" * (room + 1)}
    assert refusal(job_zip(over)) == [
        f"job 'j1': meta.json: holds {limits.MAX_META_BYTES + 1} bytes of JSON (written "
        f"compactly), more than the limit of {limits.MAX_META_BYTES}"
    ]


def test_the_stored_form_of_the_largest_meta_loads_again() -> None:
    """fedhive stores meta.json indented; the job-runner re-reads what it stored."""
    values = [[0] * 64 for _ in range(limits.MAX_META_BYTES // 140)]
    deep: Any = values
    for _ in range(limits.MAX_META_DEPTH - 3):
        deep = [deep]
    meta = {**ALL, "x": deep}
    assert len(json.dumps(meta, separators=(",", ":"))) <= limits.MAX_META_BYTES
    stored = load_job(job_zip(meta)).to_zip()
    assert stored is not None
    assert load_job(stored, STORED).meta.extra["x"] == deep


def test_echoed_values_are_clipped() -> None:
    long = noise(12 * 1024)  # five of them still fit in meta.json's limit
    found = refusal(job_zip({"name": long, "deploy_map": {"all": ["server", long], long: []},
                             "resource_spec": {long: {}}, "mandatory_clients": [long]}))
    assert len(found) >= 4 and all(len(line) <= MAX_LINE for line in found)
    assert all(f"... ({len(long)} characters)" in line for line in found)
    huge = noise(MiB)  # app configs have no size limit of their own
    config = {"components": [{"id": huge, "path": huge}, {"id": "c", "path": "fedhive." + huge}],
              "workflows": [{"path": "fedhive.fl.workflows.ScatterAndGather",
                             "args": {huge: 1}}]}
    found = refusal(job_zip(ALL, {"all/config/config_fed_server.json":
                                  json.dumps(config).encode()}))
    assert len(found) == 3 and all(len(line) <= MAX_LINE for line in found)


def test_refusals_list_a_bounded_number_of_lines() -> None:
    files = {f"all/bad{i}\\name": b"" for i in range(MAX_VIOLATIONS * 3)}
    with pytest.raises(UnsafeArchive) as caught:
        load_job(job_zip(ALL, files))
    lines = caught.value.violations
    assert len(lines) == MAX_VIOLATIONS
    assert lines[-1] == f"... and {MAX_VIOLATIONS * 2 + 1} more problems"


def test_clip() -> None:
    assert clip("short") == "'short'"
    assert clip("a" * 101) == f"'{'a' * 100}'... (101 characters)"
    assert clip("a" * 5, 3, quote=False) == "aaa... (5 characters)"
    assert clip({"k": [1, 2]}) == '{"k": [1, 2]}'
    assert clip(list(range(1000)), 10) == "[0, 1, 2, ... (4890 characters)"


# the command line ---------------------------------------------------------------------------
runner = CliRunner()
validate_app = typer.Typer()
validate_app.command()(validate)


@pytest.mark.parametrize("meta", [
    f'{{"name": "j1", "deploy_map": {{"srv": ["server"], "cli": ["site-1"]}}, "x": '
    f"{nested(1_000)}}}",
    json.dumps({**BASE_META, "min_clients": 10**30}),
    json.dumps({**BASE_META, "notes": "x" * (3 * MiB)}),
])
def test_validate_and_submit_refuse_in_one_line_with_exit_2(tmp_path: Path, meta: str) -> None:
    root = write_job(tmp_path / "j1", meta)
    result = runner.invoke(validate_app, [str(root)])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output
    env = {"HOME": str(tmp_path), "FEDHIVE_GATEWAY": "127.0.0.1:9", "FEDHIVE_TOKEN": "x"}
    submitted = runner.invoke(fedhive_app, ["submit", str(root)], env=env)
    assert submitted.exit_code == 2 and submitted.stderr == result.stderr


def test_list_limits_are_checked_before_anything_is_sent(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "FEDHIVE_GATEWAY": "127.0.0.1:9", "FEDHIVE_TOKEN": "x"}
    result = runner.invoke(fedhive_app, ["jobs", "-n", str(10**12)], env=env)
    assert result.exit_code == 2 and "Traceback" not in result.output
    with Session("127.0.0.1:9", "x") as session, pytest.raises(InvalidArgument, match="limit"):
        session.list(limit=2**40)
    with Session("127.0.0.1:9", "x") as session, pytest.raises(
        InvalidArgument, match=r"submission id 'bad id!' must be"
    ):
        session.submit(job_zip(ALL), submission_id="bad id!")
    with pytest.raises(InvalidJobDefinition):
        load_job(job_zip({**ALL, "min_clients": 10**30}))
