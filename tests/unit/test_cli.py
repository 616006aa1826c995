"""The `fedhive` command: version, configuration check, the command list."""

import inspect
import json

import pytest
import typer.main
from typer.testing import CliRunner

from fedhive import __version__
from fedhive.cli.lazy import load
from fedhive.cli.main import Commands, app

runner = CliRunner()


def test_version() -> None:
    result = runner.invoke(app, ["version"])
    assert result.exit_code == 0 and result.stdout.strip() == __version__


def test_config_masks_secrets() -> None:
    env = {
        "FEDHIVE_AMQP_URL": "amqps://site1:hunter2@mq.example:5671/%2F",
        "AWS_ACCESS_KEY_ID": "AKIAX",
        "AWS_SECRET_ACCESS_KEY": "hunter3",
    }
    result = runner.invoke(app, ["config", "--json"], env=env)
    assert result.exit_code == 0
    values = json.loads(result.stdout)
    assert values["amqp_url"] == "amqps://***@mq.example:5671/%2F"
    assert values["aws_secret_access_key"] == "***"
    assert "hunter" not in result.stdout


def test_config_rejects_bad_environment_in_one_line() -> None:
    result = runner.invoke(app, ["config"], env={"FEDHIVE_NAMESPACE": "Bad Name"})
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0
    assert "FEDHIVE_NAMESPACE" in result.stderr


@pytest.mark.parametrize("name", list(Commands.lazy))
def test_the_help_listing_shows_each_commands_own_line(name: str) -> None:
    # `fedhive --help` shows the table's line without importing the command: it must be the
    # first paragraph of the command's own help, as typer would show it.
    target, line = Commands.lazy[name]
    command = load(name, target)
    first = inspect.cleandoc(command.help or "").split("\n\n")[0].replace("\n", " ")
    assert (command.name, line) == (name, first)


def test_every_command_is_listed_and_runs_its_own_help() -> None:
    listed = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert listed.exit_code == 0
    names = typer.main.get_command(app).list_commands(None)  # type: ignore[arg-type]
    assert set(Commands.lazy) <= set(names) and {"version", "config"} <= set(names)
    for name in names:
        assert f" {name} " in listed.stdout
        own = runner.invoke(app, [name, "--help"])
        assert own.exit_code == 0 and f" {name} [OPTIONS]" in own.stdout, name
    poc = runner.invoke(app, ["poc", "status", "--help"])
    assert poc.exit_code == 0 and " poc status [OPTIONS]" in poc.stdout


def test_an_unknown_command_is_a_usage_error_with_a_suggestion() -> None:
    result = runner.invoke(app, ["jbos"])
    assert result.exit_code == 2 and "jobs" in result.stderr
