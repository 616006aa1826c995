"""`fedhive` exit codes (fedhive.cli.exits) and `--json` on every command, without a gateway:
the mapping itself, every job command with a session that fails each way, typer's usage
errors, the console script's safety net, and the commands that print JSON offline.
(Against a real gateway: tests/e2e/test_cli.py.)"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

import grpc
import pytest
import typer
from typer.testing import CliRunner

from fedhive import __version__, errors
from fedhive.auth import AdminDirectory
from fedhive.cli import main as cli_main
from fedhive.cli.connection import GatewayTarget
from fedhive.cli.demo import demo_json
from fedhive.cli.exits import Exit, exit_code
from fedhive.cli.main import app
from fedhive.cli.poc import started_json
from fedhive.config import Settings
from fedhive.jobs.archive import Violations
from fedhive.jobs.metrics import RoundMetrics
from fedhive.jobs.status import JobStatus
from fedhive.poc.demo import JobProgress
from fedhive.poc.layout import PocLayout
from fedhive.poc.start import Started
from fedhive.poc.state import PocState
from fedhive.sdk.status import CODE_KEY
from tests.fixtures.job_store import job_zip

runner = CliRunner()


class FakeRpcError(grpc.RpcError):
    """A failed gRPC call as grpc raises it (a status code, details, trailing metadata)."""

    def __init__(self, code: grpc.StatusCode, fedhive_code: str | None = None) -> None:
        self._code = code
        self._trailers = ((CODE_KEY, fedhive_code),) if fedhive_code else ()

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"{self._code.name.lower()} here"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailers


@pytest.mark.parametrize(("error", "code"), [
    (errors.InvalidArgument("bad field"), Exit.USAGE),
    (Violations(["a: bad", "b: bad"]), Exit.USAGE),
    (errors.ConfigError("no gateway"), Exit.USAGE),
    (errors.MalformedMessage("garbage"), Exit.USAGE),
    (FileNotFoundError(2, "No such file or directory", "job.zip"), Exit.USAGE),
    (PermissionError(13, "Permission denied", "out"), Exit.USAGE),
    (errors.NotFound("job x not found"), Exit.NOT_FOUND),
    (errors.BlobNotFound("no result"), Exit.NOT_FOUND),
    (errors.PermissionDenied("not yours"), Exit.DENIED),
    (errors.Unauthenticated("invalid bearer token"), Exit.DENIED),
    (errors.BlobAccessDenied("expired"), Exit.DENIED),
    (errors.Unavailable("gateway down"), Exit.UNREACHABLE),
    (errors.RpcTimeout("deadline"), Exit.UNREACHABLE),
    (errors.Unroutable("no queue"), Exit.UNREACHABLE),
    (ConnectionRefusedError(111, "Connection refused"), Exit.UNREACHABLE),
    (errors.FailedPrecondition("job is running"), Exit.FAILED),
    (errors.AlreadyExists("taken"), Exit.FAILED),
    (errors.PocFailed("no rabbitmq"), Exit.FAILED),
    (errors.FedhiveError("internal"), Exit.FAILED),
    (OSError(28, "No space left on device"), Exit.FAILED),
    (RuntimeError("a bug"), Exit.FAILED),
    (FakeRpcError(grpc.StatusCode.UNAVAILABLE), Exit.UNREACHABLE),
    (FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED), Exit.UNREACHABLE),
    (FakeRpcError(grpc.StatusCode.NOT_FOUND), Exit.NOT_FOUND),
    (FakeRpcError(grpc.StatusCode.PERMISSION_DENIED), Exit.DENIED),
    (FakeRpcError(grpc.StatusCode.UNAUTHENTICATED), Exit.DENIED),
    (FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT), Exit.USAGE),
    (FakeRpcError(grpc.StatusCode.INTERNAL), Exit.FAILED),
    (FakeRpcError(grpc.StatusCode.NOT_FOUND, "BLOB_NOT_FOUND"), Exit.NOT_FOUND),
])
def test_each_error_class_has_its_exit_code(error: BaseException, code: Exit) -> None:
    assert exit_code(error) == code


class FailingSession:
    """Stands in for `fedhive.sdk.Session`: every call raises `error`."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __getattr__(self, name: str) -> Callable[..., NoReturn]:
        def fail(*args: Any, **kwargs: Any) -> NoReturn:
            raise self.error

        return fail

    def __enter__(self) -> FailingSession:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        return None


