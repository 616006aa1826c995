"""The `fedhive` command: version and configuration check."""

import json

from typer.testing import CliRunner

from fedhive import __version__
from fedhive.cli.main import app

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