@pytest.fixture
def failing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[BaseException], None]:
    """`failing(error)`: the CLI's session raises `error` on every call."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("FEDHIVE_GATEWAY", "127.0.0.1:9")
    monkeypatch.setenv("FEDHIVE_TOKEN", "x")

    def install(error: BaseException) -> None:
        monkeypatch.setattr(GatewayTarget, "open", lambda self: FailingSession(error))

    return install


ERRORS = [
    (errors.InvalidArgument("job id prefix ab is ambiguous: it matches a, b"), Exit.USAGE),
    (errors.NotFound("job x not found"), Exit.NOT_FOUND),
    (errors.PermissionDenied("user 'm' (member) is not authorized to abort"), Exit.DENIED),
    (errors.Unauthenticated("invalid bearer token"), Exit.DENIED),
    (errors.Unavailable("gateway 127.0.0.1:9 is unavailable: connection refused"),
     Exit.UNREACHABLE),
    (errors.RpcTimeout("no reply within 30 s"), Exit.UNREACHABLE),
    (errors.FailedPrecondition("job x is not done (RUNNING)"), Exit.FAILED),
]
COMMANDS = [["job", "x"], ["abort", "x"], ["delete", "x"], ["clone", "x"], ["resume", "x"],
            ["download", "x"], ["watch", "x"], ["metrics", "x"], ["jobs"], ["sites"],
            ["submit", "JOB_ZIP"]]


@pytest.mark.parametrize(("error", "code"), ERRORS)
def test_every_job_command_exits_with_the_errors_code_in_one_line(
    failing: Callable[[BaseException], None], tmp_path: Path, error: BaseException, code: Exit
) -> None:
    failing(error)
    archive = tmp_path / "job.zip"
    archive.write_bytes(job_zip("exits"))
    for command in COMMANDS:
        args = [str(archive) if arg == "JOB_ZIP" else arg for arg in command]
        if command[0] == "download":
            args += ["-o", str(tmp_path / "out")]
        for as_json in ([], ["--json"]):
            result = runner.invoke(app, [*args, *as_json])
            assert result.exit_code == code, (command, result.output)
            assert result.stderr == f"error: {error}\n", command
            assert result.stdout == "" and "Traceback" not in result.output


@pytest.mark.parametrize("args", [
    ["jobs", "-n", "-1"], ["jobs", "--status", "DONE"], ["watch"],
    ["watch", "x", "--interval", "0"], ["no-such-command"], ["abort", "x", "--bogus"],
])
def test_usage_errors_exit_2(failing: Callable[[BaseException], None], args: list[str]) -> None:
    failing(AssertionError("never reached: usage is checked first"))
    assert runner.invoke(app, args).exit_code == Exit.USAGE


def test_the_console_script_maps_what_slips_through(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    def slipping() -> NoReturn:
        raise errors.Unavailable("redis at r:6379 unavailable for x: gone")

    monkeypatch.setattr(cli_main, "app", slipping)
    with pytest.raises(SystemExit) as ended:
        cli_main.main()
    assert ended.value.code == Exit.UNREACHABLE
    assert capsys.readouterr().err == "error: redis at r:6379 unavailable for x: gone\n"


# --json everywhere ------------------------------------------------------------------------------
def _leaf_commands(group: Any, path: str = "") -> dict[str, Any]:
    """Every command under a (typer's click) group, by its full name (`poc start`)."""
    found: dict[str, Any] = {}
    for name in group.list_commands(None):
        command = group.get_command(None, name)  # loads a command not loaded yet
        if hasattr(command, "commands"):  # a group
            found.update(_leaf_commands(command, f"{path}{name} "))
        else:
            found[f"{path}{name}"] = command
    return found


def test_every_command_takes_json() -> None:
    commands = _leaf_commands(typer.main.get_command(app))
    assert {"validate", "admin-token", "poc start", "poc stop", "version", "demo"} <= set(
        commands)
    lacking = [name for name, command in commands.items()
               if not any("--json" in param.opts for param in command.params)]
    assert lacking == []


def test_version_json() -> None:
    result = runner.invoke(app, ["version", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout) == {"version": __version__}


def test_admin_token_json_holds_token_and_entry() -> None:
    result = runner.invoke(app, ["admin-token", "Dave@D.org", "--org", "d", "--role", "member",
                                 "--json"])
    assert result.exit_code == 0 and result.stderr == ""
    values = json.loads(result.stdout)
    assert list(values) == ["name", "token", "entry"] and values["name"] == "Dave@D.org"
    admin = AdminDirectory.parse({"admins": [values["entry"]]}).authenticate(values["token"])
    assert (admin.name, admin.org, admin.role.value) == ("dave@d.org", "d", "member")


def test_validate_json_for_a_valid_and_an_invalid_job(tmp_path: Path) -> None:
    archive = tmp_path / "job.zip"
    archive.write_bytes(job_zip("valid-json"))
    result = runner.invoke(app, ["validate", str(archive), "--json"])
    assert result.exit_code == 0 and result.stderr == ""
    assert json.loads(result.stdout) == {
        "path": str(archive), "valid": True, "name": "valid-json", "apps": ["srv", "cli"],
        "deploy_map": {"srv": ["server"], "cli": ["site-1", "site-2"]},
        "sites": ["site-1", "site-2"], "min_clients": 1,
        "summary": "job 'valid-json': apps srv -> server, cli -> site-1 site-2; sites site-1, "
                   "site-2",
    }
    folder = tmp_path / "bad"
    (folder / "app" / "config").mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"name": "bad", "min_clients": 0,
                                                  "deploy_map": {"app": ["site-1"]}}))
    (folder / "app" / "config" / "config_fed_client.json").write_text("{}")
    invalid = runner.invoke(app, ["validate", str(folder), "--json"])
    assert invalid.exit_code == Exit.USAGE and invalid.stderr == ""
    values = json.loads(invalid.stdout)
    assert (values["path"], values["valid"]) == (str(folder), False)
    assert len(values["violations"]) >= 2 and any("min_clients" in v for v in values["violations"])
    human = runner.invoke(app, ["validate", str(folder)])
    assert human.exit_code == Exit.USAGE and human.stderr.splitlines() == values["violations"]
    missing = runner.invoke(app, ["validate", str(tmp_path / "nope"), "--json"])
    assert missing.exit_code == Exit.USAGE
    assert "no such file or folder" in json.loads(missing.stdout)["violations"][0]


def test_poc_stop_json_when_nothing_runs(tmp_path: Path) -> None:
    result = runner.invoke(app, ["poc", "stop", "--dir", str(tmp_path / "poc"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"dir": str(tmp_path / "poc"), "running": False,
                                         "stopped": [], "killed": [], "strays": 0,
                                         "problems": []}


def test_poc_start_and_demo_json_schemas(tmp_path: Path) -> None:
    layout = PocLayout.at(tmp_path / "poc")
    state = PocState(root=str(layout.root), namespace="poc", sites=["site-1", "site-2"],
                     gateway="127.0.0.1:50051", s3_endpoint="http://127.0.0.1:8333",
                     embedded_s3=True, started_at="2025-01-01T00:00:00Z")
    values = started_json(Started(state, layout, Settings(), "fh_token"))
    assert values == {
        "dir": str(layout.root), "gateway": "127.0.0.1:50051", "namespace": "poc",
        "sites": ["site-1", "site-2"], "s3_endpoint": "http://127.0.0.1:8333",
        "embedded_s3": True, "config": str(layout.cli_config),
        "export": f"export FEDHIVE_CONFIG={layout.cli_config}", "logs": str(layout.logs),
    }
    assert "fh_token" not in json.dumps(values)

    done = JobProgress("hello-numpy", "j1", JobStatus.FINISHED_COMPLETED, "", [
        RoundMetrics("sag", 0, 2, {"aggregate": {"accuracy": 0.5}}),
        RoundMetrics("sag", 1, 2, {"aggregate": {"accuracy": 0.75}}),
    ], started=10.0, ended=12.5)
    failed = JobProgress("hello-pt", "j2", JobStatus.FINISHED_ABORTED, "stopped", [],
                         started=10.0, ended=11.0)
    summary = demo_json([done, failed], {"j1": tmp_path / "result.zip"}, {"j1": None},
                        30.0, 5.0)
    assert summary == {
        "demo_seconds": 30.0, "poc_start_seconds": 5.0, "completed": False,
        "jobs": [
            {"name": "hello-numpy", "id": "j1", "status": "FINISHED:COMPLETED", "reason": "",
             "round": 2, "num_rounds": 2, "final_metrics": {"accuracy": 0.75}, "seconds": 2.5,
             "result": str(tmp_path / "result.zip"), "curve": None},
            {"name": "hello-pt", "id": "j2", "status": "FINISHED:ABORTED", "reason": "stopped",
             "round": 0, "num_rounds": None, "final_metrics": {}, "seconds": 1.0,
             "result": None, "curve": None},
        ],
    }
